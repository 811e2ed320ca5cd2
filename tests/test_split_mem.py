"""Memory planning of a split training step (`netdsl split --mem`, `run --devices --mem`):
the simulator's per-device bytes against the storage plan's rule, the equivalence gate on
planned data, pipeline and tensor splits with every device forced to recompute or offload,
the executor's per-device count (and tracemalloc) against the plan, impossible budgets
(exit 3 naming the device), auto choosing a candidate that fits only when planned, and
the commands' --json."""
from __future__ import annotations

import json
import pickle
import random
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from netdsl import api
from netdsl.config import TrainConfig
from netdsl.memory.plan import device_peaks, make_plan
from netdsl.memory.profiles import get_profile
from netdsl.memory.simulate import OFFLOAD, RECOMPUTE, prepare, simulate
from netdsl.memory.strategies import apply_decisions
from netdsl.parallel.memplan import plan_split
from netdsl.parallel.predict import _roles
from netdsl.parallel.split import SplitSpec, split_step
from netdsl.runtime.data import Loader, make_dataset
from netdsl.runtime.executor import Executor
from netdsl.runtime.gate import verify_split
from netdsl_cli.app import app

ROOT = Path(__file__).resolve().parent.parent
RESNET = ROOT / "examples" / "resnet20-cifar.net"
BATCH = 8
runner = CliRunner()

SPECS = {"data2": SplitSpec(data=2),
         "pipeline2": SplitSpec(pipeline=2, microbatches=4),
         "tensor2": SplitSpec(tensor=2),
         "hybrid4": SplitSpec(data=2, pipeline=2, microbatches=2, bn="local"),
         "spatial2": SplitSpec(spatial=2)}
# the budget, as a share of the largest unplanned device peak: the last stages of a
# hybrid with two micro-batches cannot go much lower
SHARE = {"hybrid4": 0.92}


@pytest.fixture(scope="module")
def resnet():
    net = api.load(RESNET)
    cfg = net.train or TrainConfig()
    data = make_dataset(net.graph, cfg.data, 0)
    feeds = dict(zip(data.input_names, Loader(data.train, BATCH, 0).next(), strict=True))
    return net, cfg.optimizer.model_dump(), feeds


def unplanned_peaks(g, dtype="f32") -> dict[int, int]:
    return device_peaks(g, make_plan(g, _roles(g), dtype, pack_arena=False))


@pytest.mark.parametrize("spec", ["data2", "pipeline2", "tensor2", "spatial2"])
def test_simulated_device_peaks_are_the_storage_plans(resnet, spec):
    """For random decisions, the simulator's per-device peaks equal `device_peaks` of the
    storage plan of the rewritten split step, byte for byte."""
    net, opt, _ = resnet
    g = split_step(net.graph, BATCH, SPECS[spec], opt)
    prep = prepare(g, _roles(g))
    rng = random.Random(1)
    for _ in range(3):
        dec = {}
        for p in prep.candidates:
            r = rng.random()
            if r < 0.3 and p not in prep.fixed:
                dec[p] = RECOMPUTE
            elif r < 0.6:
                dec[p] = OFFLOAD
        sim = simulate(prep, dec, prefetch=3)
        g2 = apply_decisions(g, {prep.names[p]: d for p, d in dec.items()}, prefetch=3)
        assert sim.device_peaks == unplanned_peaks(g2)


def test_communication_is_never_recomputed(resnet):
    net, opt, _ = resnet
    g = split_step(net.graph, BATCH, SPECS["pipeline2"], opt)
    recv = next(n.name for n in g.nodes if n.op == "recv" and n.meta.get("phase") is None)
    with pytest.raises(Exception, match="communication between devices"):
        apply_decisions(g, {recv: "recompute"})


@pytest.mark.parametrize("profile", ["k40-12gb", "cpu"])
@pytest.mark.parametrize("spec", sorted(SPECS))
def test_planned_split_step_equals_single_device_step(resnet, spec, profile):
    """Every device planned into 85% of the largest unplanned device peak (each device
    over it must recompute - `cpu`, where host and device are one memory - or offload;
    hybrid4: 92%, which only its last stages are over): the loss,
    every gradient and updated value equal the single-device step's to 1e-9 (float64),
    and the executor's per-device count and tracemalloc stay within the plan."""
    plan_and_gate(resnet, spec, profile, SHARE.get(spec, 0.85))


PREACT = """import resnet

network preact {
    input x: f32[N, 3, 16, 16]
    input y: i64[N]

    h = conv2d(x, 8, kernel=3, padding=1, bias=false)
    h = resnet.preact_stage(h, width=4, blocks=4)
    h = resnet.preact_stage(h, width=8, blocks=4, stride=2)
    logits = resnet.head(relu(batchnorm(h)), 10)

    output logits
    loss softmax_cross_entropy(logits, y)
}
"""


def test_synchronised_batchnorm_plans_into_55_percent():
    """A data split's synchronised batchnorm (sync_batchnorm over the combined statistics,
    its relu folded in) reads its input in the backward, as batchnorm does, so a
    pre-activation ResNet's block inputs are cut points of the checkpoint plans: 55% of
    the unplanned peak fits, and the planned step is still the single-device step. (The
    rewrite it replaced kept only x - mean, and the plans needed `anchors` to cut there.)"""
    net = api.loads(PREACT, file=str(ROOT / "tests" / "nets" / "preact.net"))
    opt = {"kind": "sgd", "lr": 0.1, "momentum": 0.9}
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((BATCH, 3, 16, 16)), "y": rng.integers(0, 10, BATCH)}
    g = split_step(net.graph, BATCH, SplitSpec(data=2), opt)
    assert g.by_op("sync_batchnorm") and g.by_op("bn_moments") and g.by_op("all_gather")
    assert not g.by_op("batchnorm") and not g.by_op("batchnorm_relu")
    budget = int(0.55 * max(unplanned_peaks(g, "f64").values()))
    planned, res = plan_split(g, budget, get_profile("cpu"), "f64")
    assert planned is not None
    assert max(unplanned_peaks(planned, "f64").values()) <= budget
    assert any(d == "recompute" for d in res.decisions.values())
    r = verify_split(net.graph, BATCH, SplitSpec(data=2), opt, feeds, split=planned)
    assert r.ok and max(r.loss_rel, r.grad_rel, r.state_rel) <= 1e-9, r.worst


def plan_and_gate(resnet, spec: str, profile: str, share: float):
    net, opt, feeds = resnet
    g = split_step(net.graph, BATCH, SPECS[spec], opt)
    before = unplanned_peaks(g, "f64")
    budget = int(share * max(before.values()))
    planned, res = plan_split(g, budget, get_profile(profile), "f64")
    assert planned is not None and res.feasible
    for d, row in res.per_device.items():
        if before[d] > budget:  # a device over the budget had to give something up
            assert row[RECOMPUTE] + row[OFFLOAD] > 0
            assert row["recompute_bytes"] + row["offload_bytes"] > 0
        if profile == "cpu":
            assert row[OFFLOAD] == 0
    plan_peaks = unplanned_peaks(planned, "f64")
    assert max(plan_peaks.values()) <= budget
    assert plan_peaks == {d: r["peak_bytes"] for d, r in res.per_device.items()}

    r = verify_split(net.graph, BATCH, SPECS[spec], opt, feeds, split=planned)
    assert r.ok, (r.worst, r.loss_rel, r.grad_rel, r.state_rel, r.first_divergence)
    assert max(r.loss_rel, r.grad_rel, r.state_rel) <= 1e-9

    ex = Executor(planned, "numpy", "f64", 0, budget_bytes=budget)
    state = sum(int(v.nbytes) for v in ex.state.values())
    tracemalloc.start()
    tracemalloc.reset_peak()
    ex.run(dict(feeds), training=True, roles=_roles(planned), step=0)
    _, measured = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert ex.peak_by_device == plan_peaks  # counted value by value, checked per kernel
    # measured by NumPy's allocations (every device and host pool is this process):
    # within the devices' plans and the host pool's count
    assert state + measured <= sum(plan_peaks.values()) + ex.host_peak_bytes
    return planned, res


def test_impossible_budget_exits_3_naming_the_device(tmp_path):
    r = runner.invoke(app, ["split", str(RESNET), "--devices", "2", "--batch", "8",
                            "--strategy", "data", "--mem", "3MB"])
    assert r.exit_code == 3, r.output
    assert "even with memory planning" in r.output and "on device" in r.output
    r = runner.invoke(app, ["run", str(RESNET), "--devices", "2", "--split", "pipeline",
                            "--batch", "8", "--steps", "1", "--mem", "2MB"])
    assert r.exit_code == 3, r.output
    assert "on device" in r.output


def test_mpi_plans_the_messages_mpi_holds():
    """`split --mpi` predicts and plans as `run --distributed` runs the split: a pipeline's
    first stage holds each micro-batch's activations it sent until the gradients come
    back (MPI keeps a message until the peer has it), and each device is a process that
    holds its inputs and interpreter objects besides its plan, so 520 kB, which the
    in-process pipeline meets (423,692 and 504,508 B), is refused naming the least over
    MPI, the figure `mpiexec -n 2 netdsl run --distributed --mem 520KB` refuses with; at
    that budget device 0 is planned as small as it can be."""
    args = ["split", str(ROOT / "examples" / "digits-cnn.net"), "--devices", "2",
            "--strategy", "pipeline", "--profile", "cpu", "--mem", "520KB", "--json"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["mpi"] is False
    assert [d["peak_bytes"] for d in out["per_device"]] == [423_692, 504_508]
    r = runner.invoke(app, args + ["--mpi"])
    assert r.exit_code == 3, r.output
    msg = json.loads(r.output)["errors"][0]["message"]
    assert "needs at least 801.39 kB (801,392 bytes) on device 0" in msg, msg
    assert "its process's inputs and interpreter objects 201.09 kB" in msg, msg
    out = json.loads(runner.invoke(app, args[:-2] + ["801392", "--json", "--mpi"]).output)
    assert out["mpi"] is True
    dev0 = out["memory_plan"]["per_device"]["0"]
    assert dev0["peak_bytes"] == 600_300  # (its sends held)
    assert dev0["verified_peak_bytes"] == 600_300 + dev0["outside_plan_bytes"] == 801_392


def test_auto_takes_a_split_that_fits_only_when_planned(resnet):
    net, _, _ = resnet
    plain = api.split(net, 2, "auto", batch=BATCH, mem="1TB", microbatches=1).to_json()
    smallest = min(a["max_peak_bytes"] for a in plain["alternatives"])
    budget = int(0.85 * smallest)  # no candidate fits unplanned
    out = api.split(net, 2, "auto", batch=BATCH, mem=budget, microbatches=1).to_json()
    assert len(out["alternatives"]) == len(plain["alternatives"])  # every scheme considered
    assert out["memory_plan"] is not None and out["memory_plan"]["feasible"]
    assert all(d["peak_bytes"] <= budget for d in out["per_device"])
    assert any(a["planned"] for a in out["alternatives"])
    assert all(a["planned"] for a in out["alternatives"] if a["fits"])


def _choose_on_ranks(fwd, size: int, **kw):
    """choose() on `size` threads standing in for MPI ranks, sharing the candidates out
    (choose.Share with an allgather over a barrier): each one's Chosen and the specs each
    built."""
    import threading

    from netdsl.parallel import choose as choose_mod
    barrier, slots = threading.Barrier(size), [None] * size
    built: dict[int, list] = {r: [] for r in range(size)}
    split_step_ = choose_mod.split_step
    rank_of = {}

    def counted(fwd, batch, spec, *a, **k):
        if spec.devices > 1:
            built[rank_of[threading.get_ident()]].append(spec.describe())
        return split_step_(fwd, batch, spec, *a, **k)

    def run(r, out):
        rank_of[threading.get_ident()] = r

        def allgather(obj):  # (copies, as MPI's pickles are)
            slots[r] = pickle.dumps(obj)
            barrier.wait()
            got = [pickle.loads(b) for b in slots]
            barrier.wait()
            return got
        out[r] = choose_mod.choose(fwd, share=choose_mod.Share(r, size, allgather), **kw)

    out = [None] * size
    choose_mod.split_step = counted
    try:
        threads = [threading.Thread(target=run, args=(r, out)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        choose_mod.split_step = split_step_
    return out, built


def test_ranks_share_the_candidates_and_choose_as_one_process(resnet):
    """`run --distributed` shares auto's candidates out among the ranks (each builds,
    predicts and plans its share; choose.Share): every rank chooses what one process
    choosing alone chooses, from the same figures, and holds the same step, planned as
    it plans it (the same fingerprint), though it built at most half of the candidates
    and the chosen one once more where another rank made it."""
    from netdsl.ir.serialize import fingerprint
    from netdsl.memory.profiles import get_profile
    from netdsl.parallel.candidates import work_of
    from netdsl.parallel.choose import Share, choose
    from netdsl.parallel.predict import get_interconnect
    net, opt, _ = resnet
    kw = dict(batch=BATCH, strategy="auto", devices=2, optimizer=opt,
              profile=get_profile("cpu"), link=get_interconnect("shm"), microbatches=1,
              over_mpi=True)
    plain = choose(net.graph, jobs=1, **kw)
    budget = int(0.85 * min(max(d.peak_bytes for d in c.report.per_device)
                            for c in plain.considered))  # none fits unplanned
    for mem in (None, budget):
        alone = choose(net.graph, mem=mem, plan=mem is not None, jobs=1, **kw)
        ranks, built = _choose_on_ranks(net.graph, 2, mem=mem, plan=mem is not None, **kw)
        n = len(alone.considered)
        assert n >= 4
        for got in ranks:
            assert got.best.spec == alone.best.spec
            assert fingerprint(got.best.graph) == fingerprint(alone.best.graph)
            assert [(c.spec, c.fits, c.report.predicted_step_s, c.memory is not None)
                    for c in got.considered] == [
                (c.spec, c.fits, c.report.predicted_step_s, c.memory is not None)
                for c in alone.considered]
            if mem is not None:
                assert got.best.memory is not None
                assert got.best.memory.per_device == alone.best.memory.per_device
        # each predicts its share (then plans its share of a wave, and builds the chosen
        # one again where another rank made it)
        specs = [c.spec for c in alone.considered]
        work = [work_of(spec) for spec in specs]
        for r in range(2):
            share = [spec.describe() for spec in Share(r, 2, None).mine(specs, work)]
            assert built[r][:len(share)] == share
        if mem is None:
            assert sum(map(len, built.values())) <= n + 1


def test_split_mem_json():
    r = runner.invoke(app, ["split", str(RESNET), "--devices", "2", "--batch", "8",
                            "--strategy", "data", "--mem", "8.5MB", "--verify", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["verify"]["ok"]  # the gate ran the planned step
    plan = out["memory_plan"]
    for key in ("strategy", "profile", "budget_bytes", "decisions", "per_device",
                "predicted_step_s", "unplanned_step_s", "predicted_overhead",
                "unplanned_peak_bytes"):
        assert key in plan
    assert plan["unplanned_peak_bytes"] > 8.5e6
    for d in out["per_device"]:
        assert d["peak_bytes"] <= 8.5e6
        assert d["offload"] + d["recompute"] > 0
        assert {"recompute_bytes", "offload_bytes"} <= set(d)
    assert out["predicted_step_s"] == plan["predicted_step_s"]


def test_run_devices_mem_json():
    r = runner.invoke(app, ["run", str(RESNET), "--devices", "2", "--split", "data",
                            "--batch", "8", "--steps", "2", "--mem", "8.5MB", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["budget_bytes"] == 8_500_000 and out["split"] == "data=2"
    assert out["peak_by_device"] == out["planned_peak_by_device"]
    assert all(v <= 8_500_000 for v in out["peak_by_device"].values())
    per = out["memory_plan"]["per_device"]
    assert set(per) == {"0", "1"} and all(v["recompute"] > 0 for v in per.values())
    assert np.isfinite(out["final_loss"])


def test_what_split_memory_plans_do_not_cover_yet_is_an_error():
    from netdsl.errors import NetdslError
    from netdsl.runtime.options import RunOptions, check_options
    for split in ({"devices": 2}, {"distributed": True}):
        with pytest.raises(NetdslError, match="--offload-state with --devices or "
                           "--distributed is not supported yet"):
            check_options(RunOptions(mem="1GB", offload_state=True, **split))
        check_options(RunOptions(mem="1GB", **split))  # planned per device


def test_each_process_planned_into_the_budget_less_its_own_reserve(resnet):
    """Over MPI each device is a process holding its own inputs besides its plan (a
    pipeline's first stage the images, its last the labels: `plan.process_reserves`), and
    each device is planned into the budget less its own reserve: at a budget where the last
    stage fits with its own reserve but not with the first stage's, the plan fits (with
    one reserve for all, the largest, it would not), every device within the budget."""
    from netdsl.memory.plan import process_reserves
    from netdsl.memory.search import plan_and_apply, plan_memory
    from netdsl.parallel.project import mark_over_mpi
    net, opt, _ = resnet
    step = mark_over_mpi(split_step(net.graph, 64, SplitSpec(pipeline=2, microbatches=8), opt))
    own = process_reserves(step)
    assert own[0] > own[1] + 500_000  # 64 images on device 0
    floor = plan_memory(step, 1, "cpu").per_device  # the least each device can hold
    held = {d: floor[d]["peak_bytes"] + own[d] for d in own}
    budget = floor[1]["peak_bytes"] + (own[0] + own[1]) // 2
    assert budget >= held[0] and budget >= held[1]  # each fits with its own reserve
    res = plan_memory(step, budget, "cpu", reserves=own)
    assert res.feasible
    assert all(r["peak_bytes"] + own[d] <= budget for d, r in res.per_device.items())
    same = plan_memory(step, budget, "cpu", reserves=dict.fromkeys(own, own[0]))
    assert not same.feasible  # device 1 with device 0's reserve
    planned, res = plan_and_apply(step, budget, "cpu", roles=_roles(step))
    assert planned is not None and res.feasible
    assert all(r["verified_peak_bytes"] <= budget for r in res.per_device.values())
