"""Reductions over one or several axes: mean, sum, amax, amin (torch names; ONNX
ReduceMean / ReduceSum / ReduceMax / ReduceMin), with `keepdims`.

`axis` is an int or a tuple of ints. The batch dimension cannot be reduced (a loss does
that), so a network's per-example results stay independent of how a batch is split.
"""
from netdsl.errors import ShapeError
from netdsl.ir.opdef import Arg, OpDef, grad_rule, kernel, register
from netdsl.ir.ops._util import norm_axis
from netdsl.ir.types import TensorType


def axes_of(axis, rank: int, op: str) -> tuple[int, ...]:
    """The sorted, non-negative axes that an `axes` attribute names."""
    axes = axis if isinstance(axis, tuple) else (axis,)
    out = sorted({norm_axis(ax, rank, op) for ax in axes})
    if len(out) != len(axes):
        raise ShapeError(f"{op}: axis {axis} names a dimension twice")
    return tuple(out)


def _reduced(shape, axes, keepdims):
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _shape(op):
    def shape(ins, a):
        (x,) = ins
        axes = axes_of(a["axis"], x.rank, op)
        if 0 in axes and x.shape[0] == "N":
            raise ShapeError(f"{op} over the batch dimension is not supported; use a loss")
        if op != "sum" and not x.is_float:
            raise ShapeError(f"{op} expects a floating-point input, but {{x}} is {x}")
        return TensorType(_reduced(x.shape, axes, a["keepdims"]), x.dtype)
    return shape


_SIG = (Arg("x", "tensor"), Arg("axis", "axes"), Arg("keepdims", "bool", False))
for _name, _ret, _doc in (
        ("mean", (), "mean over one axis or a tuple of axes"),
        ("sum", (), "sum over one axis or a tuple of axes"),
        ("amax", ("inputs", "output"), "maximum over axes (ties share the gradient)"),
        ("amin", ("inputs", "output"), "minimum over axes (ties share the gradient)")):
    # a sum's result grows with the count (past f16's range): in f32 under mixed precision
    register(OpDef(_name, _SIG, _shape(_name), "reduce",
                   flops=lambda ins, out, a: ins[0].numel(), retains=_ret, doc=_doc,
                   precision="f32" if _name == "sum" else "follow"))


# -- backward operators -----------------------------------------------------------------------
def _spread_shape(op):
    def shape(ins, a):
        dy = ins[0]
        x = TensorType(tuple(a["shape"]), dy.dtype)
        want = _reduced(x.shape, axes_of(a["axis"], x.rank, op), a["keepdims"])
        if dy.shape != want:
            raise ShapeError(f"{op}: {{dy}} is {dy}, expected shape {want}")
        return x
    return shape


_GSIG = (Arg("dy", "tensor"), Arg("shape", "shape"), Arg("axis", "axes"),
         Arg("keepdims", "bool", False))
register(OpDef("mean_grad", _GSIG, _spread_shape("mean_grad"), "backward",
               flops=lambda ins, out, a: out.numel(), differentiable=False,
               doc="backward of mean: spread dy evenly over the reduced axes"))
register(OpDef("sum_grad", _GSIG, _spread_shape("sum_grad"), "backward",
               flops=lambda ins, out, a: out.numel(), differentiable=False,
               doc="backward of sum: broadcast dy over the reduced axes"))
register(OpDef("extremum_grad", (Arg("dy", "tensor"), Arg("x", "tensor"), Arg("y", "tensor"),
                                 Arg("axis", "axes"), Arg("keepdims", "bool", False)),
               lambda ins, a: ins[1], "backward", flops=lambda ins, out, a: 3 * out.numel(),
               differentiable=False,
               doc="backward of amax/amin: dy to the elements equal to the result, split "
                   "evenly among ties"))


# -- kernels ----------------------------------------------------------------------------------
def _np_axes(a, ndim):
    return tuple(ax % ndim for ax in (a["axis"] if isinstance(a["axis"], tuple)
                                      else (a["axis"],)))


@kernel("mean")
def _mean(xp, ins, a, ctx):
    return xp.mean(ins[0], axis=_np_axes(a, ins[0].ndim), keepdims=a["keepdims"])


@kernel("sum")
def _sum(xp, ins, a, ctx):
    return xp.sum(ins[0], axis=_np_axes(a, ins[0].ndim), keepdims=a["keepdims"])


@kernel("amax")
def _amax(xp, ins, a, ctx):
    return xp.max(ins[0], axis=_np_axes(a, ins[0].ndim), keepdims=a["keepdims"])


@kernel("amin")
def _amin(xp, ins, a, ctx):
    return xp.min(ins[0], axis=_np_axes(a, ins[0].ndim), keepdims=a["keepdims"])


def _expand(xp, dy, shape, axes, keepdims):
    """dy with the reduced axes restored as size-1 dims (a view)."""
    if keepdims:
        return dy
    return dy.reshape(tuple(1 if i in axes else d for i, d in enumerate(shape)))


def _spread(scale_by_count):
    def k(xp, ins, a, ctx):
        shape = tuple(int(d) for d in a["shape"])
        axes = _np_axes(a, len(shape))
        dy = _expand(xp, ins[0], shape, axes, a["keepdims"])
        if scale_by_count:
            count = 1
            for ax in axes:
                count *= shape[ax]
            dy = dy * (1.0 / count)
        return xp.ascontiguousarray(xp.broadcast_to(dy, shape))
    return k


kernel("mean_grad")(_spread(True))
kernel("sum_grad")(_spread(False))


@kernel("extremum_grad")
def _extremum_grad(xp, ins, a, ctx):
    dy, x, y = ins
    axes = _np_axes(a, x.ndim)
    dy = _expand(xp, dy, x.shape, axes, a["keepdims"])
    y = _expand(xp, y, x.shape, axes, a["keepdims"])
    hit = (x == y).astype(dy.dtype)
    return hit * (dy / hit.sum(axis=axes, keepdims=True))


# -- gradient rules ---------------------------------------------------------------------------
def _spread_rule(op):
    def rule(n, b, gy):
        x = n.inputs[0]
        return [b.emit(op, [gy], {"shape": b.type(x).shape, "axis": n.attrs["axis"],
                                  "keepdims": n.attrs["keepdims"]})]
    return rule


grad_rule("mean")(_spread_rule("mean_grad"))
grad_rule("sum")(_spread_rule("sum_grad"))


def _extremum_rule(n, b, gy):
    return [b.emit("extremum_grad", [gy, n.inputs[0], n.name],
                   {"axis": n.attrs["axis"], "keepdims": n.attrs["keepdims"]})]


grad_rule("amax")(_extremum_rule)
grad_rule("amin")(_extremum_rule)
