"""The persistent state of a split graph in pieces, and how to put it back together.

A state entry of the single-device graph (a parameter, a buffer, an optimizer slot) is
held whole (once, or as replicas), as shards along one axis, or (sharded optimizer state,
axis FLAT) as ranges of its elements in order. Over MPI each rank holds
some entries and some shards; `gather_order` says, from what every rank holds, which rank
sends which piece of each entry to rank 0, so that rank 0 can join one entry at a time
(a checkpoint of resnet2504 over two ranks never holds a second copy of its state).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from netdsl.errors import NetdslError
from netdsl.ir.placement import FLAT

Range = tuple[int, int] | None  # a shard [lo, hi) along the axis, or None: the whole entry


@dataclass(frozen=True)
class StateParts:
    """One state entry as a rank (or one process) holds it: the full shape and dtype, the
    shard axis (None when not split), and its pieces, range -> the state node holding it."""

    shape: tuple[int, ...]
    dtype: str
    axis: int | None
    parts: dict[Range, str]

    def piece_shape(self, r: Range) -> tuple[int, ...]:
        if r is None:
            return self.shape
        if self.axis == FLAT:
            return (r[1] - r[0],)
        s = list(self.shape)
        s[self.axis] = r[1] - r[0]
        return tuple(s)

    def join(self, pieces: Iterable[tuple[Range, np.ndarray]]) -> np.ndarray:
        """The whole entry from its shards (each written into place; one new array)."""
        out = np.empty(self.shape, self.dtype)
        if self.axis == FLAT:  # ranges of the flattened entry
            flat = out.reshape(-1)
            for (lo, hi), a in pieces:
                flat[lo:hi] = np.asarray(a).reshape(-1)
            return out
        at = [slice(None)] * len(self.shape)
        for (lo, hi), a in pieces:
            at[self.axis] = slice(lo, hi)
            out[tuple(at)] = a
        return out

    def describe(self) -> tuple:
        """What other ranks need to know (no arrays): picklable and small."""
        return (self.shape, self.dtype, self.axis, sorted(self.parts, key=_lo))


def extent(shape: tuple[int, ...], axis: int) -> int:
    """The length of `shape` that shards along `axis` cover (FLAT: every element)."""
    return math.prod(shape) if axis == FLAT else shape[axis]


def _lo(r: Range) -> int:
    return -1 if r is None else r[0]


def gather_order(held: list[dict[str, tuple]]) -> list[tuple[str, StateParts, list]]:
    """From every rank's `describe()`d entries (`held[rank][key]`), each entry once, in the
    order of first appearance by rank: (key, its StateParts with the ranges to join, and
    [(rank, range)] the pieces to fetch). An entry held whole anywhere comes whole from the
    first rank holding it; a sharded one is joined from the first holder of each shard,
    which must cover the axis without gaps or overlaps."""
    order: dict[str, list] = {}
    for rank, entries in enumerate(held):
        for key, (shape, dtype, axis, ranges) in entries.items():
            order.setdefault(key, [tuple(shape), dtype, axis, {}])
            for r in ranges:
                order[key][3].setdefault(None if r is None else tuple(r), rank)
    out = []
    for key, (shape, dtype, axis, holders) in order.items():
        if None in holders:
            pieces = [(holders[None], None)]
            sp = StateParts(shape, dtype, None, {None: key})
        else:
            ranges = sorted(holders)
            edges = [lo for lo, _ in ranges] + [extent(shape, axis)]
            if edges[0] != 0 or any(hi != nxt for (_, hi), nxt in zip(ranges, edges[1:])):
                raise NetdslError(f"the ranks' shards of `{key}` ({ranges} along axis "
                                  f"{axis} of {list(shape)}) do not make up the whole "
                                  "tensor; the split is inconsistent")
            pieces = [(holders[r], r) for r in ranges]
            sp = StateParts(shape, dtype, axis, {r: key for r in ranges})
        out.append((key, sp, pieces))
    return out
