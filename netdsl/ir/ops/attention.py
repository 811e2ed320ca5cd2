"""Attention pieces: fused scaled dot-product attention (optionally causal), multi-head
attention over packed q/k/v, and a causal mask for attention written out with matmul and
softmax.

`scaled_dot_product_attention(q, k, v)` is torch's F.scaled_dot_product_attention without
dropout: softmax(q k^T * scale [+ causal mask]) v, scale = 1/sqrt(E) by default, the causal
mask keeping key j for query i when j <= i (top-left aligned, torch's is_causal). Its
backward recomputes the attention probabilities (`attention_probs`) instead of keeping
them, then uses matmul, transpose, softmax_grad and scale.

`attention_qkv(qkv, heads)` is a transformer's whole multi-head attention between its input
and output projections: qkv [N, T, 3D] holds q, k and v side by side on its last axis (the
fused input projection's result, torch.nn.MultiheadAttention's in_proj order), each cut
into `heads` heads of D / heads; the result [N, T, D] is every head's
softmax(q k^T * scale) v with the heads merged back (head h in columns h*hd..(h+1)*hd).
The `fuse` pass makes it, on a CPU step, out of the written-out form (three slices, each
head split by reshape and permute, the two products, scale and softmax, the heads merged
by permute and reshape) or out of that around scaled_dot_product_attention. Its gradient
`attention_qkv_grad(dy, qkv)` recomputes the probabilities: with the fused kernels
(netdsl.backends.numpy_fused_attention) an (image, head) pair a task, in cache, no head
copied and nothing [N, heads, T, T] kept or allocated.
"""
import math

from netdsl.errors import ShapeError
from netdsl.ir.ops._util import fused_kernels, matmul, need_float
from netdsl.ir.registry import GT0, POSITIVE, Arg, OpDef, grad_rule, kernel, register
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
               retains=("inputs",), extra={"fused_kernels": True},
               doc="softmax(q k^T * scale) v over [..., L, E] queries, [..., S, E] keys and "
                   "[..., S, Ev] values; scale defaults to 1/sqrt(E); causal=true lets query "
                   "i see keys 0..i"))


def _probs_shape(ins, a):
    q, k = ins
    _qk_check(q, k)
    return TensorType(q.shape[:-1] + (k.shape[-2],), q.dtype)


register(OpDef("attention_probs", (Arg("q", "tensor"), Arg("k", "tensor")) + _ATTN,
               _probs_shape, "backward",
               flops=lambda ins, out, a: out.numel() * (2 * ins[0].shape[-1] + 5),
               differentiable=False, extra={"fused_kernels": True},
               doc="softmax(q k^T * scale), masked if causal: recomputed for the backward"))


_QKV = (Arg("heads", "int", range=POSITIVE),) + _ATTN


def _qkv_dims(qkv, a, op):
    """(T, D, head width) of qkv [N, T, 3D] for `heads` heads."""
    need_float(qkv, op, "qkv")
    if qkv.rank != 3:
        raise ShapeError(f"{op} expects qkv [N, T, 3D], but {{qkv}} is {qkv}")
    _static(qkv.shape[1], "sequence", qkv)
    _static(qkv.shape[2], "last", qkv)
    if qkv.shape[2] % (3 * a["heads"]):
        raise ShapeError(f"{op}: the last dimension of {{qkv}} ({qkv}) must be 3 x heads x "
                         f"the head width, with heads={a['heads']}")
    d = qkv.shape[2] // 3
    return qkv.shape[1], d, d // a["heads"]


def _qkv_shape(ins, a):
    (qkv,) = ins
    _, d, _ = _qkv_dims(qkv, a, "attention_qkv")
    if a["scale"] is not None and a["scale"] <= 0:
        raise ShapeError("attention_qkv: scale must be positive")
    return TensorType(qkv.shape[:2] + (d,), qkv.dtype)


def _qkv_pairs(qkv, a):
    """N x heads x T x T: the (query, key) pairs, each head's scores."""
    t, _, _ = _qkv_dims(qkv, a, "attention_qkv")
    return qkv.numel() // qkv.shape[2] * a["heads"] * t


def _qkv_flops(ins, out, a):
    (qkv,) = ins
    hd = _qkv_dims(qkv, a, "attention_qkv")[2]
    return _qkv_pairs(qkv, a) * (4 * hd + 5)  # two products, the softmax


def _qkv_scores_bytes(copies):
    """`copies` float32 [N, heads, T, T] arrays and the heads' [N, heads, T, hd] results:
    what the NumPy reference kernel holds besides its inputs and result (the fused kernels
    hold two [T, T] buffers a thread)."""
    def rule(ins, out, a):
        qkv = ins[-1]
        return 4 * (copies * _qkv_pairs(qkv, a) + qkv.numel() // 3)
    return rule


register(OpDef("attention_qkv", (Arg("qkv", "tensor"),) + _QKV, _qkv_shape, "matmul",
               flops=_qkv_flops, workspace=_qkv_scores_bytes(1), retains=("inputs",),
               extra={"fused_kernels": True},
               doc="multi-head attention over packed q/k/v: qkv [N, T, 3D] (q, k, v side by "
                   "side, each of `heads` heads) -> [N, T, D], each head's softmax(q k^T * "
                   "scale) v, heads merged; made by the fuse pass on a CPU step"))


def _qkv_grad_shape(ins, a):
    dy, qkv = ins
    if _qkv_shape([qkv], a) != dy:
        raise ShapeError(f"attention_qkv_grad: dy must be attention_qkv's result type, but "
                         f"{{dy}} is {dy} and {{qkv}} is {qkv}")
    return qkv


register(OpDef("attention_qkv_grad", (Arg("dy", "tensor"), Arg("qkv", "tensor")) + _QKV,
               _qkv_grad_shape, "backward",
               flops=lambda ins, out, a: _qkv_flops(ins[1:], out, a) * 5 // 2,
               workspace=_qkv_scores_bytes(3), differentiable=False,
               extra={"fused_kernels": True},
               doc="attention_qkv's gradient dqkv from dy, the probabilities recomputed"))


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


def _heads(qkv, heads):
    """q, k and v of qkv [N, T, 3D] as [N, heads, T, hd] views (no copy)."""
    n, t, d3 = qkv.shape
    by_head = qkv.reshape(n, t, 3, heads, d3 // 3 // heads)
    return [by_head[:, :, j].transpose(0, 2, 1, 3) for j in range(3)]


def _qkv_scale(a, qkv) -> float:
    hd = qkv.shape[2] // 3 // a["heads"]
    return a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(hd)


@kernel("attention_qkv")
def _attention_qkv(xp, ins, a, ctx):
    (qkv,) = ins
    heads, scale = a["heads"], _qkv_scale(a, qkv)
    f = fused_kernels(ctx, qkv)
    if f is not None:
        y = f.attention(qkv, heads, scale, a["causal"], ctx.out)
        if y is not None:
            return y
    n, t, d3 = qkv.shape
    q, k, v = _heads(qkv, heads)
    y = xp.empty((n, t, d3 // 3), qkv.dtype) if ctx.out is None else ctx.out
    # each head's product written into its columns of y (a strided view)
    p = _probs(xp, q, k, {**a, "scale": scale}, None)
    matmul(xp, p, v, out=y.reshape(n, t, heads, -1).transpose(0, 2, 1, 3))
    return y


@kernel("attention_qkv_grad")
def _attention_qkv_grad(xp, ins, a, ctx):
    dy, qkv = ins
    heads, scale = a["heads"], _qkv_scale(a, qkv)
    f = fused_kernels(ctx, dy, qkv)
    if f is not None:
        dqkv = f.attention_grad(dy, qkv, heads, scale, a["causal"], ctx.out)
        if dqkv is not None:
            return dqkv
    n, t, _ = qkv.shape
    q, k, v = _heads(qkv, heads)
    dqkv = xp.empty_like(qkv) if ctx.out is None else ctx.out
    dq, dk, dv = _heads(dqkv, heads)
    gy = dy.reshape(n, t, heads, -1).transpose(0, 2, 1, 3)
    p = _probs(xp, q, k, {**a, "scale": scale}, None)  # recomputed
    matmul(xp, xp.swapaxes(p, -1, -2), gy, out=dv)
    ds = matmul(xp, gy, xp.swapaxes(v, -1, -2))  # dp, then softmax's and the scale's grads
    ds -= (ds * p).sum(axis=-1, keepdims=True)
    ds *= p
    ds *= scale
    matmul(xp, ds, k, out=dq)
    matmul(xp, xp.swapaxes(ds, -1, -2), q, out=dk)
    return dqkv


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


@grad_rule("attention_qkv")
def _attention_qkv_rule(n, b, gy):
    return [b.emit("attention_qkv_grad", [gy, n.inputs[0]], dict(n.attrs), tag="qkv")]


@grad_rule("causal_mask")
def _causal_mask_rule(n, b, gy):
    return [b.emit("causal_mask_grad", [gy])]
