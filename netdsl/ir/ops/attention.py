"""Attention pieces: fused scaled dot-product attention (optionally causal) and a causal
mask for attention written out with matmul and softmax.

`scaled_dot_product_attention(q, k, v)` is torch's F.scaled_dot_product_attention without
dropout: softmax(q k^T * scale [+ causal mask]) v, scale = 1/sqrt(E) by default, the causal
mask keeping key j for query i when j <= i (top-left aligned, torch's is_causal). Its
backward recomputes the attention probabilities (`attention_probs`) instead of keeping
them, then uses matmul, transpose, softmax_grad and scale.
(Multi-head attention over a packed q/k/v projection: netdsl.ir.ops.attention_qkv.)
"""
import math

from netdsl.errors import ShapeError
from netdsl.ir.opdef import GT0, Arg, OpDef, grad_rule, kernel, register
from netdsl.ir.ops._util import fused_kernels, matmul, need_float
from netdsl.ir.types import TensorType


def _static(d, what, t):
    if not isinstance(d, int):
        raise ShapeError(f"scaled_dot_product_attention: the {what} dimension of {t} must be "
                         "static")


def _qk_check(q, k):
    need_float(q, "scaled_dot_product_attention", "q")
    if q.rank < 2 or k.rank != q.rank:
        raise ShapeError(f"scaled_dot_product_attention expects q and k of one rank >= 2, but "
                         f"{{q}} is {q} and {{k}} is {k}")
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1] or q.dtype != k.dtype:
        raise ShapeError(f"scaled_dot_product_attention: q [..., L, E] and k [..., S, E] must "
                         f"agree in the leading dims and E, but {{q}} is {q} and {{k}} is {k}")
    _static(q.shape[-1], "embedding", q)
    _static(q.shape[-2], "query", q)
    _static(k.shape[-2], "key", k)


def _sdpa_shape(ins, a):
    q, k, v = ins
    _qk_check(q, k)
    if v.rank != k.rank or v.shape[:-1] != k.shape[:-1] or v.dtype != q.dtype:
        raise ShapeError(f"scaled_dot_product_attention: v must be [..., S, Ev] like k "
                         f"[..., S, E], but {{k}} is {k} and {{v}} is {v}")
    if a["scale"] is not None and a["scale"] <= 0:
        raise ShapeError("scaled_dot_product_attention: scale must be positive")
    return TensorType(q.shape[:-1] + (v.shape[-1],), q.dtype)


def _sdpa_flops(ins, out, a):
    q, k, v = ins
    pairs = q.numel() // q.shape[-1] * k.shape[-2]  # batch x L x S
    return 2 * pairs * (q.shape[-1] + v.shape[-1]) + 5 * pairs


_ATTN = (Arg("causal", "bool", False), Arg("scale", "float", None, range=GT0))
def _scores_bytes(ins, out, a):
    """The attention probabilities [..., L, S] the kernel holds while it multiplies v."""
    q, k = ins[0], ins[1]
    return 4 * (q.numel() // q.shape[-1]) * k.shape[-2]


register(OpDef("scaled_dot_product_attention",
               (Arg("q", "tensor"), Arg("k", "tensor"), Arg("v", "tensor")) + _ATTN,
               _sdpa_shape, "matmul", flops=_sdpa_flops, workspace=_scores_bytes,
               retains=("inputs",), extra={"fused_kernels": ("gemm",)},
               doc="softmax(q k^T * scale) v over [..., L, E] queries, [..., S, E] keys and "
                   "[..., S, Ev] values; scale defaults to 1/sqrt(E); causal=true lets query "
                   "i see keys 0..i", precision="reduced"))


def _probs_shape(ins, a):
    q, k = ins
    _qk_check(q, k)
    return TensorType(q.shape[:-1] + (k.shape[-2],), q.dtype)


register(OpDef("attention_probs", (Arg("q", "tensor"), Arg("k", "tensor")) + _ATTN,
               _probs_shape, "backward",
               flops=lambda ins, out, a: out.numel() * (2 * ins[0].shape[-1] + 5),
               differentiable=False, extra={"fused_kernels": ("gemm",)},
               doc="softmax(q k^T * scale), masked if causal: recomputed for the backward",
               precision="reduced"))


def _mask_shape(ins, a):
    (x,) = ins
    need_float(x, "causal_mask")
    if x.rank < 2 or not all(isinstance(d, int) for d in x.shape[-2:]):
        raise ShapeError(f"causal_mask expects attention scores [..., L, S] with static L "
                         f"and S, but {{x}} is {x}")
    return x


# the fill value is finite (a softmax still gives it weight exactly 0, since every row keeps
# its diagonal), so that --check-numerics does not take the mask for an overflow
register(OpDef("causal_mask", (Arg("x", "tensor"), Arg("value", "float", -1e9)),
               _mask_shape, "elementwise", flops=lambda ins, out, a: out.numel(),
               extra={"output_attrs": ("value",)},  # (held as it is: f16 must hold it)
               doc="scores [..., L, S] with entry (i, j) set to `value` where j > i, so a "
                   "following softmax lets query i see keys 0..i"))
register(OpDef("causal_mask_grad", (Arg("dy", "tensor"),), lambda ins, a: ins[0], "backward",
               flops=lambda ins, out, a: out.numel(), differentiable=False,
               doc="dy with the masked entries zeroed"))


# -- kernels ----------------------------------------------------------------------------------
def _keep(xp, ls, ss):
    """[L, S] bool: key j is visible to query i (j <= i)."""
    return xp.arange(ss)[None, :] <= xp.arange(ls)[:, None]


def _probs(xp, q, k, a, fast):
    """In place on the one scores array, which becomes the result: no more scratch. The
    products on the fused kernels' threads where they take them (`fast`)."""
    scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    s = matmul(xp, q, xp.swapaxes(k, -1, -2), fast=fast)
    s *= scale
    if a["causal"]:
        xp.copyto(s, -xp.inf, where=~_keep(xp, s.shape[-2], s.shape[-1]))
    s -= s.max(axis=-1, keepdims=True)
    xp.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


@kernel("scaled_dot_product_attention")
def _sdpa(xp, ins, a, ctx):
    q, k, v = ins
    fast = fused_kernels(ctx)
    return matmul(xp, _probs(xp, q, k, a, fast), v, fast=fast)


@kernel("attention_probs")
def _attention_probs(xp, ins, a, ctx):
    return _probs(xp, ins[0], ins[1], a, fused_kernels(ctx))


@kernel("causal_mask")
def _causal_mask(xp, ins, a, ctx):
    x = ins[0]
    return xp.where(_keep(xp, x.shape[-2], x.shape[-1]), x, a["value"]).astype(x.dtype)


@kernel("causal_mask_grad")
def _causal_mask_grad(xp, ins, a, ctx):
    dy = ins[0]
    return xp.where(_keep(xp, dy.shape[-2], dy.shape[-1]), dy, 0.0).astype(dy.dtype)


# -- gradient rules ---------------------------------------------------------------------------
@grad_rule("scaled_dot_product_attention")
def _sdpa_rule(n, b, gy):
    q, k, v = n.inputs
    attrs = {"causal": n.attrs["causal"], "scale": n.attrs["scale"]}
    scale = attrs["scale"] if attrs["scale"] is not None else \
        1.0 / math.sqrt(b.type(q).shape[-1])
    p = b.emit("attention_probs", [q, k], attrs, tag="p")
    dv = b.emit("matmul", [b.emit("transpose", [p], tag="pT"), gy], tag="v")
    dp = b.emit("matmul", [gy, b.emit("transpose", [v], tag="vT")], tag="dp")
    ds = b.emit("scale", [b.emit("softmax_grad", [dp, p], {"axis": -1}, tag="ds")],
                {"factor": scale}, tag="dss")
    dq = b.emit("matmul", [ds, k], tag="q")
    dk = b.emit("matmul", [b.emit("transpose", [ds], tag="dsT"), q], tag="k")
    return [dq, dk, dv]


@grad_rule("causal_mask")
def _causal_mask_rule(n, b, gy):
    return [b.emit("causal_mask_grad", [gy])]
