"""A split step's per-device timeline as the executor runs it, and the pipeline bubble
measured from it: what checks a schedule's bubble formula and the predictor's bubble.

In one process the executor runs every device's nodes one after another, in its plan's
order. `measure` runs the step with each kernel timed (`Executor.node_times`, the
least over runs); `replay` lays those durations out as the devices would run them side
by side: each device runs its nodes in the executed order, one at a time, and a node
starts when its device is free and its inputs are done (a recv when its send on the other
device is). The predictor (`parallel.predict`) is not used: its times are what is
checked. Over MPI each rank runs its own nodes in the same order, so the replay is the
timeline of a run whose transfers take the time their copies took here.

The bubble is measured over the pipeline's work, the forward and backward nodes (not the
optimizer's updates after the flush, nor the results made whole on device 0 after it):
1 - busy / (devices x span), span from the first such node's start to the last one's end.
"""
from __future__ import annotations

import re
from typing import NamedTuple

from netdsl.ir.graph import STATE_OPS, Graph
from netdsl.parallel.order import chunks_of
from netdsl.parallel.schedules import Task, formula_bubble, timeline
from netdsl.runtime.executor import Executor

_MICRO = re.compile(r"@m(\d+)")


class Replay(NamedTuple):
    intervals: dict[str, tuple[int, float, float]]  # node -> (device, start, end)
    makespan: float


def measure(ex: Executor, feeds: dict, runs: int = 3) -> tuple[list[str], dict[str, float]]:
    """(the executed order, each node's least kernel time over `runs` timed runs after one
    untimed one: what else runs on a shared machine only ever adds time)."""
    ex.run(feeds)
    samples: dict[str, list[float]] = {}
    for _ in range(runs):
        ex.node_times = {}
        ex.run(feeds)
        for name, t in ex.node_times.items():
            samples.setdefault(name, []).append(t)
    ex.node_times = None
    order = ex.plan(tuple(ex.graph.outputs)).order
    return order, {k: min(v) for k, v in samples.items()}


def replay(g: Graph, order: list[str], durations: dict[str, float]) -> Replay:
    """Each device's nodes of `order` one at a time, each after its inputs (module doc)."""
    free: dict[int, float] = {}
    end: dict[str, float] = {}
    out: dict[str, tuple[int, float, float]] = {}
    for name in order:
        n = g[name]
        if n.op in STATE_OPS or n.op == "input":
            end[name] = 0.0
            continue
        d = n.device or 0
        start = max([free.get(d, 0.0)] + [end[i] for i in n.inputs])
        end[name] = free[d] = start + durations.get(name, 0.0)
        out[name] = (d, start, end[name])
    return Replay(out, max(free.values(), default=0.0))


def _is_work(g: Graph, name: str) -> bool:
    """A node of the forward or backward pass (a micro-batch's, or a sum of their
    gradients), not the optimizer's, nor of making the step's results whole on device 0
    (or their gradients: the constant seeds of the parts' losses)."""
    n = g[name]
    if n.meta.get("phase") not in (None, "forward", "backward") or n.meta.get("combined"):
        return False
    f = n.meta.get("forward")
    return f is None or f not in g or not g[f].meta.get("combined")


def pipeline_bubble(g: Graph, rep: Replay) -> float:
    """The idle share of the devices over the pipeline's work (module docstring)."""
    work = [iv for name, iv in rep.intervals.items() if _is_work(g, name)]
    if not work:
        return 0.0
    devices = {d for d, _, _ in work}
    span = max(e for _, _, e in work) - min(s for _, s, _ in work)
    busy = sum(e - s for _, s, e in work)
    return 1.0 - busy / (len(devices) * span) if span else 0.0


def task_times(g: Graph, rep: Replay) -> dict[Task, float]:
    """The measured time of every task (phase, chunk, micro-batch), its nodes summed: a
    micro-batch's forward (F) or backward (B, and W where ZB-H1 marked it) nodes of a
    model chunk (a stage, without virtual stages), a gradient sum's add counted with the
    micro-batch it adds."""
    split = g.meta["split"]
    chunk = chunks_of(g, split["pipeline"])
    out: dict[Task, float] = {}
    for name, (_, s, e) in rep.intervals.items():
        n = g[name]
        micro = [int(m) for x in (name, *n.inputs) for m in _MICRO.findall(x)]
        if not micro or name not in chunk or not _is_work(g, name):
            continue
        phase = "F" if n.meta.get("phase") != "backward" else n.meta.get("backward_part", "B")
        key = (phase, chunk[name], micro[0] if _MICRO.search(name) else max(micro))
        out[key] = out.get(key, 0.0) + e - s
    return out


class Bounds(NamedTuple):
    measured: float
    low: float
    high: float
    formula: float


def bubble_bounds(g: Graph, rep: Replay) -> Bounds:
    """The measured bubble and the interval the schedule puts it in given how much its
    tasks' measured times differ: the replay is a max-plus system (each start a max of
    ends, each end a start plus a duration), so with every task between a and b times its
    unit cost (`schedules`: F = B = W = 1, an undivided backward 2) the span lies between
    a and b times the unit-time timeline's, plus the work outside any task (the loss
    seed). The interval always holds the formula's bubble, and is that alone when the
    task times are equal (a = b)."""
    split = g.meta["split"]
    p, m, v = split["pipeline"], split["microbatches"], split.get("virtual_stages", 1)
    unit = timeline(split["schedule"], p, m, v)
    tasks = task_times(g, rep)
    zb = split["schedule"] == "zb-h1"
    ratios = [t / (2.0 if ph == "B" and not zb else 1.0) for (ph, _, _), t in tasks.items()]
    work = [(name, iv) for name, iv in rep.intervals.items() if _is_work(g, name)]
    busy = sum(e - s for _, (_, s, e) in work)
    span = max(e for _, (_, _, e) in work) - min(s for _, (_, s, _) in work)
    outside = busy - sum(tasks.values())
    devices = len({d for _, (d, _, _) in work})
    a, b = min(ratios), max(ratios)
    return Bounds(1 - busy / (devices * span), 1 - busy / (devices * a * unit.makespan),
                  1 - busy / (devices * (b * unit.makespan + outside)),
                  formula_bubble(split["schedule"], p, m, v))
