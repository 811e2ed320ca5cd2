"""Ranges of a flattened tensor: how sharded data parallelism (ZeRO, `parallel.zero`)
takes each device's piece of a parameter and writes the gathered parameter back.

- `flat_piece(x, start, stop)`: a copy of elements [start, stop) of x flattened. A
  replica's piece of a parameter for its share of the optimizer step, updated in place
  by the update node, so it must not be a view of the parameter.
- `pack_flat(xs, count)`: the first `count` inputs flattened and joined (a replica's
  updated pieces of a bucket, the all-gather's input); the inputs after them only name
  the updates that wrote the pieces (verify: a read of a value written in place names
  its writer), so those can be one group node (`passes.optimizer.group_updates`).
- `assign_flat(xs, starts)`: writes elements [start, start + size) of the 1-D last input
  (an all-gathered bucket) into each of the others in place, in its shape: the updated
  parameters put back on every replica, one node a bucket.

They run after the backward pass (the optimizer's phase) and are not differentiable.
"""
from netdsl.errors import ShapeError
from netdsl.ir.opdef import NON_NEGATIVE, POSITIVE, Arg, OpDef, kernel, register
from netdsl.ir.types import TensorType


def _piece_shape(ins, a):
    (x,) = ins
    start, stop = a["start"], a["stop"]
    if not 0 <= start < stop <= x.numel():
        raise ShapeError(f"flat_piece [{start}:{stop}] is out of range for {x} "
                         f"({x.numel()} elements)")
    return TensorType((stop - start,), x.dtype)


def _pack_shape(ins, a):
    count = a["count"]
    if not 1 <= count <= len(ins) or len({t.dtype for t in ins[:count]}) > 1:
        raise ShapeError(f"pack_flat packs the first {count} of {len(ins)} inputs, of one "
                         "dtype")
    return TensorType((sum(t.numel() for t in ins[:count]),), ins[0].dtype)


def _assign_shape(ins, a):
    *dsts, src = ins
    starts = tuple(a["starts"])
    if not dsts or len(starts) != len(dsts) or src.rank != 1:
        raise ShapeError(f"assign_flat writes {len(starts)} ranges of a 1-D source into "
                         f"{len(dsts)} tensors; the source is {src}")
    for d, start in zip(dsts, starts, strict=True):
        if d.dtype != src.dtype or not 0 <= start <= src.shape[0] - d.numel():
            raise ShapeError(f"assign_flat: {d} from element {start} does not fit in {src}")
    return dsts[0]


def _written(node):
    return tuple(range(len(node.inputs) - 1))


def _moved(ins, out, a):
    return 0  # a copy: the cost model prices its bytes


register(OpDef("flat_piece", (Arg("x", "tensor"), Arg("start", "int", range=NON_NEGATIVE),
                              Arg("stop", "int", range=POSITIVE)),
               _piece_shape, "shape", flops=_moved, differentiable=False, reads_part=True,
               extra={"internal": True},
               doc="a copy of elements [start, stop) of x flattened"))
register(OpDef("pack_flat", (Arg("xs", "tensors"), Arg("count", "int", range=POSITIVE)),
               _pack_shape, "shape", flops=_moved, differentiable=False,
               extra={"internal": True},
               doc="the first `count` inputs flattened and joined (the rest order it)"))
register(OpDef("assign_flat", (Arg("xs", "tensors"), Arg("starts", "ints")),
               _assign_shape, "shape", flops=_moved, differentiable=False, writes=_written,
               view_of=0, extra={"internal": True},
               doc="each input but the last (in place) = last[start:start + its size]"))


@kernel("flat_piece")
def _flat_piece(xp, ins, a, ctx):
    return ins[0].reshape(-1)[a["start"]:a["stop"]].copy()


@kernel("pack_flat")
def _pack_flat(xp, ins, a, ctx):
    return xp.concatenate([x.reshape(-1) for x in ins[:a["count"]]])


@kernel("assign_flat")
def _assign_flat(xp, ins, a, ctx):
    *dsts, src = ins
    for d, start in zip(dsts, a["starts"], strict=True):
        d.reshape(-1)[...] = src[start:start + d.size]
    return dsts[0]
