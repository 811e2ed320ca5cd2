"""Gradient accumulation: the batch in micro-batches on one device (or on each data
replica), each part's forward then backward in turn (`run --microbatches`, the file's
`parallel { microbatches = M }`, `plan --microbatches`). Without batchnorm the step is
the whole batch's; with it, each part is normalised by its own statistics, which is
checked against the plain step run on each part alone. The memory it saves is measured
by tracemalloc, not by the plan that predicts it."""
from __future__ import annotations

import json

import numpy as np
import pytest
from _examples import ROOT, load
from typer.testing import CliRunner

from netdsl import api
from netdsl.config import TrainConfig
from netdsl.errors import NetdslError
from netdsl.ir.placement import canonical
from netdsl.memory.plan import make_plan
from netdsl.parallel.split import SplitSpec, split_step
from netdsl.runtime.data import Loader, make_dataset
from netdsl.runtime.executor import Executor
from netdsl.runtime.gate import verify_split
from netdsl.runtime.options import RunOptions
from netdsl_cli.app import app

runner = CliRunner()


def batch_of(net, batch: int) -> dict:
    data = make_dataset(net.graph, (net.train or TrainConfig()).data, 0)
    return dict(zip(data.input_names, Loader(data.train, batch, 0).next(), strict=True))


def optimizer(net) -> dict:
    return (net.train or TrainConfig()).optimizer.model_dump()


def test_each_part_runs_forward_then_backward_and_the_peak_falls():
    net = load("resnet20-cifar.net")
    peaks = {}
    for micro, sched in ((1, "1f1b"), (4, "gpipe"), (4, "1f1b")):
        g = split_step(net.graph, 32, SplitSpec(microbatches=micro, schedule=sched),
                       optimizer(net))
        peaks[micro, sched] = make_plan(g, ("loss", "updates")).peak_bytes
        if (micro, sched) != (4, "1f1b"):
            continue
        # 1F1B on one stage: micro-batch m's backward is done before m + 1's forward starts
        pos = {n.name: k for k, n in enumerate(g.nodes)}
        for m in range(3):
            last_back = max(k for x, k in pos.items() if f"@m{m}" in x
                            and g[x].meta.get("phase") == "backward")
            first_fwd = min(k for x, k in pos.items() if f"@m{m + 1}" in x
                            and g[x].meta.get("phase") != "backward" and not g[x].is_source)
            assert last_back < first_fwd, m
    assert peaks[4, "1f1b"] < 0.4 * peaks[1, "1f1b"], peaks
    assert peaks[4, "gpipe"] > 0.85 * peaks[1, "1f1b"], peaks  # every part's activations


@pytest.mark.parametrize("name,spec", [
    ("transformer-tiny.net", SplitSpec(microbatches=4, schedule="1f1b")),
    ("digits-mlp.net", SplitSpec(microbatches=3, schedule="1f1b")),  # uneven parts
    ("transformer-tiny.net", SplitSpec(data=2, microbatches=2, schedule="1f1b")),
], ids=["transformer", "mlp-uneven", "data-replicas"])
def test_without_batchnorm_the_step_is_the_whole_batchs(name, spec):
    net = load(name)
    res = verify_split(net.graph, 8, spec, optimizer(net), batch_of(net, 8))
    assert res.reference == "single-device step"
    assert res.ok, res


def test_with_batchnorm_each_part_is_the_plain_step_on_its_rows():
    """Against the unsplit step run on each part alone: the gradients are the parts'
    weighted by their rows, the loss likewise, and the running statistics are updated
    once, from the parts' statistics combined: each plain step's update gives its part's
    mean and biased variance (momentum 0.1 from 0 and 1), whose combination over the 10
    rows is the update the accumulating step must make."""
    net = load("digits-cnn.net")
    opt = optimizer(net)
    feeds = batch_of(net, 10)
    acc = split_step(net.graph, 10, SplitSpec(microbatches=2, schedule="1f1b"), opt)
    ex = Executor(acc, "numpy", "f64", 0)
    out = ex.run(dict(feeds), training=True,
                 roles=("loss", "grads", "updates", "state_updates"), step=0)
    grads = dict(zip([canonical(p.name) for p in acc.params()], out["grads"], strict=True))
    loss, want, parts = 0.0, {}, {}
    for lo, hi in ((0, 5), (5, 10)):
        plain = split_step(net.graph, hi - lo, SplitSpec(), opt)
        e = Executor(plain, "numpy", "f64", 0)
        o = e.run({x: v[lo:hi] for x, v in feeds.items()}, training=True,
                  roles=("loss", "grads", "updates"), step=0)
        loss += float(o["loss"][0]) * (hi - lo) / 10
        for p, gv in zip(plain.params(), o["grads"], strict=True):
            want[p.name] = want.get(p.name, 0) + gv * (hi - lo) / 10
        for name, v in e.state_dict().items():
            if "running" in name:
                parts.setdefault(name, []).append((v, (hi - lo) * 64))  # rows x 8 x 8
    assert float(out["loss"][0]) == pytest.approx(loss, rel=1e-12)
    assert grads.keys() == want.keys()
    for x, gv in grads.items():
        np.testing.assert_allclose(gv, want[x], rtol=1e-10, atol=1e-14, err_msg=x)
    state = ex.state_dict()
    layers = {k.rsplit(".", 1)[0] for k in parts}
    assert len(layers) == 2
    for layer in layers:
        (m0, n), (m1, _) = parts[f"{layer}.running_mean"]
        (v0, _), (v1, _) = parts[f"{layer}.running_var"]
        means = [m0 / 0.1, m1 / 0.1]
        biased = [(v - 0.9) / 0.1 * (n - 1) / n for v in (v0, v1)]
        mean = (means[0] + means[1]) / 2
        var = sum(b + (a - mean) ** 2 for a, b in zip(means, biased, strict=True)) / 2
        np.testing.assert_allclose(state[f"{layer}.running_mean"], 0.1 * mean, rtol=1e-10)
        np.testing.assert_allclose(state[f"{layer}.running_var"],
                                   0.9 + 0.1 * var * 2 * n / (2 * n - 1), rtol=1e-10)


def run(name: str, **kw):
    return api.train(load(name), RunOptions(dtype="f64", eval_samples=0, **kw))


def test_a_run_accumulating_equals_the_plain_run_in_less_measured_memory():
    plain = run("transformer-tiny.net", steps=3)
    acc = run("transformer-tiny.net", steps=3, microbatches=4)
    np.testing.assert_allclose(acc.losses, plain.losses, rtol=1e-10)
    assert acc.split == "microbatches=4" and plain.split is None
    # peak_bytes is tracemalloc's high-water mark, not the plan's
    assert acc.peak_bytes < 0.6 * plain.peak_bytes, (acc.peak_bytes, plain.peak_bytes)


def test_a_budget_only_accumulation_meets_is_met_and_measured():
    """transformer-tiny at batch 32 needs about 21 MB planned as one batch, 11 MB in four
    parts: 14 MB is refused for the first and holds the second, as tracemalloc sees it."""
    with pytest.raises(NetdslError, match="more --microbatches"):
        run("transformer-tiny.net", steps=1, mem="14MB")
    acc = run("transformer-tiny.net", steps=2, mem="14MB", microbatches=4)
    assert acc.budget_bytes == 14_000_000
    assert acc.peak_bytes <= 14_000_000
    plain = run("transformer-tiny.net", steps=2)
    np.testing.assert_allclose(acc.losses, plain.losses, rtol=1e-10)


def test_the_files_microbatches_declared_alone(tmp_path):
    src = (ROOT / "examples" / "digits-mlp.net").read_text().replace(
        "network digits_mlp {", "network digits_mlp {\n    parallel { microbatches = 4 }")
    f = tmp_path / "accumulating.net"
    f.write_text(src)  # (`import mlp` is the standard library's)
    net = api.load(f)
    res = api.train(net, RunOptions(steps=2, dtype="f64", eval_samples=0))
    assert res.split == "microbatches=4"
    plain = run("digits-mlp.net", steps=2)
    np.testing.assert_allclose(res.losses, plain.losses, rtol=1e-10)
    # the command line's count wins; 1 is the plain step
    assert api.train(net, RunOptions(steps=1, microbatches=1, eval_samples=0)).split is None


def test_plan_microbatches_json():
    out = {}
    for m in (1, 4):
        r = runner.invoke(app, ["plan", str(ROOT / "examples" / "resnet20-cifar.net"),
                                "--batch", "32", "--profile", "cpu", "--mem", "40MB",
                                "--microbatches", str(m), "--json"])
        assert r.exit_code == 0, r.output
        out[m] = json.loads(r.stdout)
    assert out[4]["microbatches"] == 4 and out[1]["microbatches"] == 1
    assert out[4]["baseline_peak_bytes"] < 0.5 * out[1]["baseline_peak_bytes"]


def test_microbatches_where_they_do_not_apply_are_refused():
    r = runner.invoke(app, ["run", str(ROOT / "examples" / "digits-mlp.net"), "--devices",
                            "2", "--split", "tensor", "--microbatches", "2", "--steps", "1"])
    assert r.exit_code == 3, r.output
    assert "not to tensor or spatial splits" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["run", str(ROOT / "examples" / "digits-mlp.net"),
                            "--microbatches", "64", "--batch", "32", "--steps", "1"])
    assert r.exit_code == 3, r.output
    assert "cannot split a batch of 32 into 64 parts" in r.output


def test_a_budget_no_plan_meets_names_the_micro_batches_that_fit():
    """transformer-tiny at batch 32 (float32) needs about 10.8 MB planned whole; at 6 MB
    `plan` and `run` name 4 parts, which `plan --microbatches 4` then plans within 6 MB
    and a run holds as tracemalloc measures it; under the state and workspace alone
    (3 MB) no count is named."""
    tiny = str(ROOT / "examples" / "transformer-tiny.net")

    def plan(mem, *more):
        r = runner.invoke(app, ["plan", tiny, "--profile", "cpu", "--mem", mem, "--json",
                                *more])
        return r.exit_code, json.loads(r.stdout)
    code, out = plan("6MB")
    assert code == 3 and not out["feasible"] and out["fits_with_microbatches"] == 4
    code, out = plan("6MB", "--microbatches", "4")
    assert code == 0 and out["feasible"] and out["fits_with_microbatches"] is None
    code, out = plan("3MB")
    assert code == 3 and out["fits_with_microbatches"] is None
    with pytest.raises(NetdslError, match=r"with --microbatches 4 \(the gradients"):
        api.train(load("transformer-tiny.net"), RunOptions(steps=1, mem="6MB"))
    res = api.train(load("transformer-tiny.net"),
                    RunOptions(steps=1, mem="6MB", microbatches=4, eval_samples=0))
    assert res.peak_bytes <= 6_000_000


@pytest.mark.parametrize("batch,need,have,found,tried", [
    (16, 3, 1, 4, [4, 2]),  # predicted 3: the next divisor, then one below that fails
    (16, 16, 1, 16, [16, 8]),
    (32, 5, 1, 8, [8, 4]),
    (7, 2, 1, 2, [2]),  # a prime batch: any count
    (16, 3, 2, 4, [4]),  # above the count given
    (16, 40, 1, None, []),  # not even one sample a part comes near
])
def test_the_search_for_micro_batches_plans_few_steps(monkeypatch, batch, need, have,
                                                      found, tried):
    """`fewest_microbatches` on a stand-in: activations of 100 bytes that shrink with the
    parts (`need` parts fit), no state; the plans it asks for, in order."""
    from types import SimpleNamespace as NS

    from netdsl.step import fit as accumulate
    monkeypatch.setattr(accumulate, "accumulating_step", lambda f, b, c, m, device: m)
    fwd = NS(nodes=[None] * 10, params=list)
    failed = NS(state_bytes=0, workspace_bytes=0, outside_plan_bytes=0,
                min_feasible_bytes=100, budget_bytes=100 * have / need + 1e-9)
    asked = []

    def plan(m):
        asked.append(m)
        return NS(feasible=m >= need)
    assert accumulate.fewest_microbatches(fwd, batch, None, failed, plan, have) == found
    assert asked == tried


def test_the_search_counts_the_gradients_and_the_steps_size():
    """From two parts on every gradient is held to the update: parameters whose gradients
    do not fit beside the state are no count at all; nor is a count whose copies of the
    network would pass max_nodes."""
    from types import SimpleNamespace as NS

    from netdsl.step.fit import fewest_microbatches
    net = load("digits-mlp.net")
    grads = sum(p.type.numel() * 4 for p in net.graph.params())
    failed = NS(state_bytes=2 * grads, workspace_bytes=0, outside_plan_bytes=0,
                min_feasible_bytes=2 * grads + 10_000, budget_bytes=2 * grads + 20_000)
    assert fewest_microbatches(net.graph, 32, net.train, failed,
                               lambda s: pytest.fail("planned"), 1) is None
    failed.budget_bytes = 3 * grads + 5_000  # 2 parts predicted
    ok = NS(feasible=True)
    assert fewest_microbatches(net.graph, 32, net.train, failed, lambda s: ok, 1) == 2
    failed.budget_bytes = 3 * grads + 1_000  # 10 parts predicted: tries 16, 8, 4
    assert fewest_microbatches(net.graph, 32, net.train, failed, lambda s: ok, 1) == 4
    assert fewest_microbatches(net.graph, 32, net.train, failed,
                               lambda s: pytest.fail("planned"), 1,
                               max_nodes=4 * len(net.graph.nodes)) is None


def test_the_run_says_it_accumulates():
    r = runner.invoke(app, ["run", str(ROOT / "examples" / "digits-mlp.net"),
                            "--microbatches", "4", "--steps", "1"])
    assert r.exit_code == 0, r.output
    assert "batch 32 (microbatches=4)" in r.output


def test_a_checkpoint_resumes_with_another_count(tmp_path):
    """Checkpoints hold the single-device layout: two steps in four parts, then two more
    resumed as one batch, are four plain steps (digits-mlp, float64, no batchnorm)."""
    plain = run("digits-mlp.net", steps=4)
    ck = str(tmp_path / "ck")
    first = run("digits-mlp.net", steps=2, microbatches=4, checkpoint=ck)
    rest = run("digits-mlp.net", steps=4, checkpoint=ck, resume=True)
    assert rest.resumed_from == 2
    np.testing.assert_allclose(first.losses + rest.losses, plain.losses, rtol=1e-10)
