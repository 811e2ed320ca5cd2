"""A fast model of a planned training step: its schedule and the device bytes it holds.

`prepare(g)` indexes a bound training-step graph once (forward + autodiff + optimizer);
`simulate(prep, decisions)` then builds, without rewriting the graph, the schedule that
`netdsl.memory.strategies.apply_decisions` produces for the same decisions, and counts
its bytes with the executor's rule. The search calls it many times, so it works on
integer positions, not on nodes. The semantics (docs/memory.md):

1. eager updates: each parameter's update runs right after the node producing its
   gradient, so no step holds all gradients (the sources the optimizer adds, its state
   and the learning rate, are scheduled first);
2. keep: a value lives from its producer until its last reader (netdsl/memory/plan.py);
3. recompute v: v is freed after its last forward reader; a clone of v's node runs right
   before the first backward node reading v, reading v's inputs resolved recursively
   (kept: as they are, offloaded: their device copy, recomputed: their own clone, made
   first); every backward reader reads the clone, which lives until its last reader;
4. offload v: a `to_host` copy runs right after v's last forward reader (v is freed after
   it; the host copy lives in a host pool until it is copied back), and a `to_device`
   copy `prefetch` scheduled nodes before the first reader of the device copy, which
   lives until its last reader;
5. device bytes = persistent state (params, buffers, optimizer state) + live values + one
   shared workspace region, the largest `OpDef.workspace` of any scheduled node.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

from netdsl.ir import registry
from netdsl.ir.graph import STATE_OPS, Graph
from netdsl.memory.liveness import schedule
from netdsl.memory.plan import value_bytes, workspace_bytes

ROLES = ("loss", "output", "updates")  # what a training step computes
KEEP, RECOMPUTE, OFFLOAD = "keep", "recompute", "offload"
DECISIONS = (KEEP, RECOMPUTE, OFFLOAD)

# phases of a scheduled node
FWD, BWD, SRC, STATE = 0, 1, 2, 3
# kinds of schedule entries
NODE, CLONE, D2H, H2D = 0, 1, 2, 3


@dataclass
class Prepared:
    """A bound training graph indexed for repeated simulation (positions, not names)."""

    g: Graph
    names: list[str]  # the base schedule (eager updates applied), all decisions "keep"
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

    def name(self, p: int) -> str:
        return self.names[p]


def _is_update(n) -> bool:
    return n.meta.get("phase") == "optimizer" and bool(registry.OPS[n.op].writes)


def prepare(g: Graph, roles: tuple[str, ...] = ROLES, float_dtype: str = "f32",
            eager_updates: bool = True) -> Prepared:
    ops = registry.load_all()
    order, _, wanted_names = schedule(g, roles)
    if eager_updates:
        order = _eager(g, order)
    names = [n.name for n in order]
    pos = {name: k for k, name in enumerate(names)}
    nbytes, inputs, phase, opnames, full = [], [], [], [], []
    workspace = state = 0
    sizes: dict = {}  # bytes per type: a deep network repeats a few types many times
    for n in order:
        opnames.append(n.op)
        inputs.append(tuple(pos[i] for i in n.inputs))
        b = sizes.get(n.type)
        if b is None:
            b = sizes[n.type] = value_bytes(n.type, float_dtype)
        full.append(b)
        if n.op in STATE_OPS:
            phase.append(STATE)
            state += b
            nbytes.append(0)
            continue
        if n.is_source:
            phase.append(SRC)
            nbytes.append(b)
            continue
        op = ops[n.op]
        phase.append(BWD if n.meta.get("phase") in ("backward", "optimizer") else FWD)
        nbytes.append(b if op.adds_storage(n) else 0)
        workspace = max(workspace, workspace_bytes(g, n, float_dtype))
    wanted = {pos[w] for w in wanted_names}
    read_bwd = set()
    for k, ins in enumerate(inputs):
        if phase[k] == BWD:
            read_bwd.update(ins)
    cands = [k for k in range(len(names)) if phase[k] == FWD and k in read_bwd
             and k not in wanted and nbytes[k] > 0]
    opt_state = [k for k in range(len(names)) if phase[k] == STATE and k in read_bwd
                 and order[k].attrs.get("role") == "optimizer_state"]
    return Prepared(g, names, pos, nbytes, inputs, phase, wanted, state, workspace, cands,
                    opnames, full, opt_state)


def _eager(g: Graph, order: list) -> list:
    """Move each update right after its gradient's producer; the non-state sources the
    updates read (the learning rate) go first."""
    grad_of = g.meta.get("grad_of", {})
    updates_after: dict[str, list] = {}
    moved = set()
    for n in order:
        if _is_update(n):
            grads = [i for i in n.inputs if i in grad_of]
            if grads:
                updates_after.setdefault(grads[0], []).append(n)
                moved.add(n.name)
    update_inputs = {i for ns in updates_after.values() for u in ns for i in u.inputs}
    early = [n for n in order if n.is_source and n.name in update_inputs
             and n.meta.get("phase") == "optimizer"]
    early_names = {n.name for n in early}
    out = list(early)
    for n in order:
        if n.name in moved or n.name in early_names:
            continue
        out.append(n)
        out.extend(updates_after.get(n.name, ()))
    return out


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

    def arena(self) -> tuple[int, int]:
        """(arena bytes, lower bound): the values packed by lifetime into one block by
        netdsl.memory.arena (first fit), against the most value bytes alive at once."""
        from netdsl.memory.arena import pack
        m = len(self.entries)
        order = [str(i) for i in range(m)]
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
            order2.append(keys[-1] if keys else order[i])
            frees2.append(frees[i])
        _, size = pack(order2, frees2, sizes)
        return size, self.peak_bytes - self.state_bytes - self.workspace

    @property
    def unified_peak(self) -> int:
        """The peak when host and device are one memory (the `cpu` profile)."""
        return max((d + h for d, h in zip(self.timeline, self.host_timeline)),
                   default=self.state_bytes + self.workspace)


KINDS = ("forward values", "backward values", "recomputed", "prefetched")


def simulate(prep: Prepared, decisions: dict[int, str] | None = None,
             prefetch: int = 1, by_kind: bool = False) -> Sim:
    """The schedule and byte counts of `prep` under `decisions` (position -> decision;
    positions not given are kept). `by_kind` also splits the live bytes into KINDS."""
    decisions = decisions or {}
    n = len(prep.names)
    inputs, phase = prep.inputs, prep.phase
    rec = [False] * n
    off = [False] * n
    for p, d in decisions.items():
        if d == RECOMPUTE:
            rec[p] = True
        elif d == OFFLOAD:
            off[p] = True

    # 1. the compute sequence: base nodes with clones made just before their first reader
    seq: list[tuple[int, int]] = []
    cloned = [False] * n
    for p in range(n):
        if phase[p] == BWD:
            for u in inputs[p]:
                if rec[u] and not cloned[u]:
                    _materialize(u, inputs, rec, cloned, seq)
        seq.append((NODE, p))

    # 2. who reads what: resolve backward/clone reads to clones and device copies
    # value ids: p (original), n + p (clone), 2n + p (device copy)
    last = [-1] * (3 * n)
    first_dev = [-1] * n
    last_fwd = [-1] * n
    reads_dev: dict[int, list[int]] = {}
    any_off = any(off)
    is_state = phase  # phase[p] == STATE marks persistent state
    for i, (kind, p) in enumerate(seq):
        if kind == CLONE or phase[p] == BWD:
            for u in inputs[p]:
                if rec[u]:
                    last[n + u] = i
                elif off[u]:
                    last[2 * n + u] = i
                    if first_dev[u] < 0:
                        first_dev[u] = i
                    reads_dev.setdefault(i, []).append(u)
                else:
                    last[u] = i
        else:
            for u in inputs[p]:
                last[u] = i
                last_fwd[u] = i

    # 3. transfers: to_host after the last forward reader, to_device `prefetch` before
    # the first reader of the device copy
    after: dict[int, list[int]] = {}
    before: dict[int, list[int]] = {}
    offloaded = []
    if any_off:
        seq_index = [0] * n
        for i, (kind, p) in enumerate(seq):
            if kind == NODE:
                seq_index[p] = i
        for p in prep.candidates:
            if not off[p] or first_dev[p] < 0:
                continue
            offloaded.append(p)
            down = last_fwd[p] if last_fwd[p] >= 0 else seq_index[p]
            after.setdefault(down, []).append(p)
            up = max(first_dev[p] - prefetch, down + 1)
            before.setdefault(up, []).append(p)
        for p in prep.opt_state:  # in from the host before the update, out after it
            if not off[p] or first_dev[p] < 0:
                continue
            offloaded.append(p)
            after.setdefault(last[2 * n + p], []).append(p)
            before.setdefault(max(first_dev[p] - prefetch, 0), []).append(p)

    entries: list[tuple[int, int]] = []
    started: list[tuple[int, int]] = []  # (value id, entry index where it appears)
    remap = [0] * len(seq)  # seq index -> entry index
    host_start: dict[int, int] = {}
    host_end: dict[int, int] = {}
    if any_off:
        for i, e in enumerate(seq):
            if i in before:
                for p in before[i]:
                    started.append((2 * n + p, len(entries)))
                    host_end[p] = len(entries)
                    entries.append((H2D, p))
            remap[i] = len(entries)
            kind, p = e
            started.append((n + p if kind == CLONE else p, len(entries)))
            entries.append(e)
            if i in after:
                for p in after[i]:
                    host_start[p] = len(entries)
                    entries.append((D2H, p))
    else:
        entries = seq
        remap = range(len(seq))
        started = [(n + p if kind == CLONE else p, i) for i, (kind, p) in enumerate(seq)]

    # 4. the byte count
    m = len(entries)
    nbytes, full = prep.bytes, prep.full_bytes
    wanted = prep.wanted
    host_state = [p for p in offloaded if is_state[p] == STATE]
    ends: list[tuple[int, int, int, int]] = []  # (value id, bytes, first, one past last)
    for vid, s in started:
        p = vid % n if vid >= n else vid
        b = nbytes[p] if is_state[p] != STATE else full[p] if vid >= 2 * n else 0
        if b == 0:
            continue
        if vid < n and p in wanted:
            e = m
        elif (vid < n or is_state[p] == STATE) and p in host_start:
            e = host_start[p] + 1  # freed after its to_host copy
        elif last[vid] >= 0:
            e = remap[last[vid]] + 1
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
            if is_state[p] != STATE:
                hdiff[s] += nbytes[p]
                hdiff[host_end.get(p, m - 1) + 1] -= nbytes[p]
        host = list(accumulate(hdiff[:m]))
    else:
        host = [0] * m
    waits = {remap[i]: us for i, us in reads_dev.items()}
    sim = Sim(entries, timeline, host, waits, peak, peak_i, max(host, default=0),
              device_state, prep.workspace, sum(full[p] for p in offloaded),
              [p for p in range(n) if cloned[p]], lifetimes=ends)
    if by_kind:
        kd = {k: [0] * (m + 1) for k in KINDS}
        for vid, b, s, e in ends:
            p = vid % n if vid >= n else vid
            kind = (KINDS[3] if vid >= 2 * n else KINDS[2] if vid >= n
                    else KINDS[1] if phase[p] == BWD else KINDS[0])
            kd[kind][s] += b
            kd[kind][e] -= b
        sim.kinds = {k: list(accumulate(d[:m])) for k, d in kd.items()}
    return sim


def _materialize(v: int, inputs, rec, cloned, seq) -> None:
    """Append clones of v and of the recomputed values it needs, inputs first
    (iteratively: a recompute chain can be thousands of nodes long)."""
    stack = [(v, False)]
    while stack:
        u, expanded = stack.pop()
        if cloned[u]:
            continue
        if expanded:
            cloned[u] = True
            seq.append((CLONE, u))
            continue
        stack.append((u, True))
        for w in reversed(inputs[u]):
            if rec[w] and not cloned[w]:
                stack.append((w, False))
