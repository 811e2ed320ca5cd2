"""Static liveness: the bytes a graph holds at each step of its schedule, before running.

This follows the executor's own accounting rule exactly - persistent state (params,
buffers, optimizer state) all the time; a value from the moment its node runs until its
last reader has run; in-place update nodes add nothing; the requested outputs are held
to the end - so the predicted peak is the peak the executor then measures. It is the
base the memory planner (recompute/offload) will rewrite against.
"""
from __future__ import annotations

from dataclasses import dataclass

from netdsl.ir import registry
from netdsl.ir.graph import STATE_OPS, Graph
from netdsl.ir.types import DTYPES, FLOAT_DTYPES


@dataclass
class Liveness:
    order: list[str]  # the nodes run, in order
    frees: list[list[str]]  # values released after each node
    state_bytes: int
    peak_bytes: int
    peak_at: str | None  # the node after which the peak is reached
    timeline: list[int]  # bytes held after each node ran (before its frees)


def schedule(g: Graph, roles: tuple[str, ...]) -> tuple[list, list[list[str]], set[str]]:
    """The nodes the roles need, in graph order, and what to free after each of them."""
    wanted = {name for r in roles for name in g.outputs.get(r, [])}
    needed = set(wanted)
    for n in reversed(g.nodes):
        if n.name in needed:
            needed.update(n.inputs)
    order = [n for n in g.nodes if n.name in needed]
    last: dict[str, int] = {}
    for k, n in enumerate(order):
        for i in n.inputs:
            last[i] = k
    frees: list[list[str]] = [[] for _ in order]
    for name, k in last.items():
        if name not in wanted:
            frees[k].append(name)
    for k, n in enumerate(order):  # values nobody reads: dropped as soon as made
        if n.name not in last and n.name not in wanted:
            frees[k].append(n.name)
    return order, frees, wanted


def value_bytes(t, float_dtype: str = "f32") -> int:
    size = DTYPES[float_dtype] if t.dtype in FLOAT_DTYPES else DTYPES[t.dtype]
    return t.numel() * size


def analyse(g: Graph, roles: tuple[str, ...], float_dtype: str = "f32") -> Liveness:
    """Predict the executor's byte count for `executor.run(roles=roles)` on bound `g`."""
    registry.load_all()
    order, frees, _ = schedule(g, roles)
    state = sum(value_bytes(n.type, float_dtype) for n in g.nodes if n.op in STATE_OPS)
    cur = peak = state
    peak_at = None
    held: dict[str, int] = {}
    timeline = []
    for k, n in enumerate(order):
        if n.op not in STATE_OPS and registry.OPS[n.op].adds_storage(n):
            held[n.name] = value_bytes(n.type, float_dtype)
            cur += held[n.name]
        timeline.append(cur)
        if cur > peak:
            peak, peak_at = cur, n.name
        for name in frees[k]:
            cur -= held.pop(name, 0)
    return Liveness([n.name for n in order], frees, state, peak, peak_at, timeline)
