"""Pausing Python's cyclic garbage collector while a whole-graph step builds many objects.

Checking a big file keeps millions of small objects alive (AST, nodes, types); every full
collection walks all of them, and one runs each time the heap has grown by a quarter, so a
step that copies the graph (binding the batch) or tabulates it (statistics) would spend
more time in collections than in its own work. Those steps make no reference cycles that
need collecting before they finish; the collector runs as usual afterwards.

The pass pipeline, the memory planner's search and the split's choice of candidates run
paused too: on a deep network, collections would otherwise take a large share of planning
and splitting it. They drop whole graphs as they go, so a graph must be freed by
reference counting alone: nothing in the IR or the passes may refer back to a graph from
something it holds (the node list's link to its graph is a weak reference;
tests/test_rewrite.py checks that splitting leaves no cyclic garbage).
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Run the body with the cyclic collector off (nests; restores the previous state)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
