"""Binary element-wise arithmetic with broadcasting (add, sub, mul) and scaling.

Also the generic helpers that gradient rules emit: `sum_to` (undo broadcasting),
`sum_except` (per-channel sums, e.g. bias gradients) and `fill` (constants such as the loss
seed d(loss)/d(loss) = 1, and the scalar constants of expressions like `x - 1`).
"""
from math import prod

from netdsl.errors import ShapeError
from netdsl.ir.opdef import ANY_DEVICE, Arg, OpDef, grad_rule, kernel, register
from netdsl.ir.ops._util import broadcast, fused_kernels, norm_axis
from netdsl.ir.types import DTYPES, TensorType


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
                   doc=f"element-wise {_name} with NumPy broadcasting",
                   extra={"fused_kernels": ("elementwise",)} if _name == "add" else {}))

register(OpDef("scale", (Arg("x", "tensor"), Arg("factor", "float")),
               lambda ins, a: ins[0], "elementwise", flops=lambda ins, out, a: out.numel(),
               doc="multiply by a constant (the language's `x * 0.5`)"))


# -- helpers emitted by gradient rules --------------------------------------------------------
def _to_shape(ins, a):
    return TensorType(tuple(a["shape"]), ins[0].dtype)


def _sum_to_shape(ins, a):
    (x,) = ins
    target = TensorType(tuple(a["shape"]), x.dtype)
    if broadcast(target, x, "sum_to") != x.shape:
        raise ShapeError(f"sum_to: {tuple(a['shape'])} does not broadcast to {{x}}, "
                         f"which is {x}")
    return target


register(OpDef("sum_to", (Arg("x", "tensor"), Arg("shape", "shape")), _sum_to_shape,
               "backward", flops=lambda ins, out, a: ins[0].numel(), differentiable=False,
               doc="sum over broadcast dimensions so x takes `shape` (undoes broadcasting)"))


def _sum_except_shape(ins, a):
    (x,) = ins
    ax = norm_axis(a["axis"], x.rank, "sum_except")
    return TensorType((x.shape[ax],), x.dtype)


register(OpDef("sum_except", (Arg("x", "tensor"), Arg("axis", "axis")), _sum_except_shape,
               "backward", flops=lambda ins, out, a: ins[0].numel(), differentiable=False,
               doc="sum over every axis but one: [N, C, H, W] -> [C] for axis 1"))

register(OpDef("fill", (Arg("shape", "shape"), Arg("value", "float", 0.0),
                        Arg("dtype", "str", "f32", choices=tuple(DTYPES))),
               lambda ins, a: TensorType(tuple(a["shape"]), a["dtype"]), "other",
               differentiable=False, reads_reduced=ANY_DEVICE,
               extra={"output_attrs": ("value",)},  # (held as it is: f16 must hold it)
               doc="a constant tensor (the loss seed, zero gradients)"))


# -- kernels ----------------------------------------------------------------------------------
@kernel("add")
def _add(xp, ins, a, ctx):
    x, y = ins
    f = fused_kernels(ctx, x, y)
    if f is not None and f.threads > 1 and x.shape == y.shape and x.dtype == y.dtype:
        # on the loops' threads (on one, NumPy's own add is as fast)
        out = ctx.out_like(x)
        f.add(x.reshape(-1), y.reshape(-1), False, out.reshape(-1))
        return out
    return ctx.into(xp.add, x, y)


@kernel("sub")
def _sub(xp, ins, a, ctx):
    return ins[0] - ins[1]


@kernel("mul")
def _mul(xp, ins, a, ctx):
    return ins[0] * ins[1]


@kernel("scale")
def _scale(xp, ins, a, ctx):
    return ins[0] * float(a["factor"])  # a Python float keeps the array's dtype


def sum_to(xp, x, shape):
    """Sum `x` over the dimensions that broadcasting added or stretched to reach `shape`."""
    shape = tuple(shape)
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, d in enumerate(shape) if d == 1 and x.shape[lead + i] != 1)
    if axes:
        x = x.sum(axis=axes, keepdims=True)
    return x.reshape(shape)


@kernel("sum_to")
def _sum_to(xp, ins, a, ctx):
    return sum_to(xp, ins[0], a["shape"])


@kernel("sum_except")
def _sum_except(xp, ins, a, ctx):
    x = ins[0]
    ax = a["axis"] % x.ndim
    if x.flags.c_contiguous and x.dtype.kind == "f" and x.size:
        # as matrix-vector products with ones (BLAS), not NumPy's sum over the leading
        # axes, which adds one row at a time (a transformer's bias gradients)
        lead, trail = prod(x.shape[:ax]), prod(x.shape[ax + 1:])
        y = (x.reshape(lead, x.shape[ax]) if trail == 1
             else xp.matmul(x.reshape(lead, x.shape[ax], trail), xp.ones(trail, x.dtype)))
        return xp.matmul(xp.ones(lead, x.dtype), y)
    return x.sum(axis=tuple(i for i in range(x.ndim) if i != ax))


@kernel("fill")
def _fill(xp, ins, a, ctx):
    return xp.full(tuple(a["shape"]), a["value"], dtype=ctx.dtype_of(a["dtype"]))


# -- gradient rules ---------------------------------------------------------------------------
def unbroadcast(b, g: str, like: str) -> str:
    """The gradient `g` of a broadcast result, summed back to the shape of value `like`."""
    shape = b.type(like).shape
    if b.type(g).shape == shape:
        return g
    return b.emit("sum_to", [g], {"shape": shape}, tag="sum")


@grad_rule("add")
def _add_rule(n, b, gy):
    return [unbroadcast(b, gy, n.inputs[0]), unbroadcast(b, gy, n.inputs[1])]


@grad_rule("sub")
def _sub_rule(n, b, gy):
    neg = b.emit("scale", [unbroadcast(b, gy, n.inputs[1])], {"factor": -1.0}, tag="neg")
    return [unbroadcast(b, gy, n.inputs[0]), neg]


@grad_rule("mul")
def _mul_rule(n, b, gy):
    x, y = n.inputs
    da = unbroadcast(b, b.emit("mul", [gy, y], tag="a"), x)
    db = unbroadcast(b, b.emit("mul", [gy, x], tag="b"), y)
    return [da, db]


@grad_rule("scale")
def _scale_rule(n, b, gy):
    return [b.emit("scale", [gy], {"factor": n.attrs["factor"]})]

