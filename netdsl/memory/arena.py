"""Packing values into one block of memory by their lifetimes (tinygrad's
`schedule/memory.py` idea): walk the schedule, give each new value the lowest-addressed
free range that fits (first fit), return its range when the value dies. Values alive at
the same time never overlap; the block's size is reported against the lower bound (the
most bytes alive at once), the difference being fragmentation.
"""
from __future__ import annotations

import bisect

ALIGN = 256  # bytes; every offset is a multiple (GPU allocators align to 256 too)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pack(order: list[str], frees: list[list[str]], sizes: dict[str, int]
         ) -> tuple[dict[str, int], int]:
    """Offsets for the values in `sizes` (made by the node of the same name in `order`,
    released by `frees`), and the block size they need."""
    starts: list[int] = []  # free ranges, sorted by start, coalesced
    ends: list[int] = []
    top = 0  # the block grows at its end when no free range fits
    offsets: dict[str, int] = {}
    for k, name in enumerate(order):
        if name in sizes:
            need = _align(max(sizes[name], 1))
            for j, (s, e) in enumerate(zip(starts, ends)):
                if e - s >= need:
                    offsets[name] = s
                    if e - s == need:
                        del starts[j], ends[j]
                    else:
                        starts[j] = s + need
                    break
            else:
                # extend: reuse a free range that touches the top, then grow
                if ends and ends[-1] == top:
                    offsets[name] = starts[-1]
                    top = starts[-1] + need
                    del starts[-1], ends[-1]
                else:
                    offsets[name] = top
                    top += need
        for dead in frees[k]:
            if dead in offsets and dead in sizes:
                _release(starts, ends, offsets[dead], offsets[dead] + _align(max(sizes[dead], 1)))
    return offsets, top


def _release(starts: list[int], ends: list[int], s: int, e: int) -> None:
    """Return [s, e) to the free list, merging with its neighbours."""
    j = bisect.bisect_left(starts, s)
    if j > 0 and ends[j - 1] == s:  # merge with the range before
        j -= 1
        s = starts[j]
        del starts[j], ends[j]
    if j < len(starts) and starts[j] == e:  # and with the range after
        e = ends[j]
        del starts[j], ends[j]
    starts.insert(j, s)
    ends.insert(j, e)
