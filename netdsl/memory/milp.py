"""An exact optimum for small networks, to measure how far `auto` is from it.

`exact_plan(g, budget, profile)` solves a mixed-integer program with SciPy's HiGHS
(`scipy.optimize.milp`; SciPy is optional: a clear error without it). Per retained value
v two binaries r_v (recompute) and o_v (offload), r_v + o_v <= 1; no clone reads
another clone (r_u + r_v <= 1 where v's clone reads u: the domain `auto` searches too).
The objective is the sum of the cost model's per-value estimates (recompute: the clone's
time; offload: the part of the copies the prefetch window does not hide). Memory: at
every position t of the unplanned schedule, its bytes minus what the decisions free at t
must fit the budget; recompute frees v between its last forward and first backward
reader, offload until `prefetch` nodes before the latter; a clone's recomputed
intermediates are charged at its first reader. This is Checkmate's formulation reduced
to the decisions `apply_decisions` knows (Jain et al., MLSys 2020).

The program is exact for its linear model; the chosen decisions are then scored by the
same simulator and step-time model as every other plan. If the simulator's peak is over
the budget (the model does not see clones moving prefetches or extending their inputs'
lifetimes), the program is solved again with the budget lowered by the excess.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from netdsl.errors import NetdslError
from netdsl.ir.graph import Graph
from netdsl.memory.profiles import Profile, get_profile
from netdsl.memory.search import DEFAULT_PREFETCH, Planner
from netdsl.memory.simulate import FWD, OFFLOAD, RECOMPUTE, Sim, simulate
from netdsl.sizes import parse_size


@dataclass
class ExactResult:
    feasible: bool
    decisions: dict[str, str]
    planned_peak_bytes: int
    predicted_step_s: float
    baseline_step_s: float
    model_objective_s: float  # the program's own estimate of the added time
    solve_s: float
    rounds: int
    prefetch: int

    @property
    def predicted_overhead(self) -> float:
        return self.predicted_step_s / self.baseline_step_s - 1


def exact_plan(g: Graph, budget_bytes: int | str, profile: Profile | str = "k40-12gb",
               float_dtype: str = "f32", prefetch: int | None = None,
               time_limit_s: float = 60.0, rounds: int = 6) -> ExactResult:
    """The program (module docstring) for bound training step `g` within `budget_bytes`,
    solved at most `rounds` times, each within `time_limit_s`."""
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
    except ImportError:
        raise NetdslError("the exact planner needs SciPy (pip install scipy)") from None
    t0 = time.perf_counter()
    budget = parse_size(budget_bytes, "memory budget")
    profile = get_profile(profile)
    if prefetch is None:
        prefetch = 1 if profile.unified else DEFAULT_PREFETCH
    pl = Planner(g, profile, float_dtype, prefetch, None)
    prep = pl.prep
    cand = pl.cand
    nc = len(cand)
    col = {p: i for i, p in enumerate(cand)}
    base = simulate(prep, {}, pl.prefetch)
    keep_t = np.array(base.timeline, dtype=float)  # the unplanned schedule's entries
    a_mem = _memory_rows(pl, base, col, len(keep_t))
    a_one = _exclusions(pl, col)
    cost, upper = _objective(pl, col)
    target = float(budget)
    best = None
    done = 0
    while done < rounds:
        done += 1
        res = milp(cost, integrality=np.ones(2 * nc),
                   bounds=Bounds(np.zeros(2 * nc), upper),
                   constraints=[LinearConstraint(a_mem, -np.inf, target - keep_t),
                                LinearConstraint(a_one, -np.inf, 1.0)],
                   options={"time_limit": time_limit_s})
        if res.x is None:
            break
        x = np.round(res.x).astype(int)
        dec = {p: RECOMPUTE for p in cand if x[col[p]]}
        dec.update({p: OFFLOAD for p in cand if x[nc + col[p]]})
        sim, t, closed = pl.evaluate(dec)
        peak = pl.peak(sim)
        best = (peak <= budget, closed, peak, t, float(res.fun))
        if peak <= budget:
            break
        target -= peak - budget
    _, base_t, _ = pl.evaluate({})
    if best is None:
        return ExactResult(False, {}, 0, float("inf"), base_t, float("inf"),
                           time.perf_counter() - t0, done, pl.prefetch)
    ok, closed, peak, t, obj = best
    return ExactResult(ok, {prep.names[p]: d for p, d in sorted(closed.items())}, peak, t,
                       base_t, obj, time.perf_counter() - t0, done, pl.prefetch)


def _memory_rows(pl: Planner, base: Sim, col: dict[int, int], n_rows: int):
    """The bytes each decision frees (negative) or adds at each entry of the unplanned
    schedule `base` (module docstring): columns r_v then o_v, one row an entry."""
    from scipy.sparse import coo_matrix
    prep, nc = pl.prep, len(col)
    at = {p: i for i, (_, p) in enumerate(base.entries)}  # position -> entry index
    first_bwd = pl.first_bwd()
    last_fwd: dict[int, int] = {}
    for k, ins in enumerate(prep.inputs):
        if prep.phase[k] == FWD:
            for u in ins:
                last_fwd[u] = max(last_fwd.get(u, -1), at[k])
    rows, cols, vals = [], [], []
    for p in pl.cand:
        b = float(prep.bytes[p])
        lf, fb = last_fwd.get(p, at[p]), at[first_bwd[p]]
        for t in range(lf + 1, fb):
            rows.append(t)
            cols.append(col[p])
            vals.append(-b)
        for t in range(lf + 1, max(lf + 1, fb - pl.prefetch)):
            rows.append(t)
            cols.append(nc + col[p])
            vals.append(-b)
        inter = sum(prep.bytes[u] for u in pl.close({p: RECOMPUTE}) if u != p)
        if inter:
            rows.append(fb)
            cols.append(col[p])
            vals.append(float(inter))
    return coo_matrix((vals, (rows, cols)), shape=(n_rows, 2 * nc)).tocsr()


def _exclusions(pl: Planner, col: dict[int, int]):
    """The rows that sum to at most 1: r_v + o_v, and r_u + r_v where v's clone reads u
    (no clone reads a clone)."""
    from scipy.sparse import coo_matrix
    nc = len(col)
    pr, pc = [], []
    k = 0
    for p in pl.cand:
        pr += [k, k]
        pc += [col[p], nc + col[p]]
        k += 1
    for p in pl.cand:
        for u in pl.closure_inputs(p) & pl.cand_set:
            pr += [k, k]
            pc += [col[p], col[u]]
            k += 1
    return coo_matrix(([1.0] * len(pr), (pr, pc)), shape=(k, 2 * nc)).tocsr()


def _objective(pl: Planner, col: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(each decision's cost, its upper bound): the cost model's estimates, with the
    source's forced decisions taken whatever they cost and its kept values pinned."""
    cand, nc = pl.cand, len(col)
    rec_cost, off_cost = pl.estimates()
    cost = np.array([rec_cost[p] for p in cand]
                    + [off_cost.get(p, 0.0) for p in cand])
    upper = np.ones(2 * nc)
    if pl.profile.unified:
        upper[nc:] = 0  # offload saves nothing in unified memory
    for p, d in pl.forced.items():
        i = col[p]
        if d == RECOMPUTE:
            cost[i] -= 1e3  # forced: take it whatever it costs
        elif d == OFFLOAD:
            cost[nc + i] -= 1e3
        else:
            upper[i] = upper[nc + i] = 0
    return cost, upper
