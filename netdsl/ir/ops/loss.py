"""Softmax and the losses (scalar outputs, averaged over the batch)."""
from netdsl.errors import ShapeError
from netdsl.ir.ops._util import need_float, norm_axis
from netdsl.ir.registry import Arg, OpDef, grad_rule, kernel, register
from netdsl.ir.types import TensorType


def _softmax_shape(ins, a):
    need_float(ins[0], "softmax")
    norm_axis(a["axis"], ins[0].rank, "softmax")
    return ins[0]


register(OpDef("softmax", (Arg("x", "tensor"), Arg("axis", "axis", -1)), _softmax_shape,
               "activation", flops=lambda ins, out, a: 5 * out.numel(), retains=("output",),
               doc="softmax along an axis (the last by default)"))


def _sce_shape(ins, a):
    logits, labels = ins
    need_float(logits, "softmax_cross_entropy", "logits")
    if labels.dtype not in ("i32", "i64"):
        raise ShapeError(f"softmax_cross_entropy expects integer class labels, but "
                         f"{{labels}} is {labels}")
    if logits.rank < 2:
        raise ShapeError(f"softmax_cross_entropy expects logits of rank 2 or more, but "
                         f"{{logits}} is {logits}")
    ax = norm_axis(a["axis"], logits.rank, "softmax_cross_entropy")
    if labels.shape != logits.shape[:ax] + logits.shape[ax + 1:]:
        raise ShapeError(f"softmax_cross_entropy expects labels shaped like the logits "
                         f"without the class dimension (axis {a['axis']}), but {{logits}} "
                         f"is {logits} and {{labels}} is {labels}")
    return TensorType((), logits.dtype)


# the class axis as PyTorch's F.cross_entropy: dim 1 of [N, C] or [N, C, d1, ...] scores;
# `axis=-1` for [N, T, C] (a language model's per-token scores)
register(OpDef("softmax_cross_entropy",
               (Arg("logits", "tensor"), Arg("labels", "tensor"), Arg("axis", "axis", 1)),
               _sce_shape, "loss", flops=lambda ins, out, a: 6 * ins[0].numel(),
               retains=("inputs",),
               doc="mean over all positions of -log softmax(logits)[label]; classes along "
                   "`axis` (1, as PyTorch: [N, C] or [N, C, H, W] scores)"))


def _mse_shape(ins, a):
    p, t = ins
    need_float(p, "mse", "pred")
    if p.shape != t.shape or p.dtype != t.dtype:
        raise ShapeError(f"mse expects prediction and target of one type, but {{pred}} is "
                         f"{p} and {{target}} is {t}")
    return TensorType((), p.dtype)


register(OpDef("mse", (Arg("pred", "tensor"), Arg("target", "tensor")), _mse_shape, "loss",
               flops=lambda ins, out, a: 3 * ins[0].numel(), retains=("inputs",),
               doc="mean squared error over all elements"))


# -- backward operators -----------------------------------------------------------------------
register(OpDef("softmax_grad", (Arg("dy", "tensor"), Arg("y", "tensor"), Arg("axis", "axis", -1)),
               lambda ins, a: ins[1], "backward", flops=lambda ins, out, a: 4 * out.numel(),
               differentiable=False, doc="dx = y * (dy - sum(dy * y)) along the axis"))
register(OpDef("softmax_cross_entropy_grad",
               (Arg("dy", "tensor"), Arg("logits", "tensor"), Arg("labels", "tensor"),
                Arg("axis", "axis", 1)),
               lambda ins, a: ins[1], "backward", flops=lambda ins, out, a: 6 * out.numel(),
               differentiable=False, doc="d(logits) = dy * (softmax(logits) - onehot) / M"))
register(OpDef("mse_grad", (Arg("dy", "tensor"), Arg("pred", "tensor"), Arg("target", "tensor")),
               lambda ins, a: ins[1], "backward", flops=lambda ins, out, a: 3 * out.numel(),
               differentiable=False, doc="d(pred) = dy * 2 (pred - target) / numel"))


# -- kernels ----------------------------------------------------------------------------------
def _softmax_fn(xp, x, axis):
    e = xp.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@kernel("softmax")
def _softmax(xp, ins, a, ctx):
    return _softmax_fn(xp, ins[0], a["axis"])


@kernel("softmax_grad")
def _softmax_grad(xp, ins, a, ctx):
    dy, y = ins
    return y * (dy - (dy * y).sum(axis=a["axis"], keepdims=True))


def _flat(xp, logits, labels, axis):
    """Scores as [positions, classes] (the class axis moved last) and labels as [positions]."""
    z = xp.moveaxis(logits, axis, -1)
    return z.reshape(-1, z.shape[-1]), labels.reshape(-1)


@kernel("softmax_cross_entropy")
def _sce(xp, ins, a, ctx):
    z, t = _flat(xp, *ins, a["axis"])
    m = z.max(axis=1, keepdims=True)
    lse = xp.log(xp.exp(z - m).sum(axis=1)) + m[:, 0]
    picked = xp.take_along_axis(z, t[:, None].astype(xp.int64), axis=1)[:, 0]
    return (lse - picked).mean()


@kernel("softmax_cross_entropy_grad")
def _sce_grad(xp, ins, a, ctx):
    dy, logits, labels = ins
    z, t = _flat(xp, logits, labels, a["axis"])
    p = _softmax_fn(xp, z, 1)
    p[xp.arange(z.shape[0]), t] -= 1.0
    moved = xp.moveaxis(logits, a["axis"], -1).shape
    return xp.ascontiguousarray(xp.moveaxis((p * (dy / z.shape[0])).reshape(moved), -1,
                                            a["axis"]))


@kernel("mse")
def _mse(xp, ins, a, ctx):
    d = ins[0] - ins[1]
    return (d * d).mean()


@kernel("mse_grad")
def _mse_grad(xp, ins, a, ctx):
    dy, p, t = ins
    return (p - t) * (dy * (2.0 / p.size))


# -- gradient rules ---------------------------------------------------------------------------
@grad_rule("softmax")
def _softmax_rule(n, b, gy):
    return [b.emit("softmax_grad", [gy, n.name], {"axis": n.attrs["axis"]})]


@grad_rule("softmax_cross_entropy")
def _sce_rule(n, b, gy):
    return [b.emit("softmax_cross_entropy_grad", [gy, n.inputs[0], n.inputs[1]],
                   {"axis": n.attrs["axis"]}), None]


@grad_rule("mse")
def _mse_rule(n, b, gy):
    dp = b.emit("mse_grad", [gy, n.inputs[0], n.inputs[1]], tag="pred")
    return [dp, b.emit("scale", [dp], {"factor": -1.0}, tag="target")]
