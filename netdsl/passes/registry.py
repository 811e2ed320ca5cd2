"""The pass registry: every pass registers itself here by name, and `run_pipeline` looks
the names up. It is its own module so that a pass (in this package or a later layer's,
such as the memory planner's "memory") can register without importing the pipeline that
runs it."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from netdsl.ir.graph import Graph


@dataclass(frozen=True)
class Pass:
    name: str
    fn: Callable[..., Graph]
    doc: str


PASSES: dict[str, Pass] = {}


def register_pass(name: str):
    """Decorator registering `fn(graph, **options) -> Graph` as pass `name`."""
    def deco(fn):
        if name in PASSES and PASSES[name].fn is not fn:
            raise ValueError(f"pass {name!r} registered twice")
        PASSES[name] = Pass(name, fn, (fn.__doc__ or "").strip().split("\n")[0])
        return fn
    return deco
