"""Operators that only move data: flatten, reshape, transpose, permute, concat, slice."""


from netdsl.errors import ShapeError
from netdsl.ir.ops._util import norm_axis
from netdsl.ir.registry import Arg, OpDef, grad_rule, kernel, register
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
    start, stop = a["start"], a["stop"]
    if not isinstance(size, int) or not 0 <= start < stop <= size:
        raise ShapeError(f"slice [{start}:{stop}] along axis {a['axis']} is out of range "
                         f"for {{x}}, which is {x}")
    return TensorType(x.shape[:ax] + (stop - start,) + x.shape[ax + 1:], x.dtype)


register(OpDef("slice", (Arg("x", "tensor"), Arg("axis", "axis"), Arg("start", "int"),
                         Arg("stop", "int")), _slice_shape, "shape",
               doc="x[start:stop] along one axis (`split` lowers to slices)"))



# -- backward operator ------------------------------------------------------------------------
register(OpDef("slice_grad", (Arg("dy", "tensor"), Arg("shape", "shape"), Arg("axis", "axis"),
                              Arg("start", "int")),
               lambda ins, a: TensorType(tuple(a["shape"]), ins[0].dtype), "backward",
               differentiable=False, doc="zeros of x's shape with dy placed at [start:...]"))


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


def _index(ndim, axis, start, stop):
    ax = axis % ndim
    return (slice(None),) * ax + (slice(start, stop),)


@kernel("slice")
def _slice(xp, ins, a, ctx):
    x = ins[0]
    return xp.ascontiguousarray(x[_index(x.ndim, a["axis"], a["start"], a["stop"])])


@kernel("slice_grad")
def _slice_grad(xp, ins, a, ctx):
    dy = ins[0]
    dx = xp.zeros(tuple(int(d) for d in a["shape"]), dtype=dy.dtype)
    ax = a["axis"] % dy.ndim
    dx[_index(dy.ndim, ax, a["start"], a["start"] + dy.shape[ax])] = dy
    return dx


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
                                        "axis": n.attrs["axis"], "start": n.attrs["start"]})]
