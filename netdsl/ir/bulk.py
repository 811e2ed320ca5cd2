"""Pausing Python's cyclic garbage collector while a whole-graph step builds many objects.

Checking a big file keeps millions of small objects alive (AST, nodes, types); every full
collection walks all of them, and one runs each time the heap has grown by a quarter, so a
step that copies the graph (binding the batch) or tabulates it (statistics) paid about
three times its own cost in collections. Those steps make no reference cycles that need
collecting before they finish; the collector runs as usual afterwards.
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
