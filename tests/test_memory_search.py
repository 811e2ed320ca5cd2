"""The memory planner: the simulator's schedule, the strategies, and the search's
promises (the planned peak fits the budget; a larger budget never predicts a slower step)."""
import json

import pytest
from _examples import load
from _toy_graphs import toy

from netdsl.errors import NetdslError
from netdsl.memory.cost import Costs
from netdsl.memory.plan import make_plan
from netdsl.memory.profiles import PROFILES, ProfileError, calibrate, get_profile, save_profile
from netdsl.memory.search import STRATEGIES, PlanError, plan_memory
from netdsl.memory.simulate import (
    BWD,
    CLONE,
    D2H,
    H2D,
    NODE,
    OFFLOAD,
    RECOMPUTE,
    ROLES,
    STATE,
    prepare,
    simulate,
)
from netdsl.memory.strategies import apply_decisions
from netdsl.passes.autodiff import autodiff
from netdsl.passes.optimizer import add_optimizer

NETS = [("resnet20-cifar", 2), ("densenet121", 1), ("transformer-tiny", 2)]


def step_graph(g):
    return add_optimizer(autodiff(g), "sgd", lr=0.1, momentum=0.9)


_graphs = {}


def example_step(name, batch):
    if (name, batch) not in _graphs:
        _graphs[name, batch] = step_graph(load(f"{name}.net").lower(batch))
    return _graphs[name, batch]


def check_schedule(prep, sim, dec):
    """Every entry reads values that exist at that point, resolved as the semantics say:
    backward nodes and clones read clones of recomputed values and device copies of
    offloaded ones."""
    n = len(prep.names)
    made = set()
    for kind, p in sim.entries:
        state = prep.phase[p] == STATE  # optimizer state lives in the host pool
        if kind == D2H:
            assert ("dev", p) in made if state else p in made
            made.add(("host", p))
            continue
        if kind == H2D:
            assert state or ("host", p) in made
            made.add(("dev", p))
            continue
        resolve = kind == CLONE or prep.phase[p] == BWD
        for u in prep.inputs[p]:
            d = dec.get(u)
            if resolve and d == RECOMPUTE:
                assert ("clone", u) in made, f"{prep.names[p]} reads a clone not made"
            elif resolve and d == OFFLOAD:
                assert ("dev", u) in made
            else:
                assert u in made
        made.add(("clone", p) if kind == CLONE else p)
    assert len([e for e in sim.entries if e[0] == NODE]) == n


@pytest.mark.parametrize("name,batch", NETS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_simulator_is_make_plan_of_apply_decisions(name, batch, strategy):
    """The planner's fast simulator and the real rewrite + storage plan agree exactly:
    the schedule, the device timeline, the host pool, for every strategy's decisions."""
    g = example_step(name, batch)
    top = plan_memory(g, 10**12, "k40-12gb", "none").planned_peak_bytes
    low = plan_memory(g, 1, "k40-12gb").min_feasible_bytes
    r = plan_memory(g, (low + top) // 2, "k40-12gb", strategy)
    for prefetch in {1, r.prefetch}:
        rewritten = apply_decisions(g, r.decisions, prefetch=prefetch)
        mp = make_plan(rewritten, ROLES)
        dec = {r.prep.pos[k]: d for k, d in r.decisions.items()}
        sim = simulate(r.prep, dec, prefetch)
        assert len(sim.entries) == len(mp.order)
        kinds = {NODE: "", CLONE: ".recompute", D2H: ".offload", H2D: ".prefetch"}
        assert [r.prep.names[p] + kinds[k] for k, p in sim.entries] == mp.order
        assert sim.timeline == mp.timeline
        assert sim.peak_bytes == mp.peak_bytes
        assert sim.host_bytes == mp.host_peak_bytes
        assert sim.arena() == (mp.arena_bytes, mp.lower_bound_bytes)


def test_keep_matches_make_plan_without_eager_updates():
    for name, batch in NETS:
        g = example_step(name, batch)
        prep = prepare(g, eager_updates=False)
        sim = simulate(prep)
        mp = make_plan(g, ROLES)
        assert [prep.names[p] for _, p in sim.entries] == mp.order
        assert sim.timeline == mp.timeline
        assert sim.peak_bytes == mp.peak_bytes and prep.workspace == mp.workspace_bytes
        assert sim.arena() == (mp.arena_bytes, mp.lower_bound_bytes)


def test_eager_updates_free_gradients_at_once():
    g = example_step("resnet20-cifar", 2)
    eager, late = prepare(g), prepare(g, eager_updates=False)
    sim = simulate(eager)
    assert sim.peak_bytes < simulate(late).peak_bytes
    grads = {eager.pos[x] for x in g.outputs["grads"]}
    alive = [0] * (len(sim.entries) + 1)
    for vid, _, s, e in sim.lifetimes:
        if vid in grads:
            alive[s] += 1
            alive[e] -= 1
    most, cur = 0, 0
    for a in alive:
        cur += a
        most = max(most, cur)
    assert 1 <= most <= 3 < len(grads)  # a gradient dies at its update, right after it


def test_toy_bytes_by_hand():
    """Offloading the last block's ReLU output of a toy net frees exactly its bytes
    after its last forward reader; recomputing it (with the conv output under it, which
    its clone reads) too, and adds two clones."""
    g = step_graph(toy(3).bind(2))
    prep = prepare(g)
    v = prep.pos["stage.blk[2].relu"]
    conv = prep.pos["stage.blk[2].conv"]
    b = prep.bytes[v]
    keep = simulate(prep)
    # recomputing the ReLU alone would hold the conv output from the forward pass on
    alone = simulate(prep, {v: RECOMPUTE})
    assert alone.peak_bytes >= keep.peak_bytes
    for d in (OFFLOAD, RECOMPUTE):
        dec = {v: d} if d == OFFLOAD else {v: d, conv: d}
        sim = simulate(prep, dec, prefetch=1)
        check_schedule(prep, sim, dec)
        kinds = [k for k, p in sim.entries if p == v]
        if d == OFFLOAD:
            assert kinds == [NODE, D2H, H2D]
            assert sim.host_bytes == b and sim.offload_bytes == b
        else:
            assert kinds == [NODE, CLONE]
            assert sorted(sim.recomputed) == sorted([v, conv])
        # between the to_host (or last forward reader) and the copy back, v is not held
        i_flat = next(i for i, (k, p) in enumerate(sim.entries)
                      if k == NODE and prep.names[p] == "flat")
        j_flat = next(i for i, (k, p) in enumerate(keep.entries)
                      if k == NODE and prep.names[p] == "flat")
        i_fc = next(i for i, (k, p) in enumerate(sim.entries)
                    if k == NODE and prep.names[p] == "fc")
        j_fc = next(i for i, (k, p) in enumerate(keep.entries)
                    if k == NODE and prep.names[p] == "fc")
        assert keep.timeline[j_flat] == sim.timeline[i_flat]
        assert keep.timeline[j_fc] - sim.timeline[i_fc] == b


@pytest.mark.parametrize("name,batch", NETS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategies_schedule_and_budget(name, batch, strategy):
    g = example_step(name, batch)
    top = plan_memory(g, 10**12, "k40-12gb", "none").planned_peak_bytes
    low = plan_memory(g, 1, "k40-12gb").min_feasible_bytes
    assert low < top
    budget = (low + top) // 2
    r = plan_memory(g, budget, "k40-12gb", strategy)
    dec = {r.prep.pos[k]: d for k, d in r.decisions.items()}
    check_schedule(r.prep, simulate(r.prep, dec, r.prefetch), dec)
    if r.feasible:
        assert r.planned_peak_bytes <= budget
    else:
        assert r.min_feasible_bytes > budget and "persistent state" in r.dominant
    if strategy == "none":
        assert not r.decisions and r.predicted_overhead == 0
    if strategy == "auto":  # fits, and is no slower than any feasible baseline
        assert r.feasible
        for s in STRATEGIES[1:]:
            other = plan_memory(g, budget, "k40-12gb", s)
            if other.feasible:
                assert r.predicted_step_s <= other.predicted_step_s + 1e-12


@pytest.mark.parametrize("name,batch", NETS)
@pytest.mark.parametrize("profile", ["k40-12gb", "cpu"])
def test_larger_budget_never_slower(name, batch, profile):
    g = example_step(name, batch)
    top = plan_memory(g, 10**12, profile, "none").planned_peak_bytes
    low = plan_memory(g, 1, profile, "auto").min_feasible_bytes
    prev = None
    for k in range(13):
        budget = int(low + (top - low) * k / 12)
        r = plan_memory(g, budget, profile, "auto")
        assert r.feasible
        peak = r.sim.unified_peak if profile == "cpu" else r.planned_peak_bytes
        assert peak <= budget
        if profile == "cpu":
            assert r.counts["offload"] == 0  # offload saves nothing in unified memory
        if prev is not None:
            assert r.predicted_step_s <= prev + 1e-12
        prev = r.predicted_step_s
    assert prev == pytest.approx(Costs(r.prep, get_profile(profile)).base_time())


def test_impossible_budget_names_the_smallest():
    g = example_step("resnet20-cifar", 2)
    r = plan_memory(g, "1KB", "k40-12gb")
    assert not r.feasible
    assert r.min_feasible_bytes > 1000
    assert r.dominant.startswith("persistent state")
    again = plan_memory(g, r.min_feasible_bytes, "k40-12gb")
    assert again.feasible


def test_annotations_override_the_planner():
    net = load("resnet20-cifar.net")
    g = step_graph(net.lower(2))
    base = plan_memory(g, 1, "k40-12gb")  # as small as possible: most values planned
    planned = [k for k, d in base.decisions.items()
               if d != "keep" and g[k].attrs.get("role") != "optimizer_state"]
    assert planned
    name = planned[0]
    r = plan_memory(g, 1, "k40-12gb", overrides={name: "keep"})
    assert name not in r.decisions
    g2 = step_graph(net.lower(2))
    g2[name].annotations["keep"] = True
    assert name not in plan_memory(g2, 1, "k40-12gb").decisions
    free = plan_memory(g, 10**12, "k40-12gb", overrides={name: "offload"})
    assert free.decisions == {name: "offload"}
    with pytest.raises(PlanError, match="no value of that name"):
        plan_memory(g, 10**12, "k40-12gb", overrides={"nope": "keep"})
    with pytest.raises(PlanError, match="unknown memory decision"):
        plan_memory(g, 10**12, "k40-12gb", overrides={name: "drop"})
    with pytest.raises(PlanError, match="unknown strategy"):
        plan_memory(g, 10**12, "k40-12gb", "fast")


def test_profiles(tmp_path):
    assert get_profile("k40-12gb").capacity_bytes == 12 * 10**9
    assert get_profile("cpu").unified
    for p in PROFILES.values():
        assert p.source
    with pytest.raises(ProfileError, match="unknown device profile 'p100'"):
        get_profile("p100")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ProfileError, match="cannot read"):
        get_profile(str(bad))
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ProfileError, match="lacks capacity_bytes"):
        get_profile(str(bad))
    d = PROFILES["v100-16gb"].to_json()
    d["link_bw"] = -1
    bad.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="link_bw must be a positive"):
        get_profile(str(bad))
    p = calibrate(size=64, copy_mib=1, repeats=1)
    assert p.flops_per_s > 0 and p.mem_bw > 0 and p.unified
    save_profile(p, tmp_path / "me.json")
    assert get_profile(str(tmp_path / "me.json")) == p
    assert issubclass(ProfileError, NetdslError)


def test_exact_program_fits_and_bounds_auto():
    pytest.importorskip("scipy")
    from netdsl.memory.milp import exact_plan
    g = step_graph(load("resnet20-cifar.net").lower(8))
    budget = 14 * 10**6
    x = exact_plan(g, budget, "cpu")
    assert x.feasible and x.planned_peak_bytes <= budget
    assert set(x.decisions.values()) == {RECOMPUTE}  # unified memory: offload saves nothing
    auto = plan_memory(g, budget, "cpu")
    none = plan_memory(g, budget, "cpu", "none")
    assert not none.feasible
    # the program found a plan at least as good as the fitting baselines
    for s in ("checkpoint-sqrt", "recompute-all"):
        r = plan_memory(g, budget, "cpu", s)
        if r.feasible:
            assert x.predicted_step_s <= r.predicted_step_s + 1e-12
    assert auto.feasible and auto.predicted_step_s >= x.predicted_step_s * 0.8


def test_optimizer_state_offload_is_the_last_resort():
    """Below what activation decisions reach, momentum buffers move to the host pool:
    each is copied in before its update and out after it."""
    g = example_step("resnet20-cifar", 2)
    without = plan_memory(g, 1, "k40-12gb").min_feasible_bytes
    r = plan_memory(g, without - 1, "k40-12gb", offload_state=True)
    assert r.feasible and r.planned_peak_bytes < without
    assert 0 < r.state_offloaded <= r.state_buffers
    moved = [k for k, d in r.decisions.items() if g[k].attrs.get("role") == "optimizer_state"]
    assert len(moved) == r.state_offloaded and all(r.decisions[k] == OFFLOAD for k in moved)
    hosted = sum(g[k].type.nbytes() for k in moved)
    assert r.state_bytes == r.prep.state_bytes - hosted
    assert r.host_bytes >= hosted
    dec = {r.prep.pos[k]: d for k, d in r.decisions.items()}
    sim = simulate(r.prep, dec, r.prefetch)
    check_schedule(r.prep, sim, dec)
    for k in moved:  # in, update, out
        p = r.prep.pos[k]
        kinds = [e for e in sim.entries if e[1] == p or (e[0] == NODE and p in
                                                         r.prep.inputs[e[1]])]
        assert [e[0] for e in kinds] == [NODE, H2D, NODE, D2H]
    # a budget activation decisions reach comfortably needs no state offload
    top = plan_memory(g, 10**12, "k40-12gb", "none").planned_peak_bytes
    assert plan_memory(g, (without + top) // 2, "k40-12gb",
                       offload_state=True).state_offloaded == 0
