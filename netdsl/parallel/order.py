"""The order each device runs a pipeline's micro-batches in: GPipe or 1F1B.

A split graph's node order is every device's schedule (in one process it is the run
order; over MPI each rank runs its nodes in that order). The copies are made layer by
layer (every micro-batch's copy of a node, then the next node), which would make a stage
finish all its micro-batches before passing the first on. `order_micro_batches` reorders
each device's work by micro-batch:
- GPipe: every forward micro-batch in order, then every backward one in reverse;
- 1F1B: stage s of p runs (p - s - 1) warm-up forward micro-batches, then alternates one
  forward and one backward, then drains the backward ones (PipeDream-Flush, Narayanan et
  al. 2021): GPipe's bubble with at most p micro-batches' activations alive on a stage
  instead of all m. On one stage (micro-batches on one device, or on each data
  replica: gradient accumulation) 1F1B is forward then backward of each micro-batch in
  turn, one micro-batch's activations alive at a time.
The result is a topological order (Kahn's algorithm, lowest priority first, ties in the
old order, so a collective's members stay side by side); what depends on no input (the
loss seed and the gradients of the parts' loss weights sent back to them) goes first, and
a node with no micro-batch of its own (a gradient's all-reduce, an update) takes the
priority of its earliest reader.
"""
from __future__ import annotations

import heapq
import re

from netdsl.ir.graph import Graph
from netdsl.ir.placement import position_of

_MICRO = re.compile(r"@m(\d+)")


def _tasks(stage: int, stages: int, micro: int, schedule: str) -> dict[tuple[str, int], int]:
    if schedule == "gpipe":
        seq = [("F", i) for i in range(micro)] + [("B", i) for i in reversed(range(micro))]
        return {t: k for k, t in enumerate(seq)}
    warm = min(stages - stage - 1, micro)
    seq = [("F", i) for i in range(warm)]
    for i in range(micro - warm):
        seq += [("F", warm + i), ("B", i)]
    seq += [("B", i) for i in range(micro - warm, micro)]
    return {t: k for k, t in enumerate(seq)}


def _is_sum(n) -> bool:
    return "sums_gradient_of" in n.meta  # a link of autodiff's sum of a value's gradients


def _sum_in_schedule_order(g: Graph, key: dict, readers: dict) -> None:
    """A gradient summed over micro-batches is a chain of `add`s that autodiff built in
    reverse order of the forward; re-chain each so that it adds the parts in the order
    the schedule makes them, and give every link the priority of its later input: each
    part is added (and freed) as soon as it exists, instead of every micro-batch's
    gradient of a stage's parameters staying alive until the last one."""
    for head in [n for n in g.nodes if _is_sum(n) and not _is_sum(g[n.inputs[0]])]:
        chain = [head]
        while True:
            nxt = [r for r in readers[chain[-1].name] if _is_sum(g[r])
                   and g[r].inputs[0] == chain[-1].name]
            if len(nxt) != 1:
                break
            chain.append(g[nxt[0]])
        parts = [head.inputs[0]] + [a.inputs[1] for a in chain]
        if any(p not in key for p in parts):
            continue
        parts.sort(key=lambda p: key[p])
        prev = parts[0]
        for a, part in zip(chain, parts[1:], strict=True):
            old = set(a.inputs)
            a.inputs = (prev, part)
            for i in old - set(a.inputs):
                readers[i].remove(a.name)
            for i in set(a.inputs) - old:
                readers[i].append(a.name)
            key[a.name] = max(key[prev], key[part])
            prev = a.name


def order_micro_batches(g: Graph, schedule: str = "gpipe") -> Graph:
    split = g.meta.get("split", {})
    stages, micro = split.get("pipeline", 1), split.get("microbatches", 1)
    if micro < 2:
        return g
    tasks = {s: _tasks(s, stages, micro, schedule) for s in range(stages)}
    inf = float("inf")
    key: dict[str, float] = {}
    for n in g.nodes:
        m = _MICRO.search(n.name)
        if n.meta.get("combined") and n.meta.get("phase") is None:
            key[n.name] = inf  # results made whole on device 0: last (split.defer_results)
            continue
        if m is None or n.device is None:
            continue
        phase = "B" if n.meta.get("phase") == "backward" else "F"
        stage = position_of(split, n.device)["stage"]
        key[n.name] = tasks[stage].get((phase, int(m.group(1))), inf)
    # what depends on no input at all (the loss seed, the gradient of the parts' loss
    # weights, its sends) runs first: device 0 must not hold a part's backward back
    constant: set[str] = set()
    for n in g.nodes:
        if not n.is_source and all(i in constant for i in n.inputs):
            constant.add(n.name)
            key[n.name] = -1
    readers: dict[str, list[str]] = {n.name: [] for n in g.nodes}
    for n in g.nodes:
        for i in n.inputs:
            readers[i].append(n.name)
    _sum_in_schedule_order(g, key, readers)
    for n in reversed(g.nodes):  # unkeyed nodes: their earliest reader's priority
        if n.name not in key:
            key[n.name] = min((key[r] for r in readers[n.name]), default=inf)
    pos = {n.name: k for k, n in enumerate(g.nodes)}
    waiting = {n.name: len(set(n.inputs)) for n in g.nodes}
    ready = [(key[n.name], pos[n.name], n.name) for n in g.nodes if not n.inputs]
    heapq.heapify(ready)
    out = []
    while ready:
        _, _, name = heapq.heappop(ready)
        out.append(g[name])
        for r in dict.fromkeys(readers[name]):
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, (key[r], pos[r], r))
    assert len(out) == len(g.nodes), "the micro-batch order left nodes out"
    g.nodes = out
    g.meta["split"]["schedule"] = schedule
    return g
