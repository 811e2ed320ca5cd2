"""The simulator as it was written before its passes became NumPy array passes
(netdsl.memory.schedule_arrays): a loop per schedule entry. tests/test_fast_paths.py
checks that the two give the same schedules, lifetimes and peaks."""
from __future__ import annotations

from itertools import accumulate
from typing import NamedTuple

import numpy as np

from netdsl.memory.simulate import (
    BWD,
    CLONE,
    D2H,
    H2D,
    NODE,
    OFFLOAD,
    RECOMPUTE,
    STATE,
    Prepared,
    Sim,
    _kinds,
    _needed_at,
    _stream_state,
)


def simulate(prep: Prepared, decisions: dict[int, str] | None = None,
             prefetch: int = 1, by_kind: bool = False) -> Sim:
    """The schedule and byte counts of `prep` under `decisions` (position -> decision;
    positions not given are kept). `by_kind` also splits the live bytes into KINDS."""
    decisions = decisions or {}
    n = len(prep.names)
    rec = [False] * n
    off = [False] * n
    for p, d in decisions.items():
        if d == RECOMPUTE:
            rec[p] = True
        elif d == OFFLOAD:
            off[p] = True
    need = _needed_at(prep, decisions, rec, off)
    seq, renamed, offloaded, cloned = _place(prep, need, rec, prefetch)
    # 3. eager updates, and offloaded optimizer state streamed through its update
    if prep.updates:
        seq = _eager(prep, seq, renamed)
    if any(off[p] for p in prep.opt_state):
        seq = _stream_state(prep, seq, off, prefetch, offloaded)
        for p in prep.opt_state:
            if off[p]:
                renamed[p] = 2  # the update reads the copy brought in for it
    sim = _count(prep, seq, _reads(prep, seq, renamed), offloaded, cloned)
    if by_kind:
        sim.kinds = _kinds(prep, sim.lifetimes, len(seq))
    return sim


def _place(prep: Prepared, need: dict[int, int], rec: list[bool], prefetch: int
           ) -> tuple[list[tuple[int, int]], list[int], list[int], list[int]]:
    """2. clones and prefetches before the node where they are needed, in forward order;
    each to_host right after its value. Returns (the schedule, how each value is read
    from its backward readers: 0 as is, 1 its clone, 2 its device copy, the values
    offloaded, the values cloned)."""
    n = len(prep.names)
    before: dict[int, list[tuple[int, int]]] = {}
    after: dict[int, list[tuple[int, int]]] = {}
    offloaded: list[int] = []
    cloned: list[int] = []
    renamed = [0] * n  # 0: as is, 1: clone, 2: device copy
    for p in sorted(need):
        if rec[p]:
            before.setdefault(need[p], []).append((CLONE, p))
            renamed[p] = 1
            cloned.append(p)
        else:
            after.setdefault(p, []).append((D2H, p))
            # not before its own copy out (a split graph's backward starts before the
            # last micro-batch's forward ends)
            at = max(prep.first_bwd, need[p] - prefetch, p + 1)
            before.setdefault(at, []).append((H2D, p))
            renamed[p] = 2
            offloaded.append(p)
    seq: list[tuple[int, int]] = []
    for p in range(n):
        if p in before:
            seq.extend(before[p])
        seq.append((NODE, p))
        if p in after:
            seq.extend(after[p])
    return seq, renamed, offloaded, cloned


class _Reads(NamedTuple):
    """Who reads what in a schedule, by value id: p (original), n + p (clone), 2n + p
    (device copy), 3n + p (host copy)."""

    started: list[tuple[int, int]]  # each device value's id and the entry that makes it
    last: list[int]  # the last entry reading each value id (-1: none)
    waits: dict[int, list[int]]  # entry -> offloaded values whose device copies it reads
    host_start: dict[int, int]  # value -> the entry that copies it to the host


def _reads(prep: Prepared, entries: list[tuple[int, int]], renamed: list[int]) -> _Reads:
    """4. who reads what (`_Reads`)."""
    n = len(prep.names)
    inputs, phase = prep.inputs, prep.phase
    last = [-1] * (4 * n)
    reads_dev: dict[int, list[int]] = {}
    started: list[tuple[int, int]] = []
    host_start: dict[int, int] = {}
    for i, (kind, p) in enumerate(entries):
        if kind == NODE or kind == CLONE:
            started.append((p if kind == NODE else n + p, i))
            # backward nodes and clones read the renamed values: the original (0), its
            # clone (1) or its device copy (2) - value id r * n + u
            renames = kind == CLONE or phase[p] == BWD
            for u in inputs[p]:
                r = renamed[u] if renames else 0
                last[r * n + u] = i
                if r == 2:
                    reads_dev.setdefault(i, []).append(u)
            if kind == NODE:
                for u in prep.held.get(p, ()):
                    last[u] = max(last[u], i)
        elif kind == D2H:
            host_start[p] = i
            if phase[p] == STATE:
                last[2 * n + p] = i
            else:
                last[p] = i
        else:  # H2D
            started.append((2 * n + p, i))
            last[3 * n + p] = i
    return _Reads(started, last, reads_dev, host_start)


def _count(prep: Prepared, entries: list[tuple[int, int]], reads: _Reads,
           offloaded: list[int], cloned: list[int]) -> Sim:
    """5. the byte count: each value's lifetime, the device and host timelines and their
    peaks (per device too, for a split graph)."""
    n, m = len(prep.names), len(entries)
    phase, nbytes, full = prep.phase, prep.bytes, prep.full_bytes
    started, last, host_start = reads.started, reads.last, reads.host_start
    host_end = {p: last[3 * n + p] for p in host_start if last[3 * n + p] >= 0}
    host_state = [p for p in offloaded if phase[p] == STATE]
    ends: list[tuple[int, int, int, int]] = []  # (value id, bytes, first, one past last)
    for vid, s in started:
        p = vid % n if vid >= n else vid
        b = nbytes[p] if phase[p] != STATE else full[p] if vid >= 2 * n else 0
        if b == 0:
            continue
        if vid < n and (p in prep.wanted or p in prep.held_end):
            e = m
        elif last[vid] >= 0:
            e = last[vid] + 1
        else:
            e = s + 1  # nobody reads it: dropped as soon as made
        ends.append((vid, b, s, e))
    device_state = prep.state_bytes - sum(full[p] for p in host_state)
    diff = [0] * (m + 1)
    diff[0] = device_state + prep.workspace
    for _, b, s, e in ends:
        diff[s] += b
        diff[e] -= b
    timeline = list(accumulate(diff[:m]))
    if timeline:
        peak = max(timeline)
        peak_i = timeline.index(peak)
    else:
        peak, peak_i = diff[0], -1
    if host_start:
        hdiff = [0] * (m + 1)
        hdiff[0] = sum(full[p] for p in host_state)  # host-resident all the time
        for p, s in host_start.items():
            if phase[p] != STATE:
                hdiff[s] += nbytes[p]
                hdiff[host_end.get(p, m - 1) + 1] -= nbytes[p]
        host = list(accumulate(hdiff[:m]))
    else:
        host = [0] * m
    sim = Sim(entries, timeline, host, reads.waits, peak, peak_i, max(host, default=0),
              device_state, prep.workspace, sum(full[p] for p in offloaded), cloned,
              lifetimes=ends)
    if len(prep.devices) > 1:
        _by_device(prep, sim, host_start, host_end, host_state)
    else:
        sim.device_peaks = {0: peak}
        sim.device_unified_peaks = {0: sim.unified_peak}
    return sim


def _by_device(prep: Prepared, sim: Sim, host_start: dict[int, int],
               host_end: dict[int, int], host_state: list[int]) -> None:
    """Sim.device_peaks and device_unified_peaks of a split graph (module doc)."""
    n, m = len(prep.names), len(sim.entries)
    dev, nbytes, full = prep.device, prep.bytes, prep.full_bytes
    life = np.array([(dev[vid % n], b, s, e) for vid, b, s, e in sim.lifetimes],
                    dtype=np.int64).reshape(-1, 4)
    hosted = [(dev[p], nbytes[p], s, host_end.get(p, m - 1) + 1)
              for p, s in host_start.items() if prep.phase[p] != STATE]
    host = np.array(hosted, dtype=np.int64).reshape(-1, 4)
    base_host: dict[int, int] = {}
    for p in host_state:
        base_host[dev[p]] = base_host.get(dev[p], 0) + full[p]

    def timeline(rows) -> np.ndarray:
        diff = np.zeros(m + 1, dtype=np.int64)
        np.add.at(diff, rows[:, 2], rows[:, 1])
        np.add.at(diff, rows[:, 3], -rows[:, 1])
        return np.cumsum(diff[:m])

    for d in prep.devices:
        base = prep.device_state.get(d, 0) - base_host.get(d, 0) \
            + prep.device_workspace.get(d, 0)
        on_dev = timeline(life[life[:, 0] == d]) + base
        in_host = timeline(host[host[:, 0] == d]) + base_host.get(d, 0)
        sim.device_peaks[d] = int(on_dev.max(initial=base))
        sim.device_unified_peaks[d] = int((on_dev + in_host).max(
            initial=base + base_host.get(d, 0)))


def _eager(prep: Prepared, seq: list[tuple[int, int]], renamed: list[int]
           ) -> list[tuple[int, int]]:
    """apply_decisions' eager updates on a schedule (see the module doc)."""
    n = len(prep.names)
    early = set(prep.early)
    rest = [e for e in seq if not (e[0] == NODE and e[1] in early)]
    first = next((i for i, (kind, p) in enumerate(rest)
                  if kind in (CLONE, H2D) or (kind == NODE and prep.late_node[p])), None)
    if first is None:
        return seq
    seq = rest[:first] + [(NODE, p) for p in prep.early] + rest[first:]
    inputs, phase, root = prep.inputs, prep.phase, prep.root
    where: dict[int, int] = {}  # value id -> entry index that makes it
    readers: dict[int, list[int]] = {}  # storage root -> entries reading it
    for i, (kind, p) in enumerate(seq):
        if kind == NODE:
            where[p] = i
            resolve = phase[p] == BWD
        elif kind == CLONE:
            where[n + p] = i
            resolve = True
        elif kind == H2D:
            where[2 * n + p] = i
            continue
        else:
            where[3 * n + p] = i
            readers.setdefault(root[p], []).append(i)
            continue
        for u in inputs[p]:
            r = renamed[u] if resolve else 0
            if r == 0:
                readers.setdefault(root[u], []).append(i)
    moves: dict[int, int] = {}  # entry index of an update -> entry index of its anchor
    for u in prep.updates:
        k = where[u]
        last = max(where[w] for w in inputs[u])
        for r in prep.written[u]:
            for i in readers.get(r, ()):
                if i != k and i > last:
                    last = i
        if last < k:
            moves[k] = last
    if not moves:
        return seq
    after: dict[int, list[int]] = {}
    for k in sorted(moves):
        after.setdefault(moves[k], []).append(k)
    out: list[tuple[int, int]] = []
    stack: list[int] = []
    for i in range(len(seq)):
        if i in moves:
            continue
        stack.append(i)
        while stack:
            j = stack.pop()
            out.append(seq[j])
            stack.extend(reversed(after.get(j, ())))
    return out
