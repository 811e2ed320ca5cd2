"""`auto` does not silently change what the step computes: a split whose step is not the
single-device step (batchnorm over micro-batches, or over each device's rows) is chosen
only where the user asked for it or no exact split fits, and then the run says so."""
from pathlib import Path

import numpy as np

import netdsl
from netdsl.config import TrainConfig
from netdsl.memory.profiles import get_profile
from netdsl.options import RunOptions
from netdsl.parallel.candidates import exact, has_batch_statistics, prefers_exact
from netdsl.parallel.choose import choose
from netdsl.parallel.predict import get_interconnect
from netdsl.parallel.split import SplitSpec
from netdsl.runtime.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent


def load(name):
    return netdsl.load(ROOT / "examples" / name)


def test_which_splits_compute_the_single_devices_numbers():
    assert has_batch_statistics(load("resnet20-cifar.net").graph)
    assert not has_batch_statistics(load("transformer-tiny.net").graph)
    for spec in (SplitSpec(data=2), SplitSpec(tensor=2), SplitSpec(spatial=2),
                 SplitSpec(pipeline=2), SplitSpec(data=2, tensor=2)):
        assert exact(spec, True), spec
    for spec in (SplitSpec(pipeline=2, microbatches=4), SplitSpec(data=2, bn="local"),
                 SplitSpec(data=2, microbatches=2), SplitSpec(spatial=2, bn="local")):
        assert not exact(spec, True) and exact(spec, False), spec


def test_only_auto_without_micro_batches_or_local_batchnorm_prefers_exact():
    assert prefers_exact("auto", None, "sync", {}, 2)
    assert prefers_exact(None, None, "sync", {}, 2)  # (no declared split: auto)
    assert not prefers_exact("pipeline", None, "sync", {}, 2)
    assert not prefers_exact("auto", 4, "sync", {}, 2)  # micro-batches asked for
    assert not prefers_exact("auto", None, "local", {}, 2)
    assert not prefers_exact(None, None, "sync", {"pipeline": 2, "microbatches": 4}, 2)


def _choose(net, batch, mem=None, profile="cpu", link="shm", **kw):
    return choose(net.graph, batch, "auto", 2, (net.train or TrainConfig()).optimizer
                  .model_dump(), get_profile(profile), get_interconnect(link), mem=mem,
                  jobs=1, **kw)


def test_auto_chooses_an_exact_split_where_one_fits():
    """On a K40 over 10 Gb Ethernet a pipeline of micro-batches is predicted fastest for
    resnet20 at batch 32; auto still takes the fastest split that computes the same."""
    chosen = _choose(load("resnet20-cifar.net"), 32, profile="k40-12gb", link="10gbe")
    fastest = min(chosen.considered, key=lambda c: c.report.predicted_step_s)
    assert not fastest.exact and fastest.fits  # (what makes this case a test)
    assert chosen.best.exact and chosen.note is None
    fastest_exact = min((c for c in chosen.considered if c.exact and c.fits),
                        key=lambda c: c.report.predicted_step_s)
    assert chosen.best.spec == fastest_exact.spec


def test_auto_falls_back_to_an_inexact_split_only_where_no_exact_one_fits():
    net = load("resnet20-cifar.net")
    every = _choose(net, 8, mem=10**12).considered

    def peak(c):
        return max(d.peak_bytes + d.outside_plan_bytes for d in c.report.per_device)
    least_exact = min(peak(c) for c in every if c.exact)
    inexact = [c for c in every if not c.exact and peak(c) < least_exact]
    assert inexact, "a micro-batched pipeline holds less than every exact split"
    chosen = _choose(net, 8, mem=least_exact - 1)
    assert not chosen.best.exact and chosen.best.fits
    assert chosen.note.startswith(f"auto chose {chosen.best.spec.describe()}, which "
                                  "normalises batchnorm over each of")
    assert "computes other numbers than one device's" in chosen.note


def test_a_split_the_user_asks_for_is_not_warned_about():
    net = load("resnet20-cifar.net")
    opt = (net.train or TrainConfig()).optimizer.model_dump()
    chosen = choose(net.graph, 8, "pipeline", 2, opt, get_profile("cpu"),
                    get_interconnect("shm"), microbatches=4, jobs=1)
    assert not chosen.best.exact and chosen.note is None


def test_run_on_two_devices_computes_the_one_device_numbers():
    """The case that went wrong: `run --devices 2` on a batchnorm network let auto pick a
    micro-batched pipeline, whose loss differed from one device's."""
    net = load("resnet20-cifar.net")
    kw = dict(steps=2, batch=8, seed=3, dtype="f64", eval_samples=0)
    one = Trainer(net.graph, net.train, RunOptions(**kw)).fit()
    two = Trainer(net.graph, net.train, RunOptions(devices=2, **kw))
    assert two.warnings == [] and "microbatches" not in two.split
    np.testing.assert_allclose(two.fit().losses, one.losses, rtol=1e-10)


def test_a_slice_costs_the_part_it_reads():
    """A data split's gradient bucket is all-reduced whole and sliced back into each
    parameter's gradient: priced as reading the whole bucket per slice, the split would be
    predicted slower than one device and auto would take pipelines of micro-batches
    instead; a slice reads only what it outputs."""
    from netdsl.ir import registry
    ops = registry.load_all()
    assert ops["slice"].moved_bytes(10, [1000]) == 20
    assert ops["relu"].moved_bytes(10, [10]) == 20 and ops["add"].moved_bytes(4, [4, 4]) == 12
    chosen = choose(load("resnet164-cifar.net").graph, 8, "data", 2,
                    TrainConfig().optimizer.model_dump(), get_profile("cpu"),
                    get_interconnect("pcie3"), jobs=1)
    rep = chosen.best.report
    assert rep.predicted_step_s < rep.single_step_s  # two devices beat one
