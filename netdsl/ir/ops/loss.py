"""Softmax and the losses (scalar outputs, averaged over the batch)."""
from netdsl.errors import ShapeError
from netdsl.ir.ops._util import need_float, norm_axis
from netdsl.ir.registry import Arg, OpDef, register
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
    if logits.rank < 2 or labels.shape != logits.shape[:-1]:
        raise ShapeError(f"softmax_cross_entropy expects labels shaped like the logits "
                         f"without the class dimension, but {{logits}} is {logits} and "
                         f"{{labels}} is {labels}")
    return TensorType((), logits.dtype)


register(OpDef("softmax_cross_entropy", (Arg("logits", "tensor"), Arg("labels", "tensor")),
               _sce_shape, "loss", flops=lambda ins, out, a: 6 * ins[0].numel(),
               retains=("inputs",),
               doc="mean over all positions of -log softmax(logits)[label]"))


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
