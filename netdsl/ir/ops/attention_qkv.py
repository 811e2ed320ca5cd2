"""Multi-head attention over a packed q/k/v projection.

qkv [N, T, 3D] holds q, k and v side by side on its last axis (a transformer's fused input
projection, torch.nn.MultiheadAttention's in_proj order), each cut into `heads` heads of
hd = D / heads. Head h's probabilities are P = softmax(q k^T * scale) (scale defaults to
1/sqrt(hd); causal=true lets query i see keys 0..i), [N, heads, T, T]; its result is P v,
and the heads are merged back into [N, T, D] (head h in columns h*hd..(h+1)*hd).

- `attention_qkv(qkv)`: the whole of it. Its gradient `attention_qkv_grad(dy, qkv)`
  recomputes the probabilities (nothing [N, heads, T, T] kept between the passes).
- `attention_qkv_probs(qkv)` then `attention_qkv(qkv, p)`: the same split in two, P kept
  for the backward. attention_qkv with `p` is P v merged: its gradients are dv =
  P^T dy (`attention_qkv_grad_values`) and dP = dy v^T (`attention_qkv_grad_probs`), and
  the probabilities' gradient gives dq and dk (`attention_qkv_probs_grad`); autodiff sums
  the two dqkv, and the fuse_grads pass joins the three nodes and the sum into one
  `attention_qkv_grad(dy, qkv, p)`.

The `fuse` pass makes these, on a CPU step, out of attention written out (slices of the
projection, heads split by reshape and permute, the two products, scale and softmax or
scaled_dot_product_attention, heads merged by permute and reshape;
netdsl.passes.fuse_attention), keeping P where it is small next to q, k and v. With the
fused kernels (netdsl.backends.numpy_fused_attention) each runs an (image, head) pair a
task, heads read and written in place as strided blocks; the NumPy kernels here are the
reference (batched products over strided views of the heads).
"""
from __future__ import annotations

import math

from netdsl.errors import ShapeError
from netdsl.ir.opdef import POSITIVE, Arg, OpDef, grad_rule, kernel, register
from netdsl.ir.ops._util import fused_kernels, matmul, need_float
from netdsl.ir.ops.attention import _ATTN, _probs, _static
from netdsl.ir.types import TensorType

_HEADS = Arg("heads", "int", range=POSITIVE)
_QKV = (_HEADS,) + _ATTN


def _probs_type(qkv: TensorType, heads: int) -> TensorType:
    return TensorType((qkv.shape[0], heads, qkv.shape[1], qkv.shape[1]), qkv.dtype)


def _merged_type(qkv: TensorType) -> TensorType:
    return TensorType(qkv.shape[:2] + (qkv.shape[2] // 3,), qkv.dtype)


def _need(t: TensorType, want: TensorType, op: str, what: str) -> None:
    if t != want:
        raise ShapeError(f"{op}: {what} must be {want}, but it is {t}")


def _qkv(qkv: TensorType, a, op: str) -> TensorType:
    """qkv's type [N, T, 3D], checked (static T and 3D, cut into `heads` heads), and the
    scale."""
    need_float(qkv, op, "qkv")
    if qkv.rank != 3:
        raise ShapeError(f"{op} expects qkv [N, T, 3D], but {{qkv}} is {qkv}")
    _static(qkv.shape[1], "sequence", qkv)
    _static(qkv.shape[2], "last", qkv)
    if qkv.shape[2] % (3 * a["heads"]):
        raise ShapeError(f"{op}: the last dimension of {{qkv}}, {qkv.shape[2]}, is not 3 x "
                         f"{a['heads']} heads x a head width (q, k and v side by side)")
    if a.get("scale") is not None and a["scale"] <= 0:
        raise ShapeError(f"{op}: scale must be positive")
    return qkv


def _attention_shape(ins, a):
    qkv = _qkv(ins[0], a, "attention_qkv")
    if len(ins) > 1:
        _need(ins[1], _probs_type(qkv, a["heads"]), "attention_qkv", "the probabilities {p}")
    return _merged_type(qkv)


def _grad_shape(ins, a):
    qkv = _qkv(ins[1], a, "attention_qkv_grad")
    _need(ins[0], _merged_type(qkv), "attention_qkv_grad", "the gradient {dy}")
    if len(ins) > 2:
        _need(ins[2], _probs_type(qkv, a["heads"]), "attention_qkv_grad",
              "the probabilities {p}")
    return qkv


def _values_grad_shape(ins, a):
    dy, p = ins
    need_float(dy, "attention_qkv_grad_values", "dy")
    if dy.rank != 3 or dy.shape[2] % a["heads"] or p != TensorType(
            (dy.shape[0], a["heads"], dy.shape[1], dy.shape[1]), dy.dtype):
        raise ShapeError(f"attention_qkv_grad_values: dy [N, T, D] and p [N, heads, T, T] "
                         f"must agree, but {{dy}} is {dy} and {{p}} is {p}")
    return TensorType(dy.shape[:2] + (3 * dy.shape[2],), dy.dtype)


def _probs_grad_of_dy_shape(ins, a):
    qkv = _qkv(ins[1], a, "attention_qkv_grad_probs")
    _need(ins[0], _merged_type(qkv), "attention_qkv_grad_probs", "the gradient {dy}")
    return _probs_type(qkv, a["heads"])


def _probs_grad_shape(ins, a):
    dp, p, qkv = ins
    want = _probs_type(_qkv(qkv, a, "attention_qkv_probs_grad"), a["heads"])
    _need(dp, want, "attention_qkv_probs_grad", "the gradient {dp}")
    _need(p, want, "attention_qkv_probs_grad", "the probabilities {p}")
    return qkv


def _pairs(qkv: TensorType, a) -> int:
    """N x heads x T x T: the (query, key) pairs, the probabilities' size."""
    return qkv.shape[0] * a["heads"] * qkv.shape[1] ** 2


def _hd(qkv: TensorType, a) -> int:
    return qkv.shape[2] // 3 // a["heads"]


def _scratch(qkv: TensorType, a, probs: float, merged: float = 0) -> int:
    """Bytes of `probs` float32 [N, heads, T, T] arrays and `merged` [N, T, D] ones: what
    the NumPy reference kernel holds besides its inputs and result (the fused kernels
    hold two [T, T] buffers a thread)."""
    return int(4 * (probs * _pairs(qkv, a) + merged * qkv.numel() // 3))


register(OpDef(
    "attention_qkv", (Arg("qkv", "tensor"), Arg("p", "tensor", None)) + _QKV,
    _attention_shape, "matmul",
    flops=lambda ins, out, a: _pairs(ins[0], a) * (2 * _hd(ins[0], a) if len(ins) > 1
                                                   else 4 * _hd(ins[0], a) + 5),
    workspace=lambda ins, out, a: _scratch(ins[0], a, len(ins) == 1, 1),
    retains=("inputs",), extra={"fused_kernels": ("attention",)},
    doc="multi-head attention over packed q/k/v: qkv [N, T, 3D] (q, k, v side by side, each "
        "of `heads` heads) -> [N, T, D], each head's softmax(q k^T * scale) v, heads merged; "
        "with p (attention_qkv_probs' result) P v; made by the fuse pass on a CPU step",
        precision="reduced"))
register(OpDef(
    "attention_qkv_probs", (Arg("qkv", "tensor"),) + _QKV,
    lambda ins, a: _probs_type(_qkv(ins[0], a, "attention_qkv_probs"), a["heads"]), "matmul",
    flops=lambda ins, out, a: _pairs(ins[0], a) * (2 * _hd(ins[0], a) + 5),
    workspace=lambda ins, out, a: _scratch(ins[0], a, 0.25),  # the rows' max and sum
    retains=("inputs", "output"), extra={"fused_kernels": ("attention",)},
    doc="each head's softmax(q k^T * scale) [N, heads, T, T] of packed q/k/v [N, T, 3D], "
        "kept for attention_qkv(qkv, p) and its backward", precision="reduced"))
register(OpDef(
    "attention_qkv_grad",
    (Arg("dy", "tensor"), Arg("qkv", "tensor"), Arg("p", "tensor", None)) + _QKV,
    _grad_shape, "backward", differentiable=False, extra={"fused_kernels": ("attention",)},
    flops=lambda ins, out, a: _pairs(ins[1], a) * (8 * _hd(ins[1], a) + 5 + (
        2 * _hd(ins[1], a) + 5 if len(ins) < 3 else 0)),
    workspace=lambda ins, out, a: _scratch(ins[1], a, 2 if len(ins) > 2 else 3, 1),
    doc="attention_qkv's dqkv from dy, with p the kept probabilities, else recomputed"))
register(OpDef(
    "attention_qkv_grad_values", (Arg("dy", "tensor"), Arg("p", "tensor"), _HEADS),
    _values_grad_shape, "backward", differentiable=False,
    flops=lambda ins, out, a: 2 * ins[1].numel() * ins[0].shape[2] // a["heads"],
    workspace=lambda ins, out, a: 4 * ins[0].numel(),
    doc="attention_qkv(qkv, p)'s gradient of qkv: the values' part P^T dy, zero for q "
        "and k"))
register(OpDef(
    "attention_qkv_grad_probs", (Arg("dy", "tensor"), Arg("qkv", "tensor"), _HEADS),
    _probs_grad_of_dy_shape, "backward", differentiable=False,
    flops=lambda ins, out, a: 2 * out.numel() * _hd(ins[1], a),
    doc="attention_qkv(qkv, p)'s gradient of p: dy v^T per head"))
register(OpDef(
    "attention_qkv_probs_grad",
    (Arg("dp", "tensor"), Arg("p", "tensor"), Arg("qkv", "tensor")) + _QKV,
    _probs_grad_shape, "backward", differentiable=False,
    flops=lambda ins, out, a: ins[0].numel() * (4 * _hd(ins[2], a) + 4),
    workspace=lambda ins, out, a: _scratch(ins[2], a, 2),
    doc="attention_qkv_probs' gradient of qkv from dP: dq and dk through the softmax, zero "
        "for v"))


# -- kernels ----------------------------------------------------------------------------------
def heads_of(x, heads: int, parts: int):
    """x [N, T, parts*D] as `parts` [N, heads, T, hd] views (no copy): q, k, v of qkv
    (parts 3), or the merged heads (parts 1)."""
    n, t, w = x.shape
    by_head = x.reshape(n, t, parts, heads, w // parts // heads)
    return [by_head[:, :, j].transpose(0, 2, 1, 3) for j in range(parts)]


def _scale(a, qkv) -> float:
    return a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(qkv.shape[2] // 3
                                                                     // a["heads"])


def _out(xp, ctx, shape, dtype):
    return xp.empty(shape, dtype) if ctx.out is None else ctx.out


def _reference_probs(xp, qkv, a):
    q, k, _ = heads_of(qkv, a["heads"], 3)
    return _probs(xp, q, k, {**a, "scale": _scale(a, qkv)}, None)


@kernel("attention_qkv")
def _attention_qkv(xp, ins, a, ctx):
    qkv, p = ins[0], (ins[1] if len(ins) > 1 else None)
    heads, scale = a["heads"], _scale(a, qkv)
    f = fused_kernels(ctx)  # (its attention methods check the arrays)
    if f is not None:
        y = f.attention(qkv, heads, scale, a["causal"], ctx.out, p)
        if y is not None:
            return y
    n, t, d3 = qkv.shape
    y = _out(xp, ctx, (n, t, d3 // 3), qkv.dtype)
    p = _reference_probs(xp, qkv, a) if p is None else p
    # each head's product written into its columns of y (a strided view)
    matmul(xp, p, heads_of(qkv, heads, 3)[2], out=heads_of(y, heads, 1)[0])
    return y


@kernel("attention_qkv_probs")
def _attention_qkv_probs(xp, ins, a, ctx):
    (qkv,) = ins
    f = fused_kernels(ctx)
    if f is not None:
        p = f.attention_probs(qkv, a["heads"], _scale(a, qkv), a["causal"], ctx.out)
        if p is not None:
            return p
    return _reference_probs(xp, qkv, a)


def _probs_backward(xp, ds, p, qkv, scale, dqkv, heads):
    """dq and dk into dqkv's views from dP (`ds`, overwritten with the scores' gradient)."""
    q, k, _ = heads_of(qkv, heads, 3)
    dq, dk, _ = heads_of(dqkv, heads, 3)
    ds -= (ds * p).sum(axis=-1, keepdims=True)
    ds *= p
    ds *= scale
    matmul(xp, ds, k, out=dq)
    matmul(xp, xp.swapaxes(ds, -1, -2), q, out=dk)


@kernel("attention_qkv_grad")
def _attention_qkv_grad(xp, ins, a, ctx):
    dy, qkv = ins[0], ins[1]
    p = ins[2] if len(ins) > 2 else None
    heads, scale = a["heads"], _scale(a, qkv)
    f = fused_kernels(ctx)
    if f is not None:
        dqkv = f.attention_grad(dy, qkv, heads, scale, a["causal"], ctx.out, p)
        if dqkv is not None:
            return dqkv
    dqkv = _out(xp, ctx, qkv.shape, qkv.dtype)
    gy = heads_of(dy, heads, 1)[0]
    p = _reference_probs(xp, qkv, a) if p is None else p  # recomputed unless kept
    matmul(xp, xp.swapaxes(p, -1, -2), gy, out=heads_of(dqkv, heads, 3)[2])
    ds = matmul(xp, gy, xp.swapaxes(heads_of(qkv, heads, 3)[2], -1, -2))  # dP
    _probs_backward(xp, ds, p, qkv, scale, dqkv, heads)
    return dqkv


@kernel("attention_qkv_grad_values")
def _attention_qkv_grad_values(xp, ins, a, ctx):
    dy, p = ins
    n, t, d = dy.shape
    dqkv = xp.zeros((n, t, 3 * d), dy.dtype) if ctx.out is None else ctx.out
    if ctx.out is not None:
        dqkv.fill(0)
    matmul(xp, xp.swapaxes(p, -1, -2), heads_of(dy, a["heads"], 1)[0],
           out=heads_of(dqkv, a["heads"], 3)[2])
    return dqkv


@kernel("attention_qkv_grad_probs")
def _attention_qkv_grad_probs(xp, ins, a, ctx):
    dy, qkv = ins
    heads = a["heads"]
    return matmul(xp, heads_of(dy, heads, 1)[0],
                  xp.swapaxes(heads_of(qkv, heads, 3)[2], -1, -2))


@kernel("attention_qkv_probs_grad")
def _attention_qkv_probs_grad(xp, ins, a, ctx):
    dp, p, qkv = ins
    dqkv = xp.zeros_like(qkv) if ctx.out is None else ctx.out
    if ctx.out is not None:
        dqkv.fill(0)
    _probs_backward(xp, dp.copy(), p, qkv, _scale(a, qkv), dqkv, a["heads"])
    return dqkv


# -- gradient rules ---------------------------------------------------------------------------
@grad_rule("attention_qkv")
def _attention_qkv_rule(n, b, gy):
    attrs = dict(n.attrs)
    if len(n.inputs) == 1:  # the probabilities recomputed
        return [b.emit("attention_qkv_grad", [gy, n.inputs[0]], attrs, tag="qkv")]
    qkv, p = n.inputs
    heads = {"heads": attrs["heads"]}
    return [b.emit("attention_qkv_grad_values", [gy, p], heads, tag="qkv"),
            b.emit("attention_qkv_grad_probs", [gy, qkv], heads, tag="p")]


@grad_rule("attention_qkv_probs")
def _attention_qkv_probs_rule(n, b, gy):
    return [b.emit("attention_qkv_probs_grad", [gy, n.name, n.inputs[0]], dict(n.attrs),
                   tag="qkv")]
