"""A fast model of a planned training step: its schedule and the device bytes it holds.

`prepare(g)` indexes a bound training-step graph once (forward + autodiff + optimizer);
`simulate(prep, decisions)` then builds, without rewriting the graph, the schedule that
`netdsl.memory.strategies.apply_decisions` produces for the same decisions, and counts
its bytes with `netdsl.memory.plan.make_plan`'s rule; tests check both equal. The search
calls it many times, so it works on integer positions, not on nodes:

1. recompute v: a clone of v runs right before v's first backward reader (or earlier,
   where a clone that reads v is needed earlier), reading v's inputs resolved (kept: as
   they are, offloaded: their device copy, recomputed: their clone); clones placed
   before the same node go in forward order; every backward reader reads the clone;
2. offload v: `to_host` right after v is made (v still dies after its last forward
   reader; the host copy waits in the host pool) and `to_device` before the node
   `prefetch` places ahead of where v is first needed in the original order (not before
   the first backward node);
3. eager updates: the optimizer's sources (and a step counter's increment) go right
   before the first backward entry, and each update right after the last entry that
   makes one of its inputs or reads what it overwrites, so no step holds all gradients;
4. bytes: persistent state + one shared workspace region (the largest `OpDef.workspace`
   of any node) + every value from its entry to its last reader (the roles' outputs to
   the end); `to_host` copies are counted in the host pool.

Beyond `apply_decisions`, an optimizer-state buffer may be offloaded too: it then lives
in the host pool and is copied in `prefetch` entries before its update and out right
after it (`plan_memory(offload_state=True)`; `apply_decisions` rule 5 carries it out).

A split graph (`netdsl.parallel`) places its nodes on devices: a clone and a device copy
live on their value's device, a host copy in that device's host pool, and the bytes are
also counted per device (`Sim.device_peaks`), by `memory.plan.device_peaks`'s rule: each
device holds its own state, the largest workspace of its own nodes, and its values while
they live. Communication ops are never recomputed (a copy would send or reduce again).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import NamedTuple

import numpy as np

from netdsl.ir import registry
from netdsl.ir.bulk import gc_paused
from netdsl.ir.graph import STATE_OPS, Graph
from netdsl.ir.ops.comm import COMM_OPS
from netdsl.ir.precision import conversion_device
from netdsl.memory import schedule_arrays as sa
from netdsl.memory.liveness import schedule
from netdsl.memory.plan import value_bytes, workspace_bytes
from netdsl.memory.schedule_arrays import (  # (the phases and kinds, re-exported)
    BWD,
    CLONE,
    D2H,
    FWD,
    H2D,
    NODE,
    SRC,
    STATE,
)

ROLES = ("loss", "output", "updates")  # what a training step computes
KEEP, RECOMPUTE, OFFLOAD = "keep", "recompute", "offload"
DECISIONS = (KEEP, RECOMPUTE, OFFLOAD)
__all__ = ["BWD", "CLONE", "D2H", "DECISIONS", "FWD", "H2D", "KEEP", "KINDS", "NODE",
           "OFFLOAD", "RECOMPUTE", "ROLES", "SRC", "STATE", "Prepared", "Sim", "prepare",
           "simulate"]


@dataclass
class Prepared:
    """A bound training graph indexed for repeated simulation (positions, not names)."""

    g: Graph
    names: list[str]  # the nodes a step runs, in graph order (before any rewrite)
    pos: dict[str, int]  # node name -> position in `names`
    bytes: list[int]  # bytes of each value (0 for state and in-place updates)
    inputs: list[tuple[int, ...]]  # input positions
    phase: list[int]  # FWD | BWD | SRC | STATE; optimizer updates count as BWD
    wanted: set[int]  # held to the end of the step (the roles' outputs)
    state_bytes: int
    workspace: int  # the shared workspace region
    candidates: list[int]  # forward values a decision can apply to, in forward order
    ops: list[str] = field(default_factory=list)
    full_bytes: list[int] = field(default_factory=list)  # every value's bytes, state too
    # optimizer-state buffers an update reads: offloading one keeps it in the host pool
    # and streams it in before its update and out right after
    opt_state: list[int] = field(default_factory=list)
    first_late: list[int] = field(default_factory=list)  # first backward reader, or -1
    first_bwd: int = 0  # position of the first backward node
    early: list[int] = field(default_factory=list)  # optimizer sources moved early
    late_node: list[bool] = field(default_factory=list)  # phase backward (not optimizer)
    updates: list[int] = field(default_factory=list)  # update nodes placed eagerly
    written: dict[int, tuple[int, ...]] = field(default_factory=dict)  # update -> roots
    root: list[int] = field(default_factory=list)  # storage a value aliases (views)
    # split graphs: each position's device (unplaced: 0), and per device its persistent
    # state bytes and its workspace region (the largest workspace of its nodes)
    device: list[int] = field(default_factory=list)
    device_state: dict[int, int] = field(default_factory=dict)
    device_workspace: dict[int, int] = field(default_factory=dict)
    # positions a clone may not copy: communication (the copy would send again) and
    # summaries (prepare)
    fixed: set[int] = field(default_factory=set)
    devices: list[int] = field(default_factory=lambda: [0])  # the devices, in order
    # an MPI step's sends, held past their readers as MPI holds them (meta "held_to",
    # parallel.project): the position holding them -> theirs, and those held to the end
    held: dict[int, list[int]] = field(default_factory=dict)
    held_end: set[int] = field(default_factory=set)
    # the cost model's times per (profile, float dtype), made once each (`cost.costs_of`)
    costs: dict = field(default_factory=dict, repr=False)

    def name(self, p: int) -> str:
        return self.names[p]

    @cached_property
    def arrays(self) -> sa.Arrays:
        """The graph as arrays, for the simulator's passes (`schedule_arrays`)."""
        return sa.arrays_of(self)


def prepare(g: Graph, roles: tuple[str, ...] = ROLES, float_dtype: str = "f32",
            eager_updates: bool = True) -> Prepared:
    """Index bound training-step graph `g` (module docstring): the step computing `roles`,
    its values counted in `float_dtype`; `eager_updates` False: the optimizer's updates
    stay where the graph has them."""
    ops = registry.load_all()
    order, _, wanted_names = schedule(g, roles)
    names = [n.name for n in order]
    pos = {name: k for k, name in enumerate(names)}
    device = [0 if n.device is None else n.device for n in order]
    v = _values(g, order, pos, device, ops, float_dtype)
    # never recomputed: communication (a copy would send or reduce again) and summaries
    # of a larger input (OpDef.extra["summary"]: a batchnorm's statistics, a few bytes
    # whose recompute reads the whole input again), which are no candidates either
    summary = {k for k, n in enumerate(order) if ops[n.op].extra.get("summary")}
    fixed = summary | {k for k, n in enumerate(order) if n.op in COMM_OPS}
    wanted = {pos[w] for w in wanted_names}
    read_bwd = set()
    for k, ins in enumerate(v.inputs):
        if v.phase[k] == BWD:
            read_bwd.update(ins)
    cands = [k for k in range(len(names)) if v.phase[k] == FWD and k in read_bwd
             and k not in wanted and v.bytes[k] > 0 and k not in summary]
    first_late, first_bwd, late_node = _backward_marks(order, v.phase, v.inputs)
    early, updates, written, root = _optimizer_order(g, order, v.inputs, ops)
    if not eager_updates:
        early, updates = [], []
    readers: dict[int, list[int]] = {}
    for k, ins in enumerate(v.inputs):
        for i in ins:
            readers.setdefault(i, []).append(k)
    # only state its one update reads is streamed through it (rule 5 of
    # `strategies.apply_decisions`): a step counter, read by its increment (and by every
    # update, unfused), stays on the device
    streamable = {k for u in updates for k in v.inputs[u] if readers[k] == [u]}
    opt_state = [k for k in range(len(names)) if v.phase[k] == STATE and k in read_bwd
                 and order[k].attrs.get("role") == "optimizer_state" and k in streamable]
    held, held_end = _held(order, pos)
    return Prepared(g, names, pos, v.bytes, v.inputs, v.phase, wanted, v.state, v.workspace,
                    cands, v.ops, v.full, opt_state, first_late, first_bwd, early, late_node,
                    updates, written, root, device, v.device_state, v.device_workspace,
                    fixed, sorted(set(device)) or [0], held, held_end)


class _Values(NamedTuple):
    """Each scheduled node's value, by position (`Prepared`'s fields of the same names)."""

    bytes: list[int]
    inputs: list[tuple[int, ...]]
    phase: list[int]
    ops: list[str]
    full: list[int]
    state: int
    workspace: int
    device_state: dict[int, int]
    device_workspace: dict[int, int]


def _values(g: Graph, order: list, pos: dict[str, int], device: list[int], ops: dict,
            float_dtype: str) -> _Values:
    """The bytes, inputs and phase of each node of `order`, and the state and workspace
    they add up to (per device too)."""
    nbytes, inputs, phase, opnames, full = [], [], [], [], []
    workspace = state = 0
    converting = conversion_device(g)  # (mixed precision: f32 copies around kernels)
    dev_state: dict[int, int] = {}
    dev_ws: dict[int, int] = {}
    sizes: dict = {}  # bytes per type: a deep network repeats a few types many times
    for n in order:
        opnames.append(n.op)
        inputs.append(tuple(pos[i] for i in n.inputs))
        b = sizes.get(n.type)
        if b is None:
            b = sizes[n.type] = value_bytes(n.type, float_dtype)
        full.append(b)
        d = device[len(phase)]
        if n.op in STATE_OPS:
            phase.append(STATE)
            state += b
            dev_state[d] = dev_state.get(d, 0) + b
            nbytes.append(0)
            continue
        if n.is_source:
            phase.append(SRC)
            nbytes.append(b)
            continue
        op = ops[n.op]
        phase.append(BWD if n.meta.get("phase") in ("backward", "optimizer") else FWD)
        nbytes.append(b if op.adds_storage(n) else 0)
        w = workspace_bytes(g, n, float_dtype, converting)
        workspace = max(workspace, w)
        dev_ws[d] = max(dev_ws.get(d, 0), w)
    return _Values(nbytes, inputs, phase, opnames, full, state, workspace, dev_state, dev_ws)


def _backward_marks(order: list, phase: list[int], inputs: list[tuple[int, ...]]
                    ) -> tuple[list[int], int, list[bool]]:
    """(each value's first backward reader, or -1; the first backward position; whether
    each position is a backward node, not the optimizer's)."""
    n_all = len(order)
    first_late = [-1] * n_all
    for k in range(n_all - 1, -1, -1):
        if phase[k] == BWD:
            for u in inputs[k]:
                first_late[u] = k
    first_bwd = next((k for k in range(n_all) if phase[k] == BWD), n_all)
    late_node = [phase[k] == BWD and order[k].meta.get("phase") != "optimizer"
                 for k in range(n_all)]
    return first_late, first_bwd, late_node


def _optimizer_order(g: Graph, order: list, inputs: list[tuple[int, ...]], ops: dict
                     ) -> tuple[list[int], list[int], dict[int, tuple[int, ...]], list[int]]:
    """(the optimizer's sources and step counter, moved early; its updates, placed
    eagerly; the storage each update writes; the storage each value aliases)."""
    upd_names = set(g.outputs.get("updates", ()))
    early, updates, written = [], [], {}
    root = list(range(len(order)))
    for k, n in enumerate(order):
        op = ops.get(n.op)
        if op is not None and op.view_of is not None and op.view_of < len(n.inputs) \
                and not op.written_inputs(n):
            root[k] = root[inputs[k][op.view_of]]
        if n.meta.get("phase") != "optimizer":
            continue
        if n.is_source or (n.name in upd_names and n.op == "step_increment"
                           and all(order[i].is_source for i in inputs[k])):
            early.append(k)
        elif n.name in upd_names:
            updates.append(k)
            written[k] = tuple(root[inputs[k][j]] for j in op.written_inputs(n))
    return early, updates, written, root


def _held(order: list, pos: dict[str, int]) -> tuple[dict[int, list[int]], set[int]]:
    """An MPI step's sends held past their readers (`Prepared.held`, `held_end`)."""
    held: dict[int, list[int]] = {}
    held_end: set[int] = set()
    for k, n in enumerate(order):
        to = n.meta.get("held_to")
        if to is not None and to in pos:
            held.setdefault(pos[to], []).append(k)
        elif to is not None:  # "end" (or a node the step does not run)
            held_end.add(k)
    return held, held_end


@dataclass
class Sim:
    """One simulated schedule: entries (kind, position) and the bytes after each."""

    entries: list[tuple[int, int]]
    timeline: list[int]  # device bytes after each entry ran (state + live + workspace)
    host_timeline: list[int]  # bytes in the host pool after each entry
    waits: dict[int, list[int]]  # entry index -> offloaded values whose copies it reads
    peak_bytes: int
    peak_index: int
    host_bytes: int
    state_bytes: int
    workspace: int
    offload_bytes: int  # bytes copied to the host (and as many back)
    recomputed: list[int]  # values recomputed (their clones)
    kinds: dict[str, list[int]] = field(default_factory=dict)  # live bytes by KINDS
    # device values: (value id, bytes, first entry, one past the last entry alive)
    lifetimes: list[tuple[int, int, int, int]] = field(default_factory=list, repr=False)
    # per device (a split graph's; one device: {0: peak_bytes}): the device's peak, and
    # its peak counting its host pool too (where host and device are one memory)
    device_peaks: dict[int, int] = field(default_factory=dict)
    device_unified_peaks: dict[int, int] = field(default_factory=dict)

    @gc_paused()  # (a list per schedule entry: netdsl.ir.bulk)
    def arena(self) -> tuple[int, int]:
        """(arena bytes, lower bound): the values packed by lifetime into one block by
        netdsl.memory.arena (first fit), against the most value bytes alive at once."""
        from netdsl.memory.arena import pack
        m = len(self.entries)
        frees: list[list[str]] = [[] for _ in range(m)]
        made: dict[int, list[str]] = {}
        sizes: dict[str, int] = {}
        for vid, b, s, e in self.lifetimes:
            key = f"v{vid}"
            sizes[key] = b
            made.setdefault(s, []).append(key)
            frees[min(e, m) - 1].append(key)
        # pack() expects values named after the entry that makes them: one entry may
        # make several here (a value and nothing else, in practice), so split them
        order2, frees2 = [], []
        for i in range(m):
            keys = made.get(i, [])
            for key in keys[:-1]:
                order2.append(key)
                frees2.append([])
            order2.append(keys[-1] if keys else str(i))
            frees2.append(frees[i])
        _, size = pack(order2, frees2, sizes)
        return size, self.peak_bytes - self.state_bytes - self.workspace

    @cached_property
    def unified_peak(self) -> int:
        """The peak when host and device are one memory (the `cpu` profile)."""
        if not self.host_bytes:  # (an empty host pool adds nothing anywhere)
            return self.peak_bytes
        return max((d + h for d, h in zip(self.timeline, self.host_timeline)),
                   default=self.state_bytes + self.workspace)


KINDS = ("forward values", "backward values", "recomputed", "prefetched")


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
    kind, pos, renamed, offloaded, cloned = sa.place(n, need, rec, prep.first_bwd, prefetch)
    # 3. eager updates, and offloaded optimizer state streamed through its update
    if prep.updates:
        kind, pos = sa.eager(prep.arrays, kind, pos, renamed)
    if any(off[p] for p in prep.opt_state):
        seq = _stream_state(prep, list(zip(kind.tolist(), pos.tolist())), off, prefetch,
                            offloaded)
        kind = np.asarray([k for k, _ in seq], np.int8)
        pos = np.asarray([p for _, p in seq], np.int64)
        for p in prep.opt_state:
            if off[p]:
                renamed[p] = 2  # the update reads the copy brought in for it
    sim = _count(prep, kind, pos, sa.reads(prep.arrays, kind, pos, renamed, prep.held),
                 offloaded, cloned)
    if by_kind:
        sim.kinds = _kinds(prep, sim.lifetimes, len(kind))
    return sim


def _needed_at(prep: Prepared, decisions: dict[int, str], rec: list[bool],
               off: list[bool]) -> dict[int, int]:
    """1. where each planned value is first needed in the backward pass: at its first
    backward reader, or earlier if a clone that reads it is needed earlier."""
    inputs, phase = prep.inputs, prep.phase
    wanted = prep.wanted
    first_late = prep.first_late
    need: dict[int, int] = {}
    for p in sorted(decisions, reverse=True):
        if p in wanted or not (rec[p] or off[p]) or phase[p] == STATE:
            continue
        k = first_late[p]
        if k >= 0 and (p not in need or k < need[p]):
            need[p] = k
        if rec[p] and p in need:
            for u in inputs[p]:
                if (rec[u] or off[u]) and u not in wanted and phase[u] != STATE:
                    if u not in need or need[p] < need[u]:
                        need[u] = need[p]
    return need


def _count(prep: Prepared, kind: np.ndarray, pos: np.ndarray, rd: sa.Reads,
           offloaded: list[int], cloned: list[int]) -> Sim:
    """5. the byte count: each value's lifetime, the device and host timelines and their
    peaks (per device too, for a split graph)."""
    a, m = prep.arrays, len(kind)
    life = sa.lifetimes(a, rd, m)
    host_state = [p for p in offloaded if prep.phase[p] == STATE]
    full = prep.full_bytes
    device_state = prep.state_bytes - sum(full[p] for p in host_state)
    timeline = sa.timeline(life, m, device_state + prep.workspace)
    if m:
        peak_i = int(np.argmax(timeline))
        peak = int(timeline[peak_i])
    else:
        peak, peak_i = device_state + prep.workspace, -1
    host_end = {p: e for p in rd.host_start if (e := int(rd.last[3 * len(a.phase) + p])) >= 0}
    hosted = _hosted(prep, rd.host_start, host_end, m)
    if rd.host_start:
        host = sa.timeline(hosted[:, 1:], m, sum(full[p] for p in host_state))
    else:
        host = np.zeros(m, np.int64)
    sim = Sim(list(zip(kind.tolist(), pos.tolist())), timeline.tolist(), host.tolist(),
              rd.waits, peak, peak_i, int(host.max(initial=0)), device_state,
              prep.workspace, sum(full[p] for p in offloaded), cloned,
              lifetimes=list(map(tuple, life.tolist())))
    if len(prep.devices) > 1:
        _by_device(prep, sim, life, hosted, host_state)
    else:
        sim.device_peaks = {0: peak}
        sim.device_unified_peaks = {0: sim.unified_peak}
    return sim


def _hosted(prep: Prepared, host_start: dict[int, int], host_end: dict[int, int], m: int
            ) -> np.ndarray:
    """The host pool's values but state: rows (device, id, bytes, first entry, one past
    the last), as `schedule_arrays.lifetimes` gives the device's (after the device)."""
    rows = [(prep.device[p] if prep.device else 0, p, prep.bytes[p], s,
             host_end.get(p, m - 1) + 1)
            for p, s in host_start.items() if prep.phase[p] != STATE]
    return np.array(rows, dtype=np.int64).reshape(-1, 5)


def _kinds(prep: Prepared, ends: list[tuple[int, int, int, int]], m: int
           ) -> dict[str, list[int]]:
    """The live bytes after each of `m` entries, split into KINDS."""
    n, phase = len(prep.names), prep.phase
    kd = {k: [0] * (m + 1) for k in KINDS}
    for vid, b, s, e in ends:
        p = vid % n if vid >= n else vid
        kind = (KINDS[3] if vid >= 2 * n else KINDS[2] if vid >= n
                else KINDS[1] if phase[p] == BWD else KINDS[0])
        kd[kind][s] += b
        kd[kind][e] -= b
    return {k: list(accumulate(d[:m])) for k, d in kd.items()}


def _by_device(prep: Prepared, sim: Sim, life: np.ndarray, hosted: np.ndarray,
               host_state: list[int]) -> None:
    """Sim.device_peaks and device_unified_peaks of a split graph (module doc)."""
    n, m = len(prep.names), len(sim.entries)
    dev = np.asarray(prep.device, np.int64)
    on = dev[life[:, 0] % n]
    full = prep.full_bytes
    base_host: dict[int, int] = {}
    for p in host_state:
        base_host[prep.device[p]] = base_host.get(prep.device[p], 0) + full[p]
    for d in prep.devices:
        base = prep.device_state.get(d, 0) - base_host.get(d, 0) \
            + prep.device_workspace.get(d, 0)
        on_dev = sa.timeline(life[on == d], m, base)
        in_host = sa.timeline(hosted[hosted[:, 0] == d][:, 1:], m, base_host.get(d, 0))
        sim.device_peaks[d] = int(on_dev.max(initial=base))
        sim.device_unified_peaks[d] = int((on_dev + in_host).max(
            initial=base + base_host.get(d, 0)))


def _stream_state(prep: Prepared, seq, off, prefetch: int, offloaded: list[int]):
    """Offloaded optimizer state: copied in `prefetch` entries before its update, out
    right after it."""
    at = {p: i for i, (kind, p) in enumerate(seq) if kind == NODE}
    users: dict[int, list[int]] = {}
    for u in prep.updates:
        for s in prep.inputs[u]:
            users.setdefault(s, []).append(u)
    before: dict[int, list[int]] = {}
    after: dict[int, list[int]] = {}
    for s in prep.opt_state:
        if not off[s]:
            continue
        readers = [at[u] for u in users.get(s, ())]
        if not readers:
            continue
        offloaded.append(s)
        before.setdefault(max(0, min(readers) - prefetch), []).append(s)
        after.setdefault(max(readers), []).append(s)
    out = []
    for i, e in enumerate(seq):
        out.extend((H2D, s) for s in before.get(i, ()))
        out.append(e)
        out.extend((D2H, s) for s in after.get(i, ()))
    return out
