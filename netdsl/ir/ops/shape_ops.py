"""Operators that only move data: flatten, reshape, transpose, permute, concat, slice,
squeeze, unsqueeze, expand, gather."""


from netdsl.errors import ShapeError
from netdsl.ir.opdef import (
    ANY_DEVICE,
    NON_NEGATIVE,
    OPS,
    POSITIVE,
    Arg,
    OpDef,
    grad_rule,
    kernel,
    register,
)
from netdsl.ir.ops._util import fused_kernels, norm_axis
from netdsl.ir.types import Dim, TensorType, mul_dims


def _flatten_shape(ins, a):
    (x,) = ins
    if x.rank < 2:
        raise ShapeError(f"flatten expects a tensor of rank 2 or more, but {{x}} is {x}")
    s = norm_axis(a["start"], x.rank, "flatten")
    return TensorType(x.shape[:s] + (mul_dims(x.shape[s:]),), x.dtype)


register(OpDef("flatten", (Arg("x", "tensor"), Arg("start", "axis", 1)), _flatten_shape,
               "shape", view_of=0, doc="merge dims start.. into one: [N, C, H, W] -> [N, C*H*W]"))


def _factor(dims) -> tuple[int, tuple[str, ...]]:
    """Split dims into (product of the static parts, sorted symbolic factors)."""
    p, syms = 1, []
    for d in dims:
        if isinstance(d, int):
            p *= d
        else:
            for f in str(d).split("*"):
                if f.isdigit():
                    p *= int(f)
                else:
                    syms.append(f)
    return p, tuple(sorted(syms))


def _reshape_shape(ins, a):
    (x,) = ins
    target: list[Dim] = list(a["shape"])
    shown = "(" + ", ".join(str(d) for d in target) + ")"
    if any(d == "N" for d in target[1:]):
        raise ShapeError(f"reshape: the batch dimension N may only come first, not in {shown}")
    if sum(1 for d in target if d == -1) > 1:
        raise ShapeError("reshape: at most one dimension may be -1")
    if any(isinstance(d, int) and d < -1 or d == 0 for d in target):
        raise ShapeError(f"reshape: invalid target shape {shown}")
    src_p, src_s = _factor(x.shape)
    known = [d for d in target if d != -1]
    dst_p, dst_s = _factor(known)
    if -1 in target:
        rest = list(src_s)
        for s in dst_s:
            if s not in rest:
                raise ShapeError(f"reshape cannot make {shown} from {{x}}, which is {x}")
            rest.remove(s)
        if src_p % dst_p:
            raise ShapeError(f"reshape cannot make {shown} from {{x}}, which is {x}: "
                             f"{src_p} elements do not divide by {dst_p}")
        fill = mul_dims(list(rest) + [src_p // dst_p])
        target = [fill if d == -1 else d for d in target]
    elif (src_p, src_s) != (dst_p, dst_s):
        raise ShapeError(f"reshape cannot make {shown} from {{x}}, which is {x}: "
                         f"the number of elements differs")
    return TensorType(tuple(target), x.dtype)


register(OpDef("reshape", (Arg("x", "tensor"), Arg("shape", "shape")), _reshape_shape,
               "shape", view_of=0,
               doc="same elements, new shape; one dim may be -1, N is the batch"))


def _permute_shape(ins, a):
    (x,) = ins
    perm = [norm_axis(p, x.rank, "permute") for p in a["dims"]]
    if sorted(perm) != list(range(x.rank)):
        raise ShapeError(f"permute: {tuple(a['dims'])} is not a permutation of the "
                         f"{x.rank} dims of {{x}}, which is {x}")
    return TensorType(tuple(x.shape[p] for p in perm), x.dtype)


register(OpDef("permute", (Arg("x", "tensor"), Arg("dims", "ints")), _permute_shape, "shape",
               view_of=0, doc="reorder all dimensions"))


def _transpose_shape(ins, a):
    (x,) = ins
    i, j = norm_axis(a["dim0"], x.rank, "transpose"), norm_axis(a["dim1"], x.rank, "transpose")
    s = list(x.shape)
    s[i], s[j] = s[j], s[i]
    return TensorType(tuple(s), x.dtype)


register(OpDef("transpose", (Arg("x", "tensor"), Arg("dim0", "axis", -2),
                             Arg("dim1", "axis", -1)), _transpose_shape, "shape",
               view_of=0, doc="swap two dimensions (the last two by default)"))


def _concat_shape(ins, a):
    first = ins[0]
    ax = norm_axis(a["axis"], first.rank, "concat")
    total: list[Dim] = []
    for k, t in enumerate(ins):
        if t.rank != first.rank or t.dtype != first.dtype or any(
                t.shape[i] != first.shape[i] for i in range(first.rank) if i != ax):
            raise ShapeError(f"concat along axis {a['axis']}: input {k + 1} is {t} but "
                             f"input 1 is {first}; all dimensions but axis {a['axis']} "
                             "must agree")
        total.append(t.shape[ax])
    if not all(isinstance(d, int) for d in total):
        raise ShapeError("concat: the concatenated axis must be static")
    return TensorType(first.shape[:ax] + (sum(total),) + first.shape[ax + 1:], first.dtype)


register(OpDef("concat", (Arg("xs", "tensors"), Arg("axis", "axis", 1)), _concat_shape,
               "shape", doc="join tensors along an axis (channels by default)"))


def _slice_shape(ins, a):
    (x,) = ins
    ax = norm_axis(a["axis"], x.rank, "slice")
    size = x.shape[ax]
    start, stop, step = a["start"], a["stop"], a["step"]
    if step < 1:
        raise ShapeError(f"slice: step must be positive, not {step}")
    if not isinstance(size, int) or not 0 <= start < stop <= size:
        raise ShapeError(f"slice [{start}:{stop}] along axis {a['axis']} is out of range "
                         f"for {{x}}, which is {x}")
    n = len(range(start, stop, step))
    return TensorType(x.shape[:ax] + (n,) + x.shape[ax + 1:], x.dtype)


register(OpDef("slice", (Arg("x", "tensor"), Arg("axis", "axis"),
                         Arg("start", "int", range=NON_NEGATIVE),
                         Arg("stop", "int", range=POSITIVE), Arg("step", "int", 1, range=POSITIVE)),
               _slice_shape, "shape", reads_part=True,
               doc="x[start:stop:step] along one axis (`split` lowers to slices)"))


def _squeeze_shape(ins, a):
    (x,) = ins
    from netdsl.ir.ops.reduce import axes_of
    axes = axes_of(a["axis"], x.rank, "squeeze")
    for ax in axes:
        if x.shape[ax] != 1:
            raise ShapeError(f"squeeze: dimension {ax} of {{x}} is {x.shape[ax]}, not 1; "
                             f"{{x}} is {x}")
    return TensorType(tuple(d for i, d in enumerate(x.shape) if i not in axes), x.dtype)


register(OpDef("squeeze", (Arg("x", "tensor"), Arg("axis", "axes")), _squeeze_shape, "shape",
               doc="remove size-1 dimensions (one axis or a tuple)"))


def _unsqueeze_shape(ins, a):
    (x,) = ins
    ax = norm_axis(a["axis"], x.rank + 1, "unsqueeze")
    if ax == 0 and x.rank and x.shape[0] == "N":
        raise ShapeError("unsqueeze: the batch dimension N must stay first")
    return TensorType(x.shape[:ax] + (1,) + x.shape[ax:], x.dtype)


register(OpDef("unsqueeze", (Arg("x", "tensor"), Arg("axis", "axis")), _unsqueeze_shape,
               "shape", doc="insert a size-1 dimension at `axis` (of the result)"))


def _expand_shape(ins, a):
    (x,) = ins
    target = list(a["shape"])
    if len(target) < x.rank:
        raise ShapeError(f"expand: shape {tuple(target)} has fewer dimensions than {{x}}, "
                         f"which is {x}")
    lead = len(target) - x.rank
    out = []
    for i, d in enumerate(target):
        src = x.shape[i - lead] if i >= lead else None
        if d == -1:
            if src is None:
                raise ShapeError("expand: -1 is only allowed for existing dimensions")
            d = src
        elif src is not None and src != 1 and src != d:
            raise ShapeError(f"expand: dimension {i - lead} of {{x}} is {src} and cannot "
                             f"become {d}; {{x}} is {x}")
        elif not (d == "N" or isinstance(d, int) and d >= 1):
            raise ShapeError(f"expand: invalid size {d}")
        out.append(d)
    return TensorType(tuple(out), x.dtype)


register(OpDef("expand", (Arg("x", "tensor"), Arg("shape", "shape")), _expand_shape, "shape",
               doc="broadcast size-1 dimensions to `shape` (-1 keeps a dimension)"))


def _gather_shape(ins, a):
    x, idx = ins
    if idx.dtype not in ("i32", "i64"):
        raise ShapeError(f"gather expects integer indices, but {{index}} is {idx}")
    ax = norm_axis(a["axis"], x.rank, "gather")
    if ax == 0 and x.shape[0] == "N":
        raise ShapeError("gather along the batch dimension is not supported")
    if not isinstance(x.shape[ax], int):
        raise ShapeError(f"gather: the axis it indexes must be static, but {{x}} is {x}")
    if ax > 0 and idx.rank and idx.shape[0] == "N":
        raise ShapeError(f"gather along axis {ax} takes indices without the batch "
                         f"dimension, but {{index}} is {idx}")
    return TensorType(x.shape[:ax] + idx.shape + x.shape[ax + 1:], x.dtype)


register(OpDef("gather", (Arg("x", "tensor"), Arg("index", "tensor"), Arg("axis", "axis", 0)),
               _gather_shape, "shape", flops=lambda ins, out, a: 0, retains=("input1",),
               doc="take entries of x at integer indices along an axis (ONNX Gather; "
                   "negative indices count from the end)"))


def _gather_elements_shape(ins, a):
    x, idx = ins
    if idx.dtype not in ("i32", "i64"):
        raise ShapeError(f"gather_elements expects integer indices, but {{index}} is {idx}")
    ax = norm_axis(a["axis"], x.rank, "gather_elements")
    if idx.rank != x.rank or any(idx.shape[d] != x.shape[d] for d in range(x.rank)
                                 if d != ax):
        raise ShapeError(f"gather_elements: {{index}} ({idx}) must have the shape of {{x}} "
                         f"({x}) except along axis {a['axis']}")
    if ax == 0 and x.shape[0] == "N":
        raise ShapeError("gather_elements along the batch dimension is not supported")
    return TensorType(idx.shape, x.dtype)


register(OpDef("gather_elements", (Arg("x", "tensor"), Arg("index", "tensor"),
                                   Arg("axis", "axis")),
               _gather_elements_shape, "shape", retains=("input1",),
               doc="out[..., i, ...] = x[..., index[..., i, ...], ...] along `axis` "
                   "(torch.gather, ONNX GatherElements): per-example selection"))


# -- backward operator ------------------------------------------------------------------------
register(OpDef("slice_grad", (Arg("dy", "tensor"), Arg("shape", "shape"), Arg("axis", "axis"),
                              Arg("start", "int", range=NON_NEGATIVE),
                              Arg("step", "int", 1, range=POSITIVE)),
               lambda ins, a: TensorType(tuple(a["shape"]), ins[0].dtype), "backward",
               differentiable=False, doc="zeros of x's shape with dy placed at [start::step]"))
register(OpDef("gather_elements_grad", (Arg("dy", "tensor"), Arg("index", "tensor"),
                                        Arg("shape", "shape"), Arg("axis", "axis")),
               lambda ins, a: TensorType(tuple(a["shape"]), ins[0].dtype), "backward",
               differentiable=False, flops=lambda ins, out, a: ins[0].numel(),
               doc="scatter-add dy into zeros of x's shape at the indices along `axis`"))
register(OpDef("gather_grad", (Arg("dy", "tensor"), Arg("index", "tensor"),
                               Arg("shape", "shape"), Arg("axis", "axis", 0)),
               lambda ins, a: TensorType(tuple(a["shape"]), ins[0].dtype), "backward",
               differentiable=False, flops=lambda ins, out, a: ins[0].numel(),
               doc="scatter-add dy into zeros of x's shape at the indices",
               extra={"fused_kernels": ("scatter",)}))


# -- kernels ----------------------------------------------------------------------------------
# Views (reshape, transpose, permute) are returned as views; slice copies so that a small
# slice does not keep its whole source alive behind the executor's byte accounting.
@kernel("flatten")
def _flatten(xp, ins, a, ctx):
    x = ins[0]
    s = a["start"] % x.ndim
    return x.reshape(x.shape[:s] + (-1,))


@kernel("reshape")
def _reshape(xp, ins, a, ctx):
    return ins[0].reshape(tuple(int(d) for d in a["shape"]))


@kernel("permute")
def _permute(xp, ins, a, ctx):
    return xp.transpose(ins[0], tuple(a["dims"]))


@kernel("transpose")
def _transpose(xp, ins, a, ctx):
    return xp.swapaxes(ins[0], a["dim0"], a["dim1"])


@kernel("concat")
def _concat(xp, ins, a, ctx):
    return xp.concatenate(ins, axis=a["axis"])


def _index(ndim, axis, start, stop, step=1):
    ax = axis % ndim
    return (slice(None),) * ax + (slice(start, stop, step),)


@kernel("slice")
def _slice(xp, ins, a, ctx):
    x = ins[0]
    return xp.ascontiguousarray(x[_index(x.ndim, a["axis"], a["start"], a["stop"], a["step"])])


@kernel("slice_grad")
def _slice_grad(xp, ins, a, ctx):
    dy = ins[0]
    dx = xp.zeros(tuple(int(d) for d in a["shape"]), dtype=dy.dtype)
    ax = a["axis"] % dy.ndim
    step = a["step"]
    dx[_index(dy.ndim, ax, a["start"], a["start"] + step * (dy.shape[ax] - 1) + 1, step)] = dy
    return dx


@kernel("squeeze")
def _squeeze(xp, ins, a, ctx):
    x = ins[0]
    axes = a["axis"] if isinstance(a["axis"], tuple) else (a["axis"],)
    # copies, not views: a view of a parameter would change under an in-place update
    return xp.squeeze(x, axis=tuple(ax % x.ndim for ax in axes)).copy()


@kernel("unsqueeze")
def _unsqueeze(xp, ins, a, ctx):
    return xp.expand_dims(ins[0], a["axis"] % (ins[0].ndim + 1)).copy()


@kernel("expand")
def _expand(xp, ins, a, ctx):
    x = ins[0]
    shape = list(a["shape"])
    lead = len(shape) - x.ndim
    shape = [x.shape[i - lead] if d == -1 else int(d) for i, d in enumerate(shape)]
    return xp.ascontiguousarray(xp.broadcast_to(x, tuple(shape)))


def checked_indices(xp, idx, size, ctx, negative=True, what="index"):
    """Indices as non-negative int64, or a NetdslError naming the node when one lies outside
    [-size, size) ([0, size) without `negative`): NumPy would wrap a negative index
    silently, and CuPy reads out of bounds without a word."""
    from netdsl.errors import NetdslError
    idx = idx.astype(xp.int64)
    if idx.size and getattr(ctx, "capturing", False):
        # a recorded step reads nothing back (checked on its first run): wrap negatives
        return xp.where(idx < 0, idx + size, idx) if negative else idx
    if idx.size:
        lo, hi = int(idx.min()), int(idx.max())
        low = -size if negative else 0
        if lo < low or hi >= size:
            n = ctx.node
            raise NetdslError(
                f"{n.op} %{n.name}: {what} {lo if lo < low else hi} is out of range; "
                f"valid values are {low} to {size - 1} (the dimension has size {size})",
                loc=n.loc, stack=n.stack)
        if lo < 0:
            idx = xp.where(idx < 0, idx + size, idx)
    return idx


def scatter_add_rows(xp, ctx, out, idx, rows):
    """out[idx] += rows with repeated indices accumulating in order (np.add.at): out is
    [size, ...], idx checked non-negative (checked_indices), rows idx.shape + out.shape[1:].
    One Numba loop where the fused kernels take the arrays (add.at is slow)."""
    f = fused_kernels(ctx, out, rows)
    if f is not None:
        f.scatter_add_rows(out.reshape(out.shape[0], -1), xp.ascontiguousarray(idx).reshape(-1),
                           rows.reshape(idx.size, -1))
    else:
        xp.add.at(out, idx, rows)


def _element_index(xp, idx, ax):
    """The full advanced index that `take_along_axis(x, idx, ax)` reads."""
    out = []
    for d, n in enumerate(idx.shape):
        if d == ax:
            out.append(idx)
        else:
            out.append(xp.arange(n).reshape((n,) + (1,) * (idx.ndim - d - 1)))
    return tuple(out)


@kernel("gather_elements")
def _gather_elements(xp, ins, a, ctx):
    x, idx = ins
    ax = a["axis"] % x.ndim
    return xp.take_along_axis(x, checked_indices(xp, idx, x.shape[ax], ctx), axis=ax)


@kernel("gather_elements_grad")
def _gather_elements_grad(xp, ins, a, ctx):
    dy, idx = ins
    shape = tuple(int(d) for d in a["shape"])
    ax = a["axis"] % len(shape)
    dx = xp.zeros(shape, dtype=dy.dtype)
    xp.add.at(dx, _element_index(xp, checked_indices(xp, idx, shape[ax], ctx), ax), dy)
    return dx


@kernel("gather")
def _gather(xp, ins, a, ctx):
    x, idx = ins
    ax = a["axis"] % x.ndim
    return xp.take(x, checked_indices(xp, idx, x.shape[ax], ctx), axis=ax)


@kernel("gather_grad")
def _gather_grad(xp, ins, a, ctx):
    dy, idx = ins
    shape = tuple(int(d) for d in a["shape"])
    ax = a["axis"] % len(shape)
    idx = checked_indices(xp, idx, shape[ax], ctx)
    # move the gathered axis first: dy [..., idx..., ...] -> [idx..., lead..., trail...],
    # and scatter into a contiguous [size, lead..., trail...] array
    k = idx.ndim
    dyv = xp.moveaxis(dy, tuple(range(ax, ax + k)), tuple(range(k)))
    dx = xp.zeros((shape[ax],) + shape[:ax] + shape[ax + 1:], dtype=dy.dtype)
    scatter_add_rows(xp, ctx, dx, idx, dyv)
    return xp.ascontiguousarray(xp.moveaxis(dx, 0, ax))


# -- gradient rules ---------------------------------------------------------------------------
def _back_to_input(n, b, gy):
    return [b.emit("reshape", [gy], {"shape": b.type(n.inputs[0]).shape})]


grad_rule("flatten")(_back_to_input)
grad_rule("reshape")(_back_to_input)


@grad_rule("permute")
def _permute_rule(n, b, gy):
    rank = b.type(n.inputs[0]).rank
    perm = [p % rank for p in n.attrs["dims"]]
    inverse = [perm.index(i) for i in range(rank)]
    return [b.emit("permute", [gy], {"dims": tuple(inverse)})]


@grad_rule("transpose")
def _transpose_rule(n, b, gy):
    return [b.emit("transpose", [gy], {"dim0": n.attrs["dim0"], "dim1": n.attrs["dim1"]})]


@grad_rule("concat")
def _concat_rule(n, b, gy):
    ax = n.attrs["axis"]
    out, start = [], 0
    for k, x in enumerate(n.inputs):
        t = b.type(x)
        size = t.shape[ax % t.rank]
        out.append(b.emit("slice", [gy], {"axis": ax, "start": start, "stop": start + size},
                          tag=f"in{k}"))
        start += size
    return out


@grad_rule("slice")
def _slice_rule(n, b, gy):
    return [b.emit("slice_grad", [gy], {"shape": b.type(n.inputs[0]).shape,
                                        "axis": n.attrs["axis"], "start": n.attrs["start"],
                                        "step": n.attrs["step"]})]


grad_rule("squeeze")(_back_to_input)
grad_rule("unsqueeze")(_back_to_input)


@grad_rule("expand")
def _expand_rule(n, b, gy):
    return [b.emit("sum_to", [gy], {"shape": b.type(n.inputs[0]).shape})]


@grad_rule("gather_elements")
def _gather_elements_rule(n, b, gy):
    x, idx = n.inputs
    return [b.emit("gather_elements_grad", [gy, idx], {"shape": b.type(x).shape,
                                                       "axis": n.attrs["axis"]}), None]


@grad_rule("gather")
def _gather_rule(n, b, gy):
    x, idx = n.inputs
    return [b.emit("gather_grad", [gy, idx], {"shape": b.type(x).shape,
                                              "axis": n.attrs["axis"]}), None]


# these move values without computing on them: any element type as it is, so under mixed
# precision a 2-byte value is not converted to f32 and back around them
for _name in ("flatten", "reshape", "permute", "transpose", "concat", "slice", "squeeze",
              "unsqueeze", "expand", "slice_grad"):
    OPS[_name].reads_reduced = ANY_DEVICE
