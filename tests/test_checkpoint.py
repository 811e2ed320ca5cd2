"""Checkpoint plans on cut points (netdsl.memory.checkpoint): the cuts are exactly the
values the forward pass narrows to, the dynamic program is optimal under its model, and
its plans run bit for bit like the unplanned step, with the simulator equal to the
rewritten step's storage plan."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from _examples import example_feeds, load

from netdsl.memory.checkpoint import (
    KEPT,
    PART,
    RECOMPUTED,
    Unit,
    chain_plan,
    cut_points,
    decisions_of,
    grain_of,
    model_peak,
    units,
)
from netdsl.memory.plan import make_plan
from netdsl.memory.profiles import get_profile
from netdsl.memory.search import Planner, plan_memory
from netdsl.memory.simulate import CLONE, FWD, NODE, RECOMPUTE, ROLES, simulate
from netdsl.memory.strategies import apply_decisions
from netdsl.passes.autodiff import autodiff
from netdsl.passes.optimizer import add_optimizer
from netdsl.runtime.executor import Executor

NETS = [("resnet20-cifar", 2), ("densenet121", 1), ("transformer-tiny", 2)]
_graphs: dict = {}


def step(name, batch):
    if (name, batch) not in _graphs:
        _graphs[name, batch] = add_optimizer(autodiff(load(f"{name}.net").lower(batch)),
                                             "sgd", lr=0.05, momentum=0.9)
    return _graphs[name, batch]


def planner(g):
    return Planner(g, get_profile("cpu"), "f32", 1, None)


def floor_plan(pl):
    """The checkpoint plan with the fewest bytes the model allows."""
    us = units(pl, cut_points(pl))
    limit = max(u.held + u.temp for u in us)
    while (plan := chain_plan(us, limit, grain_of(us))) is None:
        limit = limit * 5 // 4
    return pl.close(decisions_of(us, plan))


def test_cuts_are_the_values_the_forward_pass_narrows_to():
    pl = planner(step("resnet20-cifar", 2))
    prep = pl.prep
    fwd = [k for k in range(len(prep.names)) if prep.phase[k] == FWD]
    readers = {k: [r for r in fwd if k in prep.inputs[r]] for k in fwd}
    # brute force: p is a cut iff no forward value made before it is read after it
    want = [p for p in pl.cand
            if not any(u < p and any(r > p for r in readers[u]) for u in fwd)]
    cuts = cut_points(pl)
    assert cuts == want
    names = {prep.names[c] for c in cuts}
    # a block's output (the ReLU after the residual add) is a cut; the ReLU inside the
    # block is not (the shortcut runs around it)
    blocks = [name.removesuffix(".relu_1") for name in prep.names
              if name.startswith("basic_stage") and name.endswith(".relu_1")]
    assert len(blocks) == 9
    assert all(f"{b}.relu_1" in names and f"{b}.relu" not in names for b in blocks)
    assert all(prep.pos[f"{b}.relu"] in pl.cand_set for b in blocks)


def plan_time(us, plan):
    t = 0.0
    for a, b, mode in plan:
        if mode == RECOMPUTED:
            t += sum(u.time for u in us[a:b + 1]) - us[b].cut_time
        elif mode == PART:
            t += us[a].part_time
    return t


def model_fits(us, plan, limit):
    return model_peak(us, plan) <= limit


def all_plans(us):
    """Every split of the units into segments: recomputed, or one unit kept or part-kept."""
    m = len(us)
    for cuts in itertools.product((False, True), repeat=m - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [m]
        segs = list(zip(bounds, bounds[1:]))
        options = [[RECOMPUTED] if b - a > 1 else
                   [RECOMPUTED, KEPT] + ([PART] if us[a].cheap else []) for a, b in segs]
        for modes in itertools.product(*options):
            yield [(a, b - 1, mode) for (a, b), mode in zip(segs, modes)]


def test_the_dynamic_program_is_optimal_under_its_model():
    rnd = random.Random(4)
    for _ in range(80):
        m = rnd.randint(1, 6)
        us = []
        for i in range(m):
            held = rnd.randint(2, 12)
            cut = rnd.randint(1, held)
            t = rnd.uniform(1, 5)
            u = Unit([i], i, held, cut, t, rnd.uniform(0, t / 2), rnd.randint(0, 4))
            if rnd.random() < 0.5:
                u.cheap, u.part_bytes, u.part_time = [i], rnd.randint(cut, held), rnd.uniform(0, t)
            us.append(u)
        limit = rnd.randint(5, 40)
        plans = [p for p in all_plans(us) if model_fits(us, p, limit)]
        got = chain_plan(us, limit, 1)  # counted in bytes: no rounding
        if not plans:
            assert got is None
            continue
        assert got is not None and model_fits(us, got, limit)
        assert plan_time(us, got) == pytest.approx(min(plan_time(us, p) for p in plans))


@pytest.mark.parametrize("name,batch", NETS)
def test_checkpoint_plans_simulate_as_they_run(name, batch):
    """The simulator equals the storage plan of the rewritten step, and the executor's
    count equals that plan, for the floor plan (clones reading clones)."""
    g = step(name, batch)
    pl = planner(g)
    dec = floor_plan(pl)
    names = {pl.prep.names[p]: d for p, d in dec.items()}
    h = apply_decisions(g, names)
    mp = make_plan(h, ROLES)
    sim = simulate(pl.prep, dec, 1)
    kinds = {NODE: "", CLONE: ".recompute"}
    assert [pl.prep.names[p] + kinds[k] for k, p in sim.entries] == mp.order
    assert sim.timeline == mp.timeline
    assert sim.arena() == (mp.arena_bytes, mp.lower_bound_bytes)


@pytest.mark.parametrize("name,batch", [("resnet20-cifar", 2), ("transformer-tiny", 2)])
def test_checkpoint_plans_match_the_unplanned_step_bit_for_bit(name, batch):
    g = step(name, batch)
    pl = planner(g)
    names = {pl.prep.names[p]: d for p, d in floor_plan(pl).items()}
    assert set(names.values()) == {RECOMPUTE}
    h = apply_decisions(g, names)
    feeds = example_feeds(g)
    outs = []
    for graph in (g, h):
        ex = Executor(graph, "numpy", dtype="f64", seed=7)
        losses = [ex.run(feeds, roles=("loss", "grads", "updates")) for _ in range(2)]
        outs.append(([np.array(v) for r in losses for k in ("loss", "grads") for v in r[k]],
                     ex.state_dict()))
    (ref, ref_state), (got, got_state) = outs
    for a, b in zip(ref, got, strict=True):
        np.testing.assert_array_equal(a, b)
    for k in ref_state:
        np.testing.assert_array_equal(ref_state[k], got_state[k], err_msg=k)


def test_auto_reaches_below_the_old_segment_floor():
    """On ResNet-20 in unified memory the smallest plan auto finds is below every
    keep-every-k-th-retained-value plan (which keep values the residual stream runs
    around), and it fits a budget between the two."""
    g = step("resnet20-cifar", 8)
    pl = planner(g)
    n = len(pl.cand)
    old = min(pl.peak(pl.evaluate(pl.segments(k))[0]) for k in range(2, n))
    new = plan_memory(g, 1, "cpu").min_feasible_bytes
    assert new < old
    r = plan_memory(g, (new + old) // 2, "cpu")
    assert r.feasible and r.sim.unified_peak <= (new + old) // 2
