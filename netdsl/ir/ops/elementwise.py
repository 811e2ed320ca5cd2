"""Binary element-wise arithmetic with broadcasting, scaling, and reductions."""
from netdsl.errors import ShapeError
from netdsl.ir.ops._util import broadcast, norm_axis
from netdsl.ir.registry import Arg, OpDef, register
from netdsl.ir.types import TensorType


def _binary(op):
    def shape(ins, a):
        x, y = ins
        if x.dtype != y.dtype:
            raise ShapeError(f"{op}: dtypes differ: {{a}} is {x} and {{b}} is {y}")
        return TensorType(broadcast(x, y, op), x.dtype)
    return shape


for _name, _ret in (("add", ()), ("sub", ()), ("mul", ("inputs",))):
    register(OpDef(_name, (Arg("a", "tensor"), Arg("b", "tensor")), _binary(_name),
                   "elementwise", flops=lambda ins, out, a: out.numel(), retains=_ret,
                   doc=f"element-wise {_name} with NumPy broadcasting"))

register(OpDef("scale", (Arg("x", "tensor"), Arg("factor", "float")),
               lambda ins, a: ins[0], "elementwise", flops=lambda ins, out, a: out.numel(),
               doc="multiply by a constant (the language's `x * 0.5`)"))


def _mean_shape(ins, a):
    (x,) = ins
    ax = norm_axis(a["axis"], x.rank, "mean")
    if ax == 0 and x.shape[0] == "N":
        raise ShapeError("mean over the batch dimension is not supported; use a loss")
    if a["keepdims"]:
        return TensorType(x.shape[:ax] + (1,) + x.shape[ax + 1:], x.dtype)
    return TensorType(x.shape[:ax] + x.shape[ax + 1:], x.dtype)


register(OpDef("mean", (Arg("x", "tensor"), Arg("axis", "axis"), Arg("keepdims", "bool", False)),
               _mean_shape, "reduce", flops=lambda ins, out, a: ins[0].numel(),
               doc="mean along one axis"))
