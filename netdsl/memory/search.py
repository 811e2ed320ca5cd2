"""The planner: decide keep / recompute / offload for every retained forward value.

`plan_memory(g, budget, profile, strategy)` takes a bound training-step graph and
returns a `PlanResult`. Every candidate plan is scored with the fast simulator
(`simulate.py`, the same schedule `strategies.apply_decisions` builds) and the cost model
(`cost.py`); the chosen plan is the fastest predicted one whose peak fits the budget.

Strategies:
- `none`: keep everything (the unplanned step, with eager updates);
- `checkpoint-sqrt` (Chen et al. 2016): keep every ceil(sqrt(n))-th retained value as a
  segment boundary and recompute the others;
- `offload-all` (vDNN, Rhu et al. 2016): offload every retained value;
- `recompute-all`: recompute every retained value (rebuilt from parameters and inputs);
- `auto` (layer-adaptive, after Layup): each value gets the cheaper of recompute and
  offload per byte it frees (recompute costs the node's time; offload the part of its
  copy that the prefetch window cannot hide; cheap norm/activation/pool/element-wise
  outputs therefore recompute and convolution/linear outputs offload). A value is only
  recomputed when no value its clone reads is recomputed too, so clones never chain. The
  values are ordered by cost per byte into one ladder, independent of the budget; the
  plan is the shortest prefix of the ladder that fits (regula falsi over exact
  simulations), compared with the baselines and, in unified memory, with checkpoint
  plans on the forward pass's cut points (`checkpoint.py`), the fastest feasible one
  winning. Because the ladder does not depend on the budget, a longer prefix only adds
  work and a checkpoint plan for a larger budget is chosen from more plans, a larger
  budget never predicts a slower step.

Recomputing a value also recomputes the forward values between it and the retained
values its clone reads (the BatchNorm output under a ReLU): otherwise the clone would
hold them alive from the forward pass.

A split training step (`netdsl.parallel`: nodes placed on devices) is planned against a
budget per device: a plan fits when every device's peak (`Sim.device_peaks`, the rule of
`memory.plan.device_peaks`) is within the budget. A clone stays on its value's device and
an offloaded value goes to that device's host memory, so a device's bytes depend only on
the decisions about its own values: the ladder is split by device and each device's
shortest fitting prefix is searched at once (`devices.shortest_prefixes`). Communication is
never recomputed, and a clone reads a received value rather than receive it again.
"""
from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field

from netdsl.errors import BudgetError, NetdslError
from netdsl.ir import registry
from netdsl.ir.bulk import gc_paused
from netdsl.ir.graph import Graph
from netdsl.memory.checkpoint import (
    chain_fits,
    chain_plan,
    cut_points,
    decisions_of,
    grain_of,
    model_peak,
    units,
)
from netdsl.memory.cost import costs_of
from netdsl.memory.devices import per_device, shortest_prefixes
from netdsl.memory.plan import MemoryPlan
from netdsl.memory.profiles import Profile, get_profile
from netdsl.memory.simulate import (
    BWD,
    DECISIONS,
    FWD,
    H2D,
    KEEP,
    OFFLOAD,
    RECOMPUTE,
    ROLES,
    STATE,
    Prepared,
    Sim,
    prepare,
    simulate,
)
from netdsl.sizes import format_bytes, parse_size

STRATEGIES = ("auto", "none", "checkpoint-sqrt", "offload-all", "recompute-all")
CHEAP_TYPES = ("norm", "activation", "pool", "elementwise", "shape", "dropout", "reduce")


class PlanError(NetdslError):
    pass


@dataclass
class PlanResult:
    network: str
    strategy: str
    profile: Profile
    budget_bytes: int
    feasible: bool
    decisions: dict[str, str]  # forward value -> keep | recompute | offload (non-keep only)
    # predicted device peak (state + live + workspace; plus the host pool where host and
    # device are one memory)
    planned_peak_bytes: int
    baseline_peak_bytes: int  # the same step without a plan (eager updates)
    host_bytes: int  # peak of the host pool
    predicted_step_s: float
    baseline_step_s: float
    offload_bytes: int  # bytes copied to the host (as many come back)
    recompute_flops: int
    state_bytes: int
    workspace_bytes: int
    plan_s: float
    prefetch: int
    counts: dict[str, int] = field(default_factory=dict)  # per decision
    by_layer_type: dict[str, dict[str, int]] = field(default_factory=dict)
    min_feasible_bytes: int | None = None  # the smallest budget a plan was found for
    dominant: str = ""  # what dominates the smallest peak
    sim: Sim | None = field(default=None, repr=False)
    baseline_sim: Sim | None = field(default=None, repr=False)
    prep: Prepared | None = field(default=None, repr=False)
    state_offloaded: int = 0  # optimizer-state buffers kept in the host pool
    state_buffers: int = 0  # optimizer-state buffers in all
    verified_peak_bytes: int | None = None  # make_plan of the rewritten step (api.plan)
    # ... that storage plan itself, of a step on one device (the run follows it)
    storage: MemoryPlan | None = field(default=None, repr=False)
    # what a run holds besides the plan, within the budget (plan.unplanned_bytes)
    outside_plan_bytes: int = 0
    verify_s: float | None = None
    # split steps: per device, the planned peak and what was recomputed / offloaded
    # (`recompute`, `recompute_bytes`, `offload`, `offload_bytes`, `peak_bytes`)
    per_device: dict[int, dict] = field(default_factory=dict)
    worst_device: int | None = None  # the device furthest over (or nearest) the budget

    @property
    def predicted_overhead(self) -> float:
        return self.predicted_step_s / self.baseline_step_s - 1 if self.baseline_step_s else 0.0


class Planner:
    def __init__(self, g: Graph, profile: Profile, float_dtype: str, prefetch: int,
                 overrides: dict[str, str] | None, offload_state: bool = False,
                 roles: tuple[str, ...] = ROLES, reserves: dict[int, int] | None = None,
                 prep: Prepared | None = None):
        self.prep = prep or prepare(g, roles, float_dtype=float_dtype)
        self.costs = costs_of(self.prep, profile, float_dtype)
        self.profile = profile
        self.prefetch = prefetch
        self.ops = registry.load_all()
        prep = self.prep
        self.cand = prep.candidates
        self.cand_set = set(self.cand)
        self.offload_state = offload_state
        self.fixed = prep.fixed  # communication and summaries: never recomputed
        self.devices = prep.devices
        self.multi = len(self.devices) > 1  # a split step: the budget is per device
        # per device, what its process holds besides its plan (over MPI:
        # `plan.process_reserves`), within the same budget
        self.reserve = reserves or {}
        self.forced = self._forced(g, overrides or {})
        self.cache: dict[tuple, tuple[Sim, float]] = {}

    def _forced(self, g: Graph, overrides: dict[str, str]) -> dict[int, str]:
        out: dict[int, str] = {}
        for name, p in self.prep.pos.items():
            n = g[name]
            for d in DECISIONS:
                # an annotated block's communication (a split's recv) is not recomputed
                if n.annotations.get(d) and not (d == RECOMPUTE and p in self.fixed):
                    out[p] = d
        for name, d in overrides.items():
            if d not in DECISIONS:
                raise PlanError(f"unknown memory decision {d!r} for %{name}: use "
                                f"{', '.join(DECISIONS)}")
            if name not in self.prep.pos:
                raise PlanError(f"cannot plan %{name}: no value of that name in the "
                                "training step")
            out[self.prep.pos[name]] = d
        # only retained forward values can be recomputed or offloaded, and optimizer
        # state offloaded
        state = set(self.prep.opt_state)
        for p, d in out.items():
            if p in state and d == RECOMPUTE:
                raise PlanError(f"%{self.prep.names[p]} is optimizer state: it can be kept "
                                "or offloaded, not recomputed")
            if p in self.fixed and d == RECOMPUTE:
                raise PlanError(f"%{self.prep.names[p]} is communication between devices: "
                                "it can be kept or offloaded, not recomputed")
        return {p: d for p, d in out.items() if p in self.cand_set or p in state}

    # -- evaluating a plan ------------------------------------------------------------
    def close(self, dec: dict[int, str]) -> dict[int, str]:
        """Add the forward values between each recomputed value and the retained values
        its clone reads (module doc); apply the source annotations. Communication stays
        kept where a plan (a checkpoint segment) would recompute it, and so does a value
        the decisions say to keep (a checkpoint plan's anchor)."""
        pinned = {p for p, d in dec.items() if d == KEEP}
        dec = {p: d for p, d in dec.items()
               if d != KEEP and not (d == RECOMPUTE and p in self.fixed)}
        for p, d in self.forced.items():
            if d == KEEP:
                dec.pop(p, None)
            else:
                dec[p] = d
        prep = self.prep
        stack = [p for p, d in dec.items() if d == RECOMPUTE]
        while stack:
            v = stack.pop()
            for u in prep.inputs[v]:
                if (prep.phase[u] == FWD and u not in self.cand_set and u not in dec
                        and u not in prep.wanted and prep.bytes[u] > 0
                        and u not in self.fixed and u not in pinned):
                    dec[u] = RECOMPUTE
                    stack.append(u)
        return dec

    def evaluate(self, dec: dict[int, str]) -> tuple[Sim, float, dict[int, str]]:
        dec = self.close(dec)
        key = (self.prefetch, tuple(sorted(dec.items())))
        if key not in self.cache:
            sim = simulate(self.prep, dec, self.prefetch)
            self.cache[key] = (sim, self.costs.step_time(sim))
        sim, t = self.cache[key]
        return sim, t, dec

    def peak(self, sim: Sim) -> int:
        """The peak the budget bounds: a split step's largest device peak, each with its
        process's reserve."""
        if self.multi:
            return max(self.held_peaks(sim).values())
        return sim.unified_peak if self.profile.unified else sim.peak_bytes

    def device_peaks(self, sim: Sim) -> dict[int, int]:
        """Each device's planned peak."""
        return sim.device_unified_peaks if self.profile.unified else sim.device_peaks

    def held_peaks(self, sim: Sim) -> dict[int, int]:
        """Each device's planned peak and its process's reserve: what the budget bounds."""
        return {d: v + self.reserve.get(d, 0) for d, v in self.device_peaks(sim).items()}

    # -- strategies ---------------------------------------------------------------------
    def baseline(self, strategy: str) -> dict[int, str]:
        c = self.cand
        if strategy == "none":
            return {}
        if strategy == "offload-all":
            return {p: OFFLOAD for p in c}
        if strategy == "recompute-all":
            return {p: RECOMPUTE for p in c if p not in self.fixed}
        if strategy == "checkpoint-sqrt":
            return self.segments(max(1, math.ceil(math.sqrt(len(c)))))
        raise PlanError(f"unknown strategy {strategy!r}: use {', '.join(STRATEGIES)}")

    def segments(self, k: int) -> dict[int, str]:
        """Keep every k-th retained value (in forward order), recompute the others."""
        return {p: RECOMPUTE for i, p in enumerate(self.cand) if i % k and p not in self.fixed}

    def closure_inputs(self, v: int) -> set[int]:
        """The retained values the clone of v (with its closure) reads."""
        prep, out, seen, stack = self.prep, set(), {v}, [v]
        while stack:
            x = stack.pop()
            for u in prep.inputs[x]:
                if u in seen or prep.phase[u] != FWD:
                    continue
                seen.add(u)
                if u in self.cand_set or u in prep.wanted or prep.bytes[u] == 0 \
                        or u in self.fixed:
                    out.add(u)
                else:
                    stack.append(u)
        return out

    def closure_time(self, v: int, stop=frozenset()) -> float:
        """Predicted time of v's clone and its closure (which stops at `stop` too)."""
        prep, t, seen, stack = self.prep, self.costs.time[v], {v}, [v]
        while stack:
            x = stack.pop()
            for u in prep.inputs[x]:
                if u in seen or prep.phase[u] != FWD or u in self.cand_set \
                        or u in prep.wanted or prep.bytes[u] == 0 or u in self.fixed \
                        or u in stop:
                    continue
                seen.add(u)
                t += self.costs.time[u]
                stack.append(u)
        return t

    def first_bwd(self) -> dict[int, int]:
        """Position of the first backward reader of each value."""
        out: dict[int, int] = {}
        for k, ins in enumerate(self.prep.inputs):
            if self.prep.phase[k] == BWD:
                for u in ins:
                    out.setdefault(u, k)
        return out

    def estimates(self) -> tuple[dict[int, float], dict[int, float]]:
        """Predicted extra time of recomputing / offloading each candidate on its own
        (no offload cost where host and device share memory)."""
        prep, costs = self.prep, self.costs
        window = self._windows(self.first_bwd())
        rec_cost = {p: self.closure_time(p) for p in self.cand}
        off_cost = {}
        for p in self.cand:
            if self.profile.unified:
                continue
            c = costs.copy_time(prep.bytes[p])
            # exposed part of the prefetch, plus a little for the copy engines' load
            off_cost[p] = max(0.0, c - window.get(p, 0.0)) + 0.05 * c
        return rec_cost, off_cost

    def ladder(self) -> list[tuple[int, str]]:
        """(value, decision) by predicted cost per byte freed; budget-independent."""
        prep = self.prep
        rec_cost, off_cost = self.estimates()
        # recompute only where no clone would read another clone (no chains)
        mode: dict[int, str] = {}
        reads = {p: self.closure_inputs(p) & self.cand_set for p in self.cand}
        read_by: dict[int, set[int]] = {}
        for p, us in reads.items():
            for u in us:
                read_by.setdefault(u, set()).add(p)
        by_rec = sorted(self.cand, key=lambda p: rec_cost[p] / prep.bytes[p])
        for p in by_rec:
            if p in self.fixed or (p in off_cost and off_cost[p] <= rec_cost[p]):
                continue
            if any(mode.get(u) == RECOMPUTE for u in reads[p]) or \
                    any(mode.get(w) == RECOMPUTE for w in read_by.get(p, ())):
                continue
            mode[p] = RECOMPUTE
        items = []
        for p in self.cand:
            if mode.get(p) == RECOMPUTE:
                items.append((rec_cost[p] / prep.bytes[p], p, RECOMPUTE))
            elif p in off_cost:
                items.append((off_cost[p] / prep.bytes[p], p, OFFLOAD))
        items.sort()
        out = [(p, d) for _, p, d in items]
        if self.offload_state and not self.profile.unified:
            # the last resort: optimizer state kept in the host pool, streamed in before
            # its update and out after it (latest updates first: they run first)
            out += [(p, OFFLOAD) for p in sorted(prep.opt_state, reverse=True)]
        return out

    def _windows(self, first_bwd: dict[int, int]) -> dict[int, float]:
        """Compute time of the `prefetch` nodes scheduled before each first reader."""
        t = self.costs.time
        out = {}
        for p, k in first_bwd.items():
            out[p] = sum(t[j] for j in range(max(0, k - self.prefetch), k))
        return out


def plan_memory(g: Graph, budget_bytes: int | str, profile: Profile | str = "k40-12gb",
                strategy: str = "auto", float_dtype: str = "f32",
                overrides: dict[str, str] | None = None, prefetch: int | None = None,
                progress=None, offload_state: bool = False,
                roles: tuple[str, ...] = ROLES,
                reserves: dict[int, int] | None = None,
                prep: Prepared | None = None) -> PlanResult:
    """Plan bound training-step graph `g` into `budget_bytes` (module doc); a split step
    into `budget_bytes` per device, each device's plan into the budget less its
    `reserves` entry (what its process holds besides its plan: `plan_and_apply`).
    `roles`: the outputs the step computes; `prep`: `prepare(g, roles, float_dtype)`,
    where the caller has it (searches of one step share it).

    `overrides` maps forward value names to decisions, as `@keep`/`@recompute`/`@offload`
    do in the source; `prefetch` is how many nodes ahead of its reader a `to_device` copy
    is issued (None: DEFAULT_PREFETCH, or 1 if nothing fits with it); `progress(fraction)`
    is called as the search advances. `offload_state=True` lets the plan keep optimizer
    state in the host pool as a last resort (`apply_decisions` streams it through its
    update)."""
    t0 = time.perf_counter()
    budget = parse_size(budget_bytes, "memory budget")
    profile = get_profile(profile)
    if strategy not in STRATEGIES:
        raise PlanError(f"unknown strategy {strategy!r}: use {', '.join(STRATEGIES)}")
    if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int)
                                 or prefetch < 1):
        raise PlanError(f"prefetch must be a positive number of nodes, got {prefetch!r}")
    prep = prep or prepare(g, roles, float_dtype=float_dtype)
    if prefetch is None and not profile.unified and strategy in ("auto", "offload-all"):
        res = plan_memory(g, budget, profile, strategy, float_dtype, overrides,
                          DEFAULT_PREFETCH, progress, offload_state, roles, reserves, prep)
        if not res.feasible:
            res = plan_memory(g, budget, profile, strategy, float_dtype, overrides, 1,
                              progress, offload_state, roles, reserves, prep)
        res.plan_s = time.perf_counter() - t0
        return res
    pl = Planner(g, profile, float_dtype, prefetch or 1, overrides, offload_state, roles,
                 reserves, prep)
    tick = progress or (lambda f: None)
    base_sim, base_t, _ = pl.evaluate({})
    options = _options(pl, strategy, budget, pl.peak(base_sim) <= budget, tick)
    tick(1.0)
    return _result(pl, strategy, budget, options, base_sim, base_t, t0)


def _options(pl: Planner, strategy: str, budget: int, base_fits: bool, tick
             ) -> list[tuple[float, int, dict[int, str], Sim]]:
    """The plans `strategy` weighs (module doc), each (predicted time, peak, decisions,
    simulation); `base_fits`: the unplanned step fits the budget."""
    options: list[tuple[float, int, dict[int, str], Sim]] = []

    def consider(dec: dict[int, str]) -> tuple[Sim, float]:
        sim, t, closed = pl.evaluate(dec)
        options.append((t, pl.peak(sim), closed, sim))
        return sim, t

    if strategy != "auto":
        consider(pl.baseline(strategy))
    elif base_fits:
        consider({})  # nothing to plan: keeping everything is the fastest step
    else:
        for s in ("none", "offload-all", "checkpoint-sqrt"):
            consider(pl.baseline(s))
        n = len(pl.cand)
        # where offload is not possible (unified memory): checkpoint plans on the cut
        # points, or (no cuts; a split step: also) every k-th retained value kept
        if pl.profile.unified and (not _chain_plans(pl, budget, consider) or pl.multi):
            for k in sorted({2, 3, 4, 8, max(1, math.ceil(math.sqrt(n)))}):
                if k < n:
                    consider(pl.segments(k))
        tick(0.3)
        ladder = pl.ladder()
        if pl.multi:
            shortest_prefixes(pl, ladder, budget, consider, tick)
        else:
            _shortest_prefix(pl, ladder, budget, consider, tick)
    return options


def _result(pl: Planner, strategy: str, budget: int,
            options: list[tuple[float, int, dict[int, str], Sim]], base_sim: Sim,
            base_t: float, t0: float) -> PlanResult:
    """The plan chosen among `options`: the fastest that fits (the fewest decisions, then
    the smallest peak, among equals), else the smallest peak (`t0`: when planning began)."""
    feasible = [o for o in options if o[1] <= budget]
    if feasible:
        t, peak, dec, sim = min(feasible, key=lambda o: (o[0], len(o[2]), o[1]))
    else:
        t, peak, dec, sim = min(options, key=lambda o: (o[1], o[0]))
    prep = pl.prep
    min_peak = min(o[1] for o in options)
    named = {prep.names[p]: d for p, d in sorted(dec.items())}
    counts = Counter(dec.values())
    opt_state = set(prep.opt_state)
    state_off = [p for p in dec if p in opt_state]
    counts[OFFLOAD] -= len(state_off)
    counts[KEEP] = len(pl.cand) - sum(1 for p in dec if p in pl.cand_set)
    by_type = _by_layer_type(pl, dec)
    res = PlanResult(
        prep.g.name, strategy, pl.profile, budget, bool(feasible), named, peak,
        pl.peak(base_sim), sim.host_bytes, t, base_t, sim.offload_bytes,
        pl.costs.recompute_flops(sim), sim.state_bytes, prep.workspace,
        time.perf_counter() - t0, pl.prefetch, {k: counts.get(k, 0) for k in DECISIONS}, by_type,
        min_peak, "", sim, base_sim, prep, len(state_off), len(prep.opt_state))
    if pl.multi:
        res.per_device = per_device(pl, dec, sim)
        peaks = pl.held_peaks(sim)
        res.worst_device = max(peaks, key=lambda d: (peaks[d], -d))
    if not feasible:
        best = min(options, key=lambda o: o[1])
        res.dominant = dominant(pl, best[3])
    return res


def _by_layer_type(pl: Planner, dec: dict[int, str]) -> dict[str, dict[str, int]]:
    """The decisions by layer type: every candidate's, and those of the forward values
    recomputed with them."""
    prep = pl.prep
    by_type: dict[str, dict[str, int]] = {}
    for p in pl.cand:
        lt = pl.ops[prep.ops[p]].layer_type
        d = dec.get(p, KEEP)
        by_type.setdefault(lt, {k: 0 for k in DECISIONS})[d] += 1
    for p, d in dec.items():
        if p not in pl.cand_set and prep.phase[p] == FWD:
            lt = pl.ops[prep.ops[p]].layer_type
            by_type.setdefault(lt, {k: 0 for k in DECISIONS})[d] += 1
    return by_type


@gc_paused()  # (searches and rewrites whole steps: netdsl.ir.bulk)
def plan_and_apply(step: Graph, mem: int | str, profile: Profile | str = "k40-12gb",
                   strategy: str = "auto", float_dtype: str = "f32", *,
                   roles: tuple[str, ...] = ROLES, arena: bool = False,
                   prefetch: int | None = None, progress=None, offload_state: bool = False,
                   verify: bool = True) -> tuple[Graph | None, PlanResult]:
    """Plan training step `step` into `mem` and check the plan against the truth: the
    decisions are applied (`strategies.apply_decisions`) and the storage plan of the
    rewritten step (`plan.make_plan`; with `arena`, the packed arena's size, which is what
    an arena run really holds) gives `verified_peak_bytes`. In unified memory a
    single-device run also holds its batch and the interpreter's objects
    (`plan.unplanned_bytes`, `outside_plan_bytes`): the search plans into the budget less
    those, and the check counts them. Were the check over the budget, the search runs
    again with the budget lowered by the excess; if no plan found that way fits, the
    smallest plan the search can make is checked too, and its checked peak is
    `min_feasible_bytes`, the smallest budget that works. Returns (the rewritten step, the
    result), or (None, the result) when no plan fits (`result.feasible` is False) or
    `verify` is off. Optimizer state the plan offloads is streamed from the host
    (`strategies.apply_decisions`, rule 5). A split step is planned and checked per
    device (`plan.device_peaks`; its values are not packed into arenas); run over MPI,
    each device is a process that holds its own inputs and objects besides its plan
    (`plan.process_reserves`): the search plans each device into the budget less its own,
    and the check counts each device's own. The check counts the rewritten step's
    (recomputed values add nodes, and so objects)."""
    from netdsl.memory.plan import process_reserves, unplanned_bytes
    budget = parse_size(mem, "--mem")
    profile = get_profile(profile)
    split = any(n.device is not None for n in step.nodes)
    reserves = process_reserves(step, float_dtype) if profile.unified and split else {}
    if split:  # (the search plans each device into the budget less its own reserve)
        outside = max(reserves.values(), default=0)
    else:
        outside = unplanned_bytes(step, float_dtype) if profile.unified else 0

    prep = prepare(step, roles, float_dtype=float_dtype)  # (every search's)

    def search(target: int) -> PlanResult:
        res = plan_memory(step, max(target, 1), profile, strategy, float_dtype,
                          prefetch=prefetch, progress=progress,
                          offload_state=offload_state, roles=roles, reserves=reserves,
                          prep=prep)
        return _judged(res, budget, outside, reserves)

    target = budget if split else budget - outside
    res = None
    for _ in range(4):
        res = search(target)
        if not verify:
            return None, res
        if not res.feasible:
            break
        g, peak = _check(step, res, roles, float_dtype, arena)
        if peak <= budget:
            return g, res
        # below the plan just found, by the excess: the same target could find it again
        target = min(target, res.planned_peak_bytes) - (peak - budget)
    # nothing found fits: the smallest plan the search makes, checked, is the smallest
    # budget that works (the search's own floor leaves out the arena's fragmentation). A
    # search that found nothing under its budget returned that plan already (the plans it
    # weighs below the budget do not depend on it: plan_memory, _chain_plans)
    floor = res if not res.feasible else search(0)
    g, peak = _check(step, floor, roles, float_dtype, arena)
    floor.min_feasible_bytes = peak
    if peak <= budget:
        floor.feasible, floor.dominant = True, ""
        return g, floor
    floor.feasible = False
    held = floor.per_device.get(floor.worst_device, {}).get("outside_plan_bytes")
    if held:  # (over MPI) what the device's process holds besides its plan
        floor.dominant += (f", and its process's inputs and interpreter objects "
                           f"{format_bytes(held)}")
    return None, floor


def _judged(res: PlanResult, budget: int, outside: int, reserves: dict[int, int]
            ) -> PlanResult:
    """A plan searched for within the budget less what a run holds besides it, judged
    against the whole budget with that counted (`outside`; per device, `reserves`)."""
    res.budget_bytes = budget
    res.outside_plan_bytes = outside
    for d, row in res.per_device.items():
        row["outside_plan_bytes"] = reserves.get(d, 0)
    res.feasible = res.feasible and (
        all(row["peak_bytes"] + row["outside_plan_bytes"] <= budget
            for row in res.per_device.values()) if res.per_device
        else res.planned_peak_bytes + outside <= budget)
    return res


def _check(step: Graph, res: PlanResult, roles: tuple[str, ...], float_dtype: str,
           arena: bool) -> tuple[Graph, int]:
    """The step rewritten by plan `res` and its peak as a run holds it (`plan_and_apply`;
    filled into `res`: its verified peaks and what a run holds besides the plan)."""
    from netdsl.memory.plan import device_peaks, make_plan, process_reserves, unplanned_bytes
    from netdsl.memory.strategies import apply_decisions
    t0 = time.perf_counter()
    g = apply_decisions(step, res.decisions, prefetch=res.prefetch)
    if res.per_device:  # a split step: every device within the budget
        mp = make_plan(g, roles, float_dtype, pack_arena=False)
        peaks = device_peaks(g, mp)
        own = process_reserves(g, float_dtype) if res.profile.unified else {}
        if res.profile.unified:  # the host pools count too (all of them: an upper bound)
            peaks = {d: v + mp.host_peak_bytes + own.get(d, 0) for d, v in peaks.items()}
        for d, v in peaks.items():
            row = res.per_device.setdefault(d, {})
            row["verified_peak_bytes"], row["outside_plan_bytes"] = v, own.get(d, 0)
        res.outside_plan_bytes = max(own.values(), default=0)
        peak = max(peaks.values())
    else:
        mp = res.storage = make_plan(g, roles, float_dtype, pack_arena=arena)
        if res.profile.unified:
            res.outside_plan_bytes = unplanned_bytes(g, float_dtype)
        peak = (mp.arena_peak_bytes if arena else mp.peak_bytes) + res.outside_plan_bytes
        if res.profile.unified:  # host and device are one memory: the pool counts too
            peak += mp.host_bytes if arena else mp.host_peak_bytes
    res.verified_peak_bytes = peak
    res.verify_s = time.perf_counter() - t0
    return g, peak


def infeasible_error(res: PlanResult, also: str = "") -> BudgetError:
    """The exit-3 error for a budget no plan meets: the smallest budget that works and
    what dominates it (then `also`, a sentence's end of the caller's)."""
    need = res.min_feasible_bytes
    if res.worst_device is not None:
        row = res.per_device.get(res.worst_device, {})
        return BudgetError(
            f"no memory plan fits {format_bytes(res.budget_bytes)} per device for "
            f"`{res.network}` (strategy {res.strategy}, profile {res.profile.name}): device "
            f"{res.worst_device} needs at least about {format_bytes(need)} ({need:,} "
            f"bytes) even with {row.get(RECOMPUTE, 0):,} values recomputed and "
            f"{row.get(OFFLOAD, 0):,} offloaded, dominated by "
            f"{res.dominant or 'the persistent state'}; give --mem at least that, more "
            "devices, a smaller --batch, more --microbatches, or another split" + also)
    return BudgetError(
        f"no memory plan fits {format_bytes(res.budget_bytes)} for `{res.network}` "
        f"(strategy {res.strategy}, profile {res.profile.name}): the smallest budget that "
        f"works is about {format_bytes(need)} ({need:,} bytes), dominated by "
        f"{res.dominant or 'the persistent state'}; give --mem at least that, a smaller "
        "--batch, more --microbatches (the gradients accumulated over parts of the batch), "
        "or another --strategy" + also)


def _shortest_prefix(pl: Planner, ladder, budget: int, consider, tick) -> None:
    """Consider the shortest prefix of the ladder whose peak fits `budget`: regula falsi
    on exact simulations (the Illinois variant: the peak is interpolated linearly in the
    bytes a prefix frees, and an end that stays twice has its weight halved), to a
    tolerance of 1/256 of the ladder (a slightly longer prefix still fits)."""
    def prefix(k: int) -> dict[int, str]:
        return dict(ladder[:k])

    cum = [0]
    for p, _ in ladder:
        cum.append(cum[-1] + pl.prep.full_bytes[p])
    lo, hi = 0, len(ladder)
    f_lo = pl.peak(consider(prefix(lo))[0]) - budget  # > 0: over budget
    f_hi = pl.peak(consider(prefix(hi))[0]) - budget  # <= 0: fits
    if f_hi > 0 or f_lo <= 0:
        return
    tol = max(1, len(ladder) // 256)
    kept = 0  # +1: hi stayed last time, -1: lo stayed
    while hi - lo > tol:
        w_lo, w_hi = f_lo, f_hi
        if kept == -2:
            w_lo /= 2
        elif kept == 2:
            w_hi /= 2
        if w_lo - w_hi > 0 and cum[hi] > cum[lo]:
            x = cum[lo] + (cum[hi] - cum[lo]) * w_lo / (w_lo - w_hi)
            mid = min(max(bisect_left(cum, x, lo, hi), lo + 1), hi - 1)
        else:
            mid = (lo + hi) // 2
        f = pl.peak(consider(prefix(mid))[0]) - budget
        if f <= 0:
            hi, f_hi = mid, f
            kept = kept - 1 if kept < 0 else -1  # lo stayed
        else:
            lo, f_lo = mid, f
            kept = kept + 1 if kept > 0 else 1  # hi stayed
        kept = max(-2, min(2, kept))
        tick(0.3 + 0.7 * (1 - (hi - lo) / max(1, len(ladder))))


def _chain_plans(pl: Planner, budget: int, consider) -> bool:
    """Consider checkpoint plans on the forward pass's cut points (`checkpoint.py`): the
    one with the fewest bytes the model allows (the floor, for the error when nothing
    fits), a few reference plans between the floor and three times its limit, and the
    fastest plan the model fits into the budget less the state, the workspace and the
    model's largest error on the references. All but the last do not depend on the
    budget, and the last only gains plans as the budget grows, so a larger budget never
    predicts a slower step. False when the forward pass has no cuts to plan on.

    A split step is planned so on each device's own forward pass (its cuts among its own
    nodes, its state and workspace, its peak), the devices' plans made together."""
    groups = {}  # device (None: the whole step) -> (units, grain, fixed bytes, floor, top)
    for d in (pl.devices if pl.multi else [None]):
        us = units(pl, cut_points(pl, d, anchors=pl.multi), d)
        if len(us) < 2:
            continue
        grain = grain_of(us)
        fixed = (pl.prep.state_bytes + pl.prep.workspace if d is None else
                 pl.prep.device_state.get(d, 0) + pl.prep.device_workspace.get(d, 0)
                 + pl.reserve.get(d, 0))
        # the smallest limit the model finds a plan for (none is below the largest unit):
        # doubling, then bisection (the dynamic program is quick at small limits)
        lo = max(u.held + u.temp for u in us) - 1
        hi = lo + 1
        while not chain_fits(us, hi, grain):
            lo, hi = hi, 2 * hi
        while hi - lo > max(grain, hi // 256):
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if chain_fits(us, mid, grain) else (mid, hi)
        # references from the floor to three times its limit (or keeping everything)
        top = min(3 * hi, sum(u.held for u in us) + max(u.temp for u in us))
        groups[d] = (us, grain, fixed, hi, top)
    if not groups:
        return False
    error = dict.fromkeys(groups, 0)
    for k in range(4):
        dec: dict[int, str] = {}
        plans = {}
        for d, (us, grain, _, hi, top) in groups.items():
            limit = int(hi * (top / hi) ** (k / 3)) if top > hi else hi
            plans[d] = chain_plan(us, limit, grain)
            dec.update(decisions_of(us, plans[d]))
        sim, _ = consider(dec)
        peaks = pl.held_peaks(sim) if pl.multi else {None: pl.peak(sim)}
        for d, (us, _, fixed, _, _) in groups.items():
            error[d] = max(error[d], peaks[d] - fixed - model_peak(us, plans[d]))
    dec = {}
    for d, (us, grain, fixed, _, _) in groups.items():
        plan = chain_plan(us, budget - fixed - error[d], grain)
        if plan is None:
            return True
        dec.update(decisions_of(us, plan))
    consider(dec)
    return True


# How many nodes ahead of its reader a `to_device` copy is issued when the caller does
# not say. Issuing earlier never makes the predicted step slower (the copy streams are
# FIFO), only holds the copy a few nodes longer; if no plan fits with it, prefetch 1 is
# tried too.
DEFAULT_PREFETCH = 8


def dominant(pl: Planner, sim: Sim) -> str:
    """What makes up the smallest peak found: state, workspace and the largest values
    (a split step's: on the device with the largest peak)."""
    prep = pl.prep
    if pl.multi:
        held, peaks = pl.held_peaks(sim), pl.device_peaks(sim)
        d = max(held, key=lambda k: (held[k], -k))
        streamed = {p for kind, p in sim.entries if kind == H2D and prep.phase[p] == STATE}
        hosted = sum(prep.full_bytes[p] for p in streamed if prep.device[p] == d)
        state = prep.device_state.get(d, 0) - hosted
        ws = prep.device_workspace.get(d, 0)
        return (f"on device {d}: persistent state {format_bytes(state)}, workspace "
                f"{format_bytes(ws)}, live values {format_bytes(peaks[d] - state - ws)}")
    g = prep.g
    parts: Counter = Counter()
    for k, name in enumerate(prep.names):
        n = g[name]
        if n.op == "param":
            parts["parameters"] += prep.full_bytes[k]
        elif n.op == "buffer":
            role = "optimizer state" if n.attrs.get("role") == "optimizer_state" \
                else "buffers"
            parts[role] += prep.full_bytes[k]
    total = pl.peak(sim)
    live = total - sim.state_bytes - prep.workspace
    hosted = prep.state_bytes - sim.state_bytes
    if hosted:
        parts["optimizer state"] -= hosted
    at = sim.entries[sim.peak_index][1] if sim.peak_index >= 0 else None
    bits = [f"{k} {format_bytes(v)}" for k, v in parts.most_common() if v]
    if hosted:
        bits.append(f"{format_bytes(hosted)} of optimizer state in the host pool")
    text = (f"persistent state {format_bytes(sim.state_bytes)} ({', '.join(bits)}), "
            f"workspace {format_bytes(prep.workspace)}, live values "
            f"{format_bytes(live)}")
    if at is not None:
        text += f" at %{prep.names[at]}"
    return text
