"""Ranges of a flattened tensor: how sharded data parallelism (ZeRO, `parallel.zero`)
takes each device's piece of a parameter and writes the gathered parameter back.

- `flat_piece(x, start, stop)`: a copy of elements [start, stop) of x flattened. A
  replica's piece of a parameter for its share of the optimizer step, updated in place
  by the update node, so it must not be a view of the parameter.
- `assign_flat(dst, src, start)`: writes elements [start, start + size of dst) of the
  1-D `src` (an all-gathered bucket) into `dst` in place, in dst's shape: the updated
  parameter put back on every replica.

Both run after the backward pass (the optimizer's phase) and are not differentiable.
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


def _assign_shape(ins, a):
    dst, src = ins
    if src.rank != 1 or src.dtype != dst.dtype:
        raise ShapeError(f"assign_flat reads a 1-D {dst.dtype} source, not {src}")
    if not 0 <= a["start"] <= src.shape[0] - dst.numel():
        raise ShapeError(f"assign_flat: {dst.numel()} elements from {a['start']} do not fit "
                         f"in {src}")
    return dst


def _moved(ins, out, a):
    return 0  # a copy: the cost model prices its bytes


register(OpDef("flat_piece", (Arg("x", "tensor"), Arg("start", "int", range=NON_NEGATIVE),
                              Arg("stop", "int", range=POSITIVE)),
               _piece_shape, "shape", flops=_moved, differentiable=False, reads_part=True,
               extra={"internal": True},
               doc="a copy of elements [start, stop) of x flattened"))
register(OpDef("assign_flat", (Arg("dst", "tensor"), Arg("src", "tensor"),
                               Arg("start", "int", 0, range=NON_NEGATIVE)),
               _assign_shape, "shape", flops=_moved, differentiable=False, writes=(0,),
               view_of=0, reads_part=True, extra={"internal": True},
               doc="dst (in place) = src[start:start + dst.size] in dst's shape"))


@kernel("flat_piece")
def _flat_piece(xp, ins, a, ctx):
    return ins[0].reshape(-1)[a["start"]:a["stop"]].copy()


@kernel("assign_flat")
def _assign_flat(xp, ins, a, ctx):
    dst, src = ins
    start = a["start"]
    dst.reshape(-1)[...] = src[start:start + dst.size]
    return dst
