"""Pipeline schedules as task timelines: which forward (F) and backward (B, and W for a
zero-bubble schedule) task each device runs when, for p stages, m micro-batches and v
model chunks a device (virtual stages).

A task is (phase, chunk, micro-batch); chunk c of p * v lives on device c % p. Each
schedule is a sequence of tasks per device, run with unit task times (F = B = W = 1; a
schedule without W runs a whole backward, B + W, in 2) where each task waits for its
device and for its inputs: F(c, i) for F(c - 1, i), B(c, i) for B(c + 1, i) and F(c, i),
W(c, i) for B(c, i). The start times order the split graph's nodes (`order.py`) and give
the bubble each schedule predicts: the formulas
- GPipe and 1F1B: (p - 1) / (m + p - 1);
- interleaved 1F1B (Megatron-LM's virtual stages): (p - 1) / (v m + p - 1);
- ZB-H1 (Qi et al. 2023): (p - 1) / (3 m + p - 1), a third of 1F1B's for large m.

- 1F1B: device s runs min(p - s - 1, m) warm-up forwards, then one forward and one
  backward in turn, then the remaining backwards (PipeDream-Flush).
- interleaved 1F1B (Narayanan et al. 2021, section 2.2): the micro-batches go in groups
  of p through the device's v chunks in turn; device s runs (p - s - 1) * 2 + (v - 1) * p
  warm-up forwards (all when m = p), then one forward and one backward in turn.
- ZB-H1: 1F1B's order with each backward split into B and W; device s defers up to s
  W tasks (the last device p - 1), which fill what would be the cool-down bubble. A
  micro-batch's activations are held from its F to its W: every device holds at most p
  micro-batches' (for m >= p), 1F1B's peak (its first device's). For m >= p the
  makespan is 3m + p - 1 unit tasks, the formula's.
"""
from __future__ import annotations

from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
Task = tuple[str, int, int]  # (phase "F" | "B" | "W", chunk, micro-batch)


class Timeline(NamedTuple):
    start: dict[tuple[int, Task], float]  # (device, task) -> start time
    makespan: float
    busy: float  # summed task time over every device

    @property
    def bubble(self) -> float:
        devices = len({d for d, _ in self.start})
        return 1.0 - self.busy / (devices * self.makespan) if self.makespan else 0.0


def formula_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The bubble fraction the schedule's paper gives, equal stage times (F = B = W)."""
    if p < 2:
        return 0.0
    if schedule == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (v * m + p - 1)


def _cost(phase: str, split_w: bool) -> float:
    return 2.0 if phase == "B" and not split_w else 1.0


def _ready_at(task: Task, end: dict[Task, float], chunks: int) -> float | None:
    """When `task`'s inputs are done, or None when one has not run yet."""
    phase, c, i = task
    deps = {"F": [("F", c - 1, i)] if c else [],
            "B": [("F", c, i)] + ([("B", c + 1, i)] if c < chunks - 1 else []),
            "W": [("B", c, i)]}[phase]
    ends = [end.get(d) for d in deps]
    return None if None in ends else max(ends, default=0.0)


def run_sequences(seqs: dict[int, list[Task]], chunks: int, split_w: bool) -> Timeline:
    """Each device runs its sequence in order, a task starting when its device is free
    and its inputs are done."""
    end: dict[Task, float] = {}
    start: dict[tuple[int, Task], float] = {}
    pos = {d: 0 for d in seqs}
    free = {d: 0.0 for d in seqs}
    busy = 0.0
    while any(pos[d] < len(s) for d, s in seqs.items()):
        progressed = False
        for d, seq in seqs.items():
            while pos[d] < len(seq):
                t = seq[pos[d]]
                ready = _ready_at(t, end, chunks)
                if ready is None:
                    break
                s0 = max(free[d], ready)
                cost = _cost(t[0], split_w)
                start[d, t], end[t], free[d] = s0, s0 + cost, s0 + cost
                busy += cost
                pos[d] += 1
                progressed = True
        if not progressed:
            raise AssertionError(f"the schedule deadlocks: {seqs}")
    return Timeline(start, max(end.values(), default=0.0), busy)


def one_f_one_b(p: int, m: int) -> dict[int, list[Task]]:
    out = {}
    for s in range(p):
        warm = min(p - s - 1, m)
        seq: list[Task] = [("F", s, i) for i in range(warm)]
        for i in range(m - warm):
            seq += [("F", s, warm + i), ("B", s, i)]
        out[s] = seq + [("B", s, i) for i in range(m - warm, m)]
    return out


def gpipe(p: int, m: int) -> dict[int, list[Task]]:
    return {s: [("F", s, i) for i in range(m)] + [("B", s, i) for i in reversed(range(m))]
            for s in range(p)}


def interleaved(p: int, m: int, v: int) -> dict[int, list[Task]]:
    """Megatron-LM's order for device s: its k-th forward is micro-batch
    (k // pv) p + k % p of its chunk (k // p) % v; backwards the same with the chunks in
    reverse."""
    total = m * v

    def task(phase: str, s: int, k: int) -> Task:
        local = (k % (p * v)) // p
        if phase == "B":
            local = v - 1 - local
        return phase, local * p + s, (k // (p * v)) * p + k % p

    out = {}
    for s in range(p):
        warm = total if m == p else min((p - s - 1) * 2 + (v - 1) * p, total)
        seq = [task("F", s, k) for k in range(warm)]
        for k in range(total - warm):
            seq += [task("F", s, warm + k), task("B", s, k)]
        out[s] = seq + [task("B", s, k) for k in range(total - warm, total)]
    return out


def zb_h1(p: int, m: int) -> dict[int, list[Task]]:
    """1F1B's warm-up and alternation with each backward split in B and W; device s
    keeps up to s W tasks pending in the steady state (the last device p - 1 of them),
    runs one W after each B in the cool-down and the pending ones last."""
    out = {}
    for s in range(p):
        warm = min(p - s - 1, m)
        seq: list[Task] = [("F", s, i) for i in range(warm)]
        pending: list[int] = []
        for i in range(m - warm):
            seq += [("F", s, warm + i), ("B", s, i)]
            pending.append(i)
            if len(pending) > s:
                seq.append(("W", s, pending.pop(0)))
        for i in range(m - warm, m):
            seq.append(("B", s, i))
            pending.append(i)
            seq.append(("W", s, pending.pop(0)))
        out[s] = seq + [("W", s, i) for i in pending]
    return out


def timeline(schedule: str, p: int, m: int, v: int = 1) -> Timeline:
    """The unit-time timeline of `schedule` (v > 1: interleaved 1F1B)."""
    if v > 1:
        return run_sequences(interleaved(p, m, v), p * v, split_w=False)
    if schedule == "zb-h1":
        return run_sequences(zb_h1(p, m), p, split_w=True)
    seqs = gpipe(p, m) if schedule == "gpipe" else one_f_one_b(p, m)
    return run_sequences(seqs, p, split_w=False)
