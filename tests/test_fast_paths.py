"""The compile path's fast implementations against their references: the checkpoint
planner's dynamic program (`chain_plan`, `chain_fits`) against the one that offers each
segment on its own, and the simulator's array passes against the loop per schedule entry
(tests/_reference_simulate.py), on one-device and split steps, for random decisions."""
from __future__ import annotations

import random

import numpy as np
import pytest
from _examples import load
from _reference_simulate import simulate as reference_simulate

from netdsl.config import TrainConfig
from netdsl.memory.checkpoint import KEPT, PART, RECOMPUTED, Unit, chain_fits, chain_plan
from netdsl.memory.simulate import OFFLOAD, RECOMPUTE, prepare, simulate
from netdsl.parallel.predict import _roles
from netdsl.parallel.split import SplitSpec, split_step
from netdsl.step.graphs import training_graph


# -- the checkpoint planner's dynamic program -----------------------------------------------
def reference_chain_plan(us, limit, grain):
    """`chain_plan` as first written: every segment offered to its row on its own."""
    def up(b):
        return -(-b // grain)

    def relax(best, came, modes, i, k, row, reach, top, shift, cost, mode):
        n = min(top + 1, reach, best.shape[1] - shift)
        if n <= 0:
            return
        cand = row[:n] + cost
        tgt = best[k, shift:shift + n]
        better = cand < tgt
        tgt[better] = cand[better]
        came[k, shift:shift + n][better] = i
        modes[k, shift:shift + n][better] = mode

    m = len(us)
    if not m or limit <= 0:
        return None
    q = limit // grain
    best = np.full((m + 1, q + 1), np.inf)
    best[0, 0] = 0.0
    came = np.full((m + 1, q + 1), -1, dtype=np.int32)
    modes = np.zeros((m + 1, q + 1), dtype=np.int8)
    for i in range(m):
        row = best[i]
        finite = np.flatnonzero(np.isfinite(row))
        if not len(finite):
            return None
        reach = finite[-1] + 1
        u = us[i]
        top = (limit - u.held - u.temp) // grain
        relax(best, came, modes, i, i + 1, row, reach, top, up(u.held), 0.0, KEPT)
        if u.cheap:
            relax(best, came, modes, i, i + 1, row, reach, top, up(u.part_bytes), u.part_time,
                  PART)
        held = temp = 0
        rt = 0.0
        for j in range(i, m):
            held += us[j].held
            temp = max(temp, us[j].temp)
            rt += us[j].time
            top = (limit - held - temp) // grain
            if top < 0:
                break
            relax(best, came, modes, i, j + 1, row, reach, top, up(us[j].cut_bytes),
                  rt - us[j].cut_time, RECOMPUTED)
    if not np.isfinite(best[m]).any():
        return None
    s = int(np.argmin(best[m]))
    plan, k = [], m
    while k:
        i, mode = int(came[k, s]), int(modes[k, s])
        u = us[k - 1]
        s -= up(u.held if mode == KEPT else u.part_bytes if mode == PART else u.cut_bytes)
        plan.append((i, k - 1, mode))
        k = i
    return plan[::-1]


def random_units(rng: random.Random, m: int, whole_times: bool) -> list[Unit]:
    """Units like a network's: a few kinds repeated (whole-number times make ties, which
    the two must break alike), some part-keepable."""
    kinds = []
    for _ in range(3):
        held = rng.randint(10, 400) * 1000
        cut = rng.randint(1, held // 1000) * 1000
        t = float(rng.randint(1, 9)) if whole_times else rng.uniform(0.1, 9.0)
        cut_t = float(rng.randint(0, int(t))) if whole_times else rng.uniform(0, t)
        u = Unit([0], 0, held, cut, t, cut_t, rng.randint(1, 3) * held // 3)
        if rng.random() < 0.5:
            u.cheap, u.part_bytes = [0], rng.randint(cut // 1000, held // 1000) * 1000
            u.part_time = float(rng.randint(0, 4)) if whole_times else rng.uniform(0, 4)
        kinds.append(u)
    return [kinds[rng.randrange(3)] if rng.random() < 0.8 else kinds[0] for _ in range(m)]


@pytest.mark.parametrize("seed", range(12))
def test_chain_plan_is_the_reference_dynamic_program(seed):
    rng = random.Random(seed)
    us = random_units(rng, rng.randint(1, 60), whole_times=seed % 2 == 0)
    total = sum(u.held for u in us)
    grain = max(1, total // rng.choice([64, 512, 8192]))
    found = 0
    for limit in sorted({rng.randint(0, 2 * total) for _ in range(12)} | {total // 7}):
        want = reference_chain_plan(us, limit, grain)
        assert chain_plan(us, limit, grain) == want, limit
        assert chain_fits(us, limit, grain) is (want is not None), limit
        found += want is not None
    assert found  # (some limits have plans, so the plans themselves were compared)


# -- the simulator ----------------------------------------------------------------------------
def random_decisions(prep, rng: random.Random, state: bool) -> dict[int, str]:
    dec = {}
    for p in prep.candidates:
        r = rng.random()
        if r < 0.3 and p not in prep.fixed:
            dec[p] = RECOMPUTE
        elif r < 0.5:
            dec[p] = OFFLOAD
    if state:  # optimizer state streamed through its update
        dec.update((p, OFFLOAD) for p in prep.opt_state if rng.random() < 0.5)
    return dec


def same_simulation(a, b) -> None:
    assert a.entries == b.entries
    assert a.timeline == b.timeline and a.host_timeline == b.host_timeline
    assert a.lifetimes == b.lifetimes and a.waits == b.waits
    assert (a.peak_bytes, a.peak_index, a.host_bytes, a.state_bytes, a.offload_bytes) == \
        (b.peak_bytes, b.peak_index, b.host_bytes, b.state_bytes, b.offload_bytes)
    assert sorted(a.recomputed) == sorted(b.recomputed)
    assert a.device_peaks == b.device_peaks
    assert a.device_unified_peaks == b.device_unified_peaks


ONE_DEVICE = [("resnet20-cifar", 2), ("transformer-tiny", 2), ("densenet121", 1)]


@pytest.mark.parametrize("name,batch", ONE_DEVICE)
def test_simulator_is_the_reference_on_one_device(name, batch):
    net = load(f"{name}.net")
    g = training_graph(net.lower(batch), net.train or TrainConfig())
    rng = random.Random(7)
    for eager in (True, False):
        prep = prepare(g, eager_updates=eager)
        for k in range(3):
            dec = {} if k == 0 else random_decisions(prep, rng, state=k == 2)
            for prefetch in (1, 4):
                same_simulation(simulate(prep, dec, prefetch),
                                reference_simulate(prep, dec, prefetch))


@pytest.mark.parametrize("spec", [SplitSpec(data=2), SplitSpec(pipeline=2, microbatches=4),
                                  SplitSpec(tensor=2)], ids=["data", "pipeline", "tensor"])
def test_simulator_is_the_reference_on_a_split_step(spec):
    net = load("resnet20-cifar.net")
    g = split_step(net.graph, 8, spec, (net.train or TrainConfig()).optimizer.model_dump())
    prep = prepare(g, _roles(g))
    rng = random.Random(3)
    for k in range(3):
        dec = {} if k == 0 else random_decisions(prep, rng, state=k == 2)
        same_simulation(simulate(prep, dec, 3), reference_simulate(prep, dec, 3))


# -- the choice of a split: candidates not built ---------------------------------------------
def _choice_figures(chosen):
    best = chosen.best
    return (best.spec, best.report.to_json(), best.fits,
            None if best.memory is None else best.memory.decisions)


@pytest.mark.parametrize("name,batch,profile,mem", [
    ("digits-cnn", 32, "cpu", None), ("digits-cnn", 32, "k40-12gb", 1_300_000),
    pytest.param("resnet20-cifar", 8, "k40-12gb", None, marks=pytest.mark.slow)])
def test_auto_without_outclassed_candidates_chooses_as_with_them(monkeypatch, name, batch,
                                                                profile, mem):
    """Where an exact split fits, auto builds no big inexact one (candidates.outclassed): its
    choice and the chosen step's figures are those of building every candidate the rounds
    reach (with `mem`, planning those that do not fit), and what it left out is inexact
    and listed as skipped."""
    from netdsl.memory.profiles import get_profile
    from netdsl.parallel import candidates as cand
    from netdsl.parallel import choose as choose_mod
    from netdsl.parallel.choose import choose
    from netdsl.parallel.predict import get_interconnect
    net = load(f"{name}.net")
    kw = dict(batch=batch, strategy="auto", devices=4, mem=mem, plan=mem is not None,
              optimizer=(net.train or TrainConfig()).optimizer.model_dump(),
              profile=get_profile(profile), link=get_interconnect("shm"), jobs=1)
    monkeypatch.setattr(choose_mod, "OUTCLASSED_MIN_WORK", 0)  # (small networks too)
    fast = choose(net.graph, **kw)
    monkeypatch.setattr(cand, "outclassed", lambda *a: False)
    whole = choose(net.graph, **kw)
    assert _choice_figures(fast) == _choice_figures(whole)
    assert fast.best.exact
    left_out = {c.spec for c in whole.considered} - {c.spec for c in fast.considered}
    assert left_out and left_out <= set(fast.skipped)
    assert not any(c.exact for c in whole.considered if c.spec in left_out)


@pytest.mark.parametrize("mem,planned_exact", [(1_100_000, True), (1_000_000, False)],
                         ids=["exact-fits-planned", "no-exact-fits"])
def test_auto_plans_the_exact_splits_before_building_inexact_ones(monkeypatch, mem,
                                                                 planned_exact):
    """Under --mem the exact candidates are built and planned before any big inexact one:
    where an exact split fits only once planned (1.1 MB a device), the inexact ones are
    left out and listed as skipped; where none does (1.0 MB), they are built and planned
    after, and every candidate's figures are those of building all of them at once. The
    choice is the same either way, and no candidate is planned twice."""
    from netdsl.memory.profiles import get_profile
    from netdsl.parallel import candidates as cand
    from netdsl.parallel import choose as choose_mod
    from netdsl.parallel.choose import choose
    from netdsl.parallel.predict import get_interconnect
    net = load("digits-cnn.net")
    kw = dict(batch=32, strategy="auto", devices=4, mem=mem, plan=True,
              optimizer=(net.train or TrainConfig()).optimizer.model_dump(),
              profile=get_profile("k40-12gb"), link=get_interconnect("shm"), jobs=1)
    monkeypatch.setattr(choose_mod, "OUTCLASSED_MIN_WORK", 0)  # (small networks too)
    plans, real_plan = [], choose_mod._plan
    monkeypatch.setattr(choose_mod, "_plan",
                        lambda g, *a, **k: plans.append(g.meta["split"]) or real_plan(g, *a, **k))
    fast = choose(net.graph, **kw)
    fast_plans = list(plans)
    monkeypatch.setattr(cand, "outclassed", lambda *a: False)
    whole = choose(net.graph, **kw)
    assert _choice_figures(fast) == _choice_figures(whole)
    assert fast.best.exact == planned_exact and fast.best.memory is not None
    assert len(fast_plans) == sum(c.memory is not None for c in fast.considered)
    figures = {c.spec: (c.report.to_json(), c.fits) for c in whole.considered}
    assert all(figures[c.spec] == (c.report.to_json(), c.fits) for c in fast.considered)
    left_out = set(figures) - {c.spec for c in fast.considered}
    if planned_exact:
        assert left_out and left_out <= set(fast.skipped)
        assert not any(c.exact for c in whole.considered if c.spec in left_out)
    else:
        assert not left_out and fast.skipped == whole.skipped


# -- rewrites that index the graph once -------------------------------------------------------
def test_joining_attention_gradients_indexes_the_step_a_few_times(monkeypatch):
    """fuse_grads joins each micro-batch's attention backward nodes into one
    attention_qkv_grad; the rebuilt step keeps its name index as nodes are added, rather
    than indexing the whole step again for every node it makes (which grew with layers
    times micro-batches, squared)."""
    from netdsl.ir.graph import Graph
    from netdsl.parallel import split as split_mod
    net = load("gpt-tiny.net")
    rebuilt, fusing = [0], [False]
    idx = Graph._idx

    def counted(g):
        rebuilt[0] += fusing[0] and g._index is None
        return idx(g)

    def fuse_grads(g, **kw):
        fusing[0] = True
        try:
            return real(g, **kw)
        finally:
            fusing[0] = False

    real = split_mod.fuse_grads
    monkeypatch.setattr(Graph, "_idx", counted)
    monkeypatch.setattr(split_mod, "fuse_grads", fuse_grads)
    g = split_step(net.graph, 16, SplitSpec(pipeline=2, microbatches=8),
                   net.train.optimizer.model_dump())
    joined = g.by_op("attention_qkv_grad")
    assert len(joined) == 2 * 8  # (two layers, eight micro-batches)
    assert 0 < rebuilt[0] < 8


def test_auto_rechecks_the_shapes_of_the_chosen_step_alone(monkeypatch):
    """A candidate's final verify leaves out the shape rules (most of a verify's time);
    the step auto chooses is verified wholly, once."""
    from netdsl.ir.graph import Graph
    from netdsl.memory.profiles import get_profile
    from netdsl.parallel.choose import choose
    from netdsl.parallel.predict import get_interconnect
    net = load("digits-cnn.net")
    seen = []
    verify = Graph.verify

    def recorded(g, *, recheck_shapes=True):
        seen.append((g, recheck_shapes))
        return verify(g, recheck_shapes=recheck_shapes)

    monkeypatch.setattr(Graph, "verify", recorded)
    chosen = choose(net.graph, 32, "auto", 4, net.train.optimizer.model_dump(),
                    get_profile("cpu"), get_interconnect("shm"), jobs=1)
    split = [(g, full) for g, full in seen if g.meta.get("split", {}).get("devices", 1) > 1]
    assert len({id(g) for g, _ in split}) >= len(chosen.considered) > 1
    assert [g for g, full in split if full] == [chosen.best.graph]
