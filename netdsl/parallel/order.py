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
- ZB-H1 and interleaved 1F1B (virtual stages): each node takes the start time of its
  task in the schedule's unit-time timeline (`schedules.timeline`), a task being (phase,
  chunk, micro-batch); for ZB-H1 each backward node is first marked an input-gradient
  (B) or a weight-gradient (W) node (`mark_backward_parts`).
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
from netdsl.parallel.schedules import timeline

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


def mark_backward_parts(g: Graph) -> None:
    """Mark each backward node "B" (on the way to the gradient of another layer's input:
    what the device before waits for) or "W" (on the way to parameter gradients alone,
    which ZB-H1 defers). A node is B when a reader is a micro-batch's backward node of
    another forward node, or a send, or a B node; gradient sums and the replicas'
    gradient all-reduce are looked through, so a weight gradient summed over
    micro-batches and replicas stays W."""
    readers = g.consumers()
    part: dict[str, str] = {}
    for n in reversed(g.nodes):
        if n.meta.get("phase") != "backward":
            continue
        mine = n.meta.get("forward")

        def to_input(r) -> bool:
            if r.meta.get("phase") != "backward":
                return False
            if r.op == "send" or part.get(r.name) == "B":
                return True
            return bool(_MICRO.search(r.name)) and not _is_sum(r) and \
                r.meta.get("forward") != mine

        part[n.name] = "B" if any(to_input(g[r]) for r in readers[n.name]) else "W"
        n.meta["backward_part"] = part[n.name]


def chunks_of(g: Graph, stages: int,
              readers: dict[str, list[str]] | None = None) -> dict[str, int]:
    """The model chunk of every placed node: its stage (`position_of`) without virtual
    stages; with them a forward copy's `chunk`, a backward node's forward node's on the
    same device, else (a recv, a send, a gradient sum) the chunk of a reader on its
    device."""
    if g.meta["split"].get("virtual_stages", 1) == 1:
        split = g.meta["split"]
        return {n.name: position_of(split, n.device)["stage"] for n in g.nodes
                if n.device is not None}
    chunk = {n.name: n.meta["chunk"] for n in g.nodes if "chunk" in n.meta}
    readers = readers if readers is not None else g.consumers()

    def from_readers(backward: bool) -> None:
        for n in reversed(g.nodes):
            if n.name in chunk or n.device is None or \
                    (n.meta.get("phase") == "backward") != backward:
                continue
            got = [chunk[r] for r in readers[n.name]
                   if r in chunk and g[r].device == n.device]
            if got:
                chunk[n.name] = min(got)

    from_readers(False)  # a forward recv: its reader's
    for n in g.nodes:
        f = n.meta.get("forward")
        if n.meta.get("phase") == "backward" and f in chunk and g[f].device == n.device:
            chunk[n.name] = chunk[f]
    from_readers(True)
    return chunk


def order_micro_batches(g: Graph, schedule: str = "gpipe") -> Graph:
    split = g.meta.get("split", {})
    stages, micro = split.get("pipeline", 1), split.get("microbatches", 1)
    virtual = split.get("virtual_stages", 1)
    if micro < 2:
        return g
    readers = g.consumers()
    if schedule == "zb-h1" and stages > 1:
        mark_backward_parts(g)
    timed = stages > 1 and (schedule == "zb-h1" or virtual > 1)
    if timed:
        start = timeline(schedule, stages, micro, virtual).start
        chunk = chunks_of(g, stages, readers)
    else:
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
        if not timed:
            key[n.name] = tasks[stage].get((phase, int(m.group(1))), inf)
        elif n.name in chunk:
            phase = n.meta.get("backward_part", phase)
            key[n.name] = start.get((stage, (phase, chunk[n.name], int(m.group(1)))), inf)
    # what depends on no input at all (the loss seed, the gradient of the parts' loss
    # weights, its sends) runs first: device 0 must not hold a part's backward back
    constant: set[str] = set()
    for n in g.nodes:
        if not n.is_source and all(i in constant for i in n.inputs):
            constant.add(n.name)
            key[n.name] = -1
    _sum_in_schedule_order(g, key, readers)
    if timed:  # a send as soon as its value is made, not after the work of its time
        for n in g.nodes:
            if n.op == "send" and n.name not in key and n.inputs[0] in key:
                key[n.name] = key[n.inputs[0]]
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
