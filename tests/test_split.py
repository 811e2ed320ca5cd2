"""Splitting a training step across devices (netdsl.parallel): the equivalence gate for
every scheme on a ResNet, a VGG and the transformer with 2 and 4 devices, the ring
collectives and the bytes they send, the structural check, checkpoints in the
single-device layout, and `netdsl split` / `run --devices` from the command line."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from gradcheck import check_grads
from typer.testing import CliRunner

from netdsl import api
from netdsl.config import TrainConfig
from netdsl.errors import SplitError
from netdsl.ir.graph import Graph, Node
from netdsl.ir.placement import Shard, canonical
from netdsl.ir.rewrite import make_node
from netdsl.ir.types import TensorType
from netdsl.memory.profiles import get_profile
from netdsl.parallel.check import SplitCheckError, check
from netdsl.parallel.predict import get_interconnect, report, step_time
from netdsl.parallel.split import SplitSpec, split_step
from netdsl.runtime.comm import RING, InProcess
from netdsl.runtime.data import Loader, make_dataset
from netdsl.runtime.executor import Executor
from netdsl.runtime.gate import verify_split
from netdsl_cli.app import app

ROOT = Path(__file__).resolve().parent.parent
NETS = {"resnet20": ROOT / "examples" / "resnet20-cifar.net",
        "vgg": ROOT / "tests" / "nets" / "vgg-small.net",
        "transformer": ROOT / "examples" / "transformer-tiny.net"}
BATCH = 8
runner = CliRunner()


def setup(name: str):
    net = api.load(NETS[name])
    cfg = net.train or TrainConfig()
    data = make_dataset(net.graph, cfg.data, 0)
    feeds = dict(zip(data.input_names, Loader(data.train, BATCH, 0).next(), strict=True))
    return net, cfg.optimizer.model_dump(), feeds


SPECS = {
    "data2": SplitSpec(data=2), "data4": SplitSpec(data=4),
    "pipeline2": SplitSpec(pipeline=2, microbatches=4),
    "pipeline4": SplitSpec(pipeline=4, microbatches=2),
    "hybrid4": SplitSpec(data=2, pipeline=2, microbatches=2, bn="local"),
    "tensor2": SplitSpec(tensor=2), "tensor4": SplitSpec(tensor=4),
    "data2-tensor2": SplitSpec(data=2, tensor=2),
    "1f1b4": SplitSpec(pipeline=4, microbatches=8, schedule="1f1b"),
}


@pytest.mark.parametrize("spec", sorted(SPECS))
@pytest.mark.parametrize("name", sorted(NETS))
def test_split_step_equals_single_device_step(name, spec):
    """Loss, every gradient and every value after the update agree to 1e-9 (float64)."""
    net, opt, feeds = setup(name)
    r = verify_split(net.graph, BATCH, SPECS[spec], opt, feeds)
    assert r.ok, (r.worst, r.loss_rel, r.grad_rel, r.state_rel, r.first_divergence)
    assert max(r.loss_rel, r.grad_rel, r.state_rel) <= 1e-9
    assert r.comm_bytes and all(v > 0 for v in r.comm_bytes.values())


def test_data_parallel_batchnorm_is_synchronised():
    """With sync batchnorm the reference is the plain single-device step, not a
    per-part one; local batchnorm is compared against per-part statistics."""
    net, opt, feeds = setup("resnet20")
    assert verify_split(net.graph, BATCH, SplitSpec(data=2), opt, feeds).reference == \
        "single-device step"
    local = verify_split(net.graph, BATCH, SplitSpec(data=2, bn="local"), opt, feeds)
    assert local.ok and "same parts" in local.reference


def test_gate_names_the_first_diverging_node():
    net, opt, feeds = setup("resnet20")
    g = split_step(net.graph, BATCH, SplitSpec(pipeline=2, microbatches=2), opt)
    victim = next(n for n in g.nodes if n.op == "sync_batchnorm" and n.meta.get("origin")
                  and "basic_stage[1]" in n.name)
    victim.attrs["eps"] = 0.5  # a wrong copy: the split no longer computes the same step
    r = verify_split(net.graph, BATCH, SplitSpec(pipeline=2, microbatches=2), opt, feeds,
                     split=g)
    assert not r.ok
    origin = victim.meta["origin"]  # (a relu's name: batchnorm + relu were fused)
    assert r.first_divergence.startswith(f"%{origin} ({net.graph[origin].op}) at ")
    assert "resnet.net" in r.first_divergence


def comm_graph() -> Graph:
    """Two devices: p0 and p1 all-gathered, reduce-scattered back, all-reduced, squared
    on device 1 and sent to device 0, where the loss weighs everything."""
    g = Graph("comm", batch=2)
    for d in (0, 1):
        g.add(Node(f"p{d}", "param", (), TensorType((2, 4), "f32"),
                   {"shape": (2, 4), "init": "normal"}, device=d))

    def group(op, ins, attrs, tag):
        names = [f"{tag}{d}" for d in (0, 1)]
        for d, name in enumerate(names):
            g.add(make_node(g, name, op, ins, {**attrs, "group": (0, 1), "index": d},
                            device=d, meta={"members": tuple(names)}))
        return names

    ag = group("all_gather", ["p0", "p1"], {"axis": 0}, "ag")
    rs = group("reduce_scatter", ag, {"axis": 0, "sizes": (2, 2)}, "rs")
    ar = group("all_reduce", rs, {}, "ar")
    g.add(make_node(g, "sq", "mul", [ar[1], ar[1]], device=1))
    g.add(make_node(g, "msg", "send", ["sq"], {"peer": 0, "tag": 0}, device=1))
    g.add(make_node(g, "got", "recv", ["msg"], {"peer": 1, "tag": 0}, device=0))
    g.add(make_node(g, "out", "add", [ar[0], "got"], device=0))
    g.add(Node("r", "input", (), TensorType((2, 4), "f32"), {"shape": (2, 4)}, device=0))
    g.add(make_node(g, "w", "mul", ["out", "r"], device=0))
    g.add(make_node(g, "m0", "mean", ["w"], {"axis": 0}, device=0))
    g.add(make_node(g, "loss", "mean", ["m0"], {"axis": 0}, device=0))
    g.outputs = {"loss": ["loss"]}
    return g.verify()


def test_communication_gradients_match_finite_differences():
    grads = check_grads(comm_graph())
    assert set(grads) == {"p0", "p1"}


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("op", sorted(RING))
def test_ring_collectives(op, p):
    rng = np.random.default_rng(p)
    xs = [rng.standard_normal((5, 7)) for _ in range(p)]
    sizes = {2: (3, 2), 3: (2, 2, 1), 4: (2, 1, 1, 1)}[p]  # parts of the 5 rows
    attrs = {"group": tuple(range(p)), "axis": 0, "sizes": sizes}
    comm = InProcess(type("B", (), {"xp": np})())
    outs = RING[op](comm, xs, attrs, list(range(p)))
    total = sum(xs)
    cuts = np.cumsum((0,) + sizes)
    for k, out in enumerate(outs):
        want = {"all_reduce": total, "all_gather": np.concatenate(xs),
                "reduce_scatter": total[cuts[k]:cuts[k + 1]]}[op]
        np.testing.assert_allclose(out, want, rtol=1e-13, atol=1e-13)
    sent = sum(comm.sent_bytes.values())
    full = xs[0].nbytes
    expect = {"all_reduce": 2 * (p - 1) * full, "all_gather": (p - 1) * p * full,
              "reduce_scatter": (p - 1) * full}[op]
    assert sent == expect  # what a ring moves: the bandwidth lower bound
    if op == "all_reduce":  # replicas stay identical bit for bit
        assert all(np.array_equal(outs[0], o) for o in outs)


@pytest.mark.parametrize("spec", ["data4", "pipeline2"])
def test_reported_bytes_are_what_the_communicator_sent(spec):
    net, opt, feeds = setup("vgg")
    g = split_step(net.graph, BATCH, SPECS[spec], opt)
    single = split_step(net.graph, BATCH, SplitSpec(), opt)
    rep, _ = report(g, step_time(single, get_profile("cpu"), get_interconnect("shm"), "f64"),
                    get_profile("cpu"), get_interconnect("shm"), "f64")
    r = verify_split(net.graph, BATCH, SPECS[spec], opt, feeds, split=g)
    counted = r.comm_bytes
    for d in rep.per_device:
        # ring chunks differ by at most one element from the even share
        assert abs(counted[d.device] - d.comm_bytes) <= 16 * d.collectives
    assert rep.comm_bytes_total > 0


def test_split_report_pipeline_bubble_and_memory():
    net, opt, _ = setup("vgg")
    g = split_step(net.graph, BATCH, SplitSpec(pipeline=2, microbatches=4), opt)
    single = split_step(net.graph, BATCH, SplitSpec(), opt)
    k40, pcie = get_profile("k40-12gb"), get_interconnect("pcie3")
    rep, timeline = report(g, step_time(single, k40, pcie), k40, pcie)
    assert rep.ideal_bubble == pytest.approx(1 / 5)
    assert 0 < rep.bubble < 1 and rep.predicted_step_s > 0
    # every parameter sits on exactly one stage
    assert sum(d.params for d in rep.per_device) == sum(
        n.type.numel() for n in single.nodes if n.op == "param")
    assert {d for d, *_ in timeline} == {0, 1}


def test_tensor_split_shards_state_and_checkpoints_join_them():
    net, opt, feeds = setup("vgg")
    g = split_step(net.graph, BATCH, SplitSpec(tensor=2), opt)
    w = [n for n in g.nodes if canonical(n.name) == "classifier.linear.weight"]
    assert [Shard.of(n).to_json() for n in w] == [[0, 0, 16, [32, 64]],
                                                  [0, 16, 32, [32, 64]]]
    assert all(n.type.shape == (16, 64) for n in w)
    ex = Executor(g, "numpy", "f64", seed=3)
    single = Executor(split_step(net.graph, BATCH, SplitSpec(), opt), "numpy", "f64", seed=3)
    a, b = ex.state_dict(), single.state_dict()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    b = {k: v + 1.0 for k, v in b.items()}
    ex.load_state_dict(b)
    assert all(np.array_equal(ex.state_dict()[k], b[k]) for k in b)


def test_1f1b_holds_fewer_activations_than_gpipe():
    net, opt, _ = setup("resnet20")
    single = split_step(net.graph, 16, SplitSpec(), opt)
    peaks, bubbles = {}, {}
    for sched in ("gpipe", "1f1b"):
        g = split_step(net.graph, 16, SplitSpec(pipeline=2, microbatches=8, schedule=sched),
                       opt)
        k40, pcie = get_profile("k40-12gb"), get_interconnect("pcie3")
        rep, _ = report(g, step_time(single, k40, pcie), k40, pcie)
        peaks[sched] = max(d.peak_bytes for d in rep.per_device)
        bubbles[sched] = rep.bubble
        # each stage runs its micro-batches in the schedule's order
        first = [n.name for n in g.nodes if n.device == 0 and n.op == "conv2d"][:3]
        assert first == ["cifar_stem.conv2d@m0", "basic_stage.basic.conv2d@m0",
                         "basic_stage.basic.conv2d_1@m0"], first
    assert peaks["1f1b"] < 0.7 * peaks["gpipe"]
    assert abs(bubbles["1f1b"] - bubbles["gpipe"]) < 0.1


def test_structural_check_catches_collective_members_apart():
    net, opt, _ = setup("vgg")
    g = split_step(net.graph, BATCH, SplitSpec(data=2), opt)
    k = next(i for i, n in enumerate(g.nodes) if n.op == "all_reduce")
    g.nodes.insert(k, g.nodes.pop(k - 1))  # a node between the two members
    with pytest.raises(SplitCheckError, match="side by side"):
        check(g, net.graph)


def test_structural_check_catches_a_doubled_layer():
    net, opt, _ = setup("vgg")
    g = split_step(net.graph, BATCH, SplitSpec(data=2), opt)
    n = next(x for x in g.nodes if x.op == "conv2d")
    g.nodes.insert(g.nodes.index(n) + 1, n.copy(name=n.name + ".again"))
    with pytest.raises(SplitCheckError, match="computed 3 times"):
        check(g, net.graph)


def test_structural_check_catches_a_read_across_devices():
    net, opt, _ = setup("vgg")
    g = split_step(net.graph, BATCH, SplitSpec(pipeline=2, microbatches=2), opt)
    a = next(x for x in g.nodes if x.device == 0 and x.op == "relu")
    g.add(Node("stray", "relu", (a.name,), TensorType(a.type.shape, a.type.dtype), device=1))
    with pytest.raises(SplitCheckError, match="without communication"):
        check(g, net.graph)


def test_impossible_splits_are_exit_3():
    net, opt, _ = setup("vgg")
    with pytest.raises(SplitError, match="at most"):
        split_step(net.graph, BATCH, SplitSpec(pipeline=500), opt)
    with pytest.raises(SplitError, match="at least one sample"):
        split_step(net.graph, 2, SplitSpec(data=4), opt)
    for args, words in ((["--devices", "4", "--batch", "2", "--strategy", "data"],
                         "at least one sample"),
                        (["--devices", "2", "--mem", "1KB"], "fits")):
        r = runner.invoke(app, ["split", str(NETS["vgg"]), *args])
        assert r.exit_code == 3, r.output
        assert words in r.output and "Traceback" not in r.output


def test_split_command_json_and_verify(tmp_path):
    r = runner.invoke(app, ["split", str(NETS["vgg"]), "--devices", "2", "--batch", "8",
                            "--verify", "--json", "--plot", str(tmp_path / "s.png")])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert {"devices", "strategy", "per_device", "comm_bytes_total", "predicted_step_s",
            "predicted_speedup", "bubble", "alternatives", "verify"} <= set(d)
    assert d["devices"] == 2 and d["verify"]["ok"]
    assert {"params", "flops", "peak_bytes", "comm_bytes"} <= set(d["per_device"][0])
    assert len(d["alternatives"]) > 1 and (tmp_path / "s.png").stat().st_size > 0
    r = runner.invoke(app, ["split", str(NETS["vgg"]), "--devices", "4", "--strategy",
                            "pipeline", "--batch", "8"])
    assert r.exit_code == 0, r.output
    assert "pipeline bubble" in r.stdout and "device" in r.stdout


def test_a_split_slower_than_one_device_says_so():
    """digits-cnn's step is a fraction of a millisecond on the K40 profile: printed in ms,
    and the best split of it over two devices, slower than one, is said to be."""
    r = runner.invoke(app, ["split", str(ROOT / "examples" / "digits-cnn.net"), "--devices",
                            "2", "--jobs", "1", "--profile", "k40-12gb"])  # (not the default)
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("predicted step"))
    assert re.search(r"predicted step \d\.\d{3} ms .*one device: \d\.\d{3} ms", line), line
    speedup = float(re.search(r"speed-up ([\d.]+)x", line).group(1))
    assert speedup < 1 and "slower than one device" in line


def test_the_files_parallel_declaration_and_stage_pins():
    r = runner.invoke(app, ["split", str(ROOT / "tests" / "nets" / "vgg-par.net"), "--batch",
                            "8", "--verify", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["spec"] == "data=2, pipeline=2, microbatches=2, 1f1b" and d["verify"]["ok"]
    assert len(d["alternatives"]) == 1  # what the file declares, nothing else tried
    net = api.load(ROOT / "tests" / "nets" / "vgg-par.net")
    g = split_step(net.graph, 8, SplitSpec(data=2, pipeline=2, microbatches=2),
                   TrainConfig().optimizer.model_dump())
    stage = {n.meta["origin"]: n.device % 2 for n in g.nodes
             if n.meta.get("origin") and n.meta.get("phase") is None and not n.is_source
             and n.op not in ("send", "recv") and not n.meta.get("combined")}
    assert all(s == 1 for o, s in stage.items() if o.startswith("classifier"))
    assert stage["features.conv_stack.conv2d"] == 0


def test_run_on_4_devices_resumes_on_1(tmp_path):
    net = str(ROOT / "examples" / "digits-cnn.net")
    ck = str(tmp_path / "ck")
    r = runner.invoke(app, ["run", net, "--devices", "4", "--split", "data", "--steps", "3",
                            "--checkpoint", ck, "--json", "--eval-samples", "0"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["split"] == "data=4" and len(d["peak_by_device"]) == 4
    assert all(v > 0 for v in d["comm_bytes_per_step"].values())
    resumed = runner.invoke(app, ["run", net, "--steps", "5", "--checkpoint", ck, "--resume",
                                  "--json", "--eval-samples", "0"])
    straight = runner.invoke(app, ["run", net, "--steps", "5", "--json", "--eval-samples",
                                   "0"])
    a, b = json.loads(resumed.stdout), json.loads(straight.stdout)
    assert a["resumed_from"] == 3
    assert a["final_loss"] == pytest.approx(b["final_loss"], rel=1e-5)


def test_tensor_split_pairs_layers_megatron_style():
    """linear -> gelu -> linear: the first split by output, the second by input columns,
    one all-reduce in place of a gather and a reduce-scatter each way (fewer collectives
    and bytes); the gate above covers the numbers (tensor2/tensor4 on the transformer)."""
    net, opt, _ = setup("transformer")
    g = split_step(net.graph, BATCH, SplitSpec(tensor=2), opt)
    ff = "encoder.encoder_layer.feed_forward"
    assert [ff + ".linear", ff + ".linear_1"] in g.meta["tensor_pairs"]
    w = [n for n in g.nodes if canonical(n.name) == ff + ".linear_1.weight"]
    assert [Shard.of(n).to_json() for n in w] == [[1, 0, 128, [64, 256]],
                                                  [1, 128, 256, [64, 256]]]
    bias = [n for n in g.nodes if canonical(n.name) == ff + ".linear_1.bias"]
    assert [n.device for n in bias] == [0]  # added once, before the sum
    reduced = [n for n in g.nodes if n.op == "all_reduce" and n.meta.get("phase") is None]
    assert {canonical(n.name) for n in reduced} >= {ff + ".linear_1"}
    gathers = {canonical(n.name) for n in g.nodes if n.op == "all_gather"}
    assert ff + ".linear" not in gathers and ff + ".linear_1" not in gathers


def test_data_by_tensor_hybrid_reduces_each_shard_over_the_replicas():
    """parallel { data = 2; tensor = 2 }: replica r's rank t on device 2r + t; a shard's
    gradient is all-reduced between the two devices holding that shard; the state joins
    the shards in the single-device layout (the gate covers the numbers)."""
    net, opt, _ = setup("transformer")
    g = split_step(net.graph, BATCH, SplitSpec(data=2, tensor=2), opt)
    assert g.meta["split"]["strategy"] == "hybrid"
    w = "encoder.encoder_layer.feed_forward.linear.weight"
    shards = {n.name: (n.device, Shard.of(n).lo) for n in g.nodes
              if n.op == "param" and canonical(n.name) == w}
    assert sorted(shards.values()) == [(0, 0), (1, 128), (2, 0), (3, 128)]
    groups = [n.attrs["group"] for n in g.nodes if n.op == "all_reduce"
              and n.meta.get("grad_sync") and n.meta["members"][0] == n.name]
    assert (0, 2) in groups and (1, 3) in groups
    ex = Executor(g, "numpy", "f64", seed=3)
    single = Executor(split_step(net.graph, BATCH, SplitSpec(), opt), "numpy", "f64", seed=3)
    a, b = ex.state_dict(), single.state_dict()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_device_and_replicate_annotations():
    """@device(k) pins a pipeline stage (and is an error in a data split); @replicate
    keeps a layer out of a tensor split and whole in a spatial split."""
    net, opt, _ = setup("vgg")
    g = net.graph.copy()
    head = next(n for n in g.nodes if n.op == "linear")
    head.annotations["device"] = 1
    p = split_step(g, BATCH, SplitSpec(pipeline=2, microbatches=2), opt)
    assert {n.device for n in p.nodes if n.meta.get("origin") == head.name
            and n.meta.get("phase") is None and n.op == "linear"} == {1}
    with pytest.raises(SplitError, match=r"@device\(1\) on %.*every device"):
        split_step(g, BATCH, SplitSpec(data=2), opt)
    head.annotations["device"] = 5
    with pytest.raises(SplitError, match="only 2 devices"):
        split_step(g, BATCH, SplitSpec(pipeline=2, microbatches=2), opt)
    del head.annotations["device"]
    head.annotations["replicate"] = True
    t = split_step(g, BATCH, SplitSpec(tensor=2), opt)
    assert head.name not in t.meta["tensor_layers"]
    conv = next(n for n in g.nodes if n.op == "conv2d")
    conv.annotations["replicate"] = True
    s = split_step(g, BATCH, SplitSpec(spatial=2), opt)
    assert conv.name not in s.meta["spatial_layers"]


def test_auto_lists_the_candidates_it_cannot_make_with_why():
    """A layer pinned by @device(k) can only be split as a pipeline stage: `auto` passes
    over the other schemes and says why (`unavailable`; before, the reasons were dropped
    whenever another candidate worked)."""
    from netdsl.parallel.choose import choose
    net = api.load(ROOT / "examples" / "digits-cnn.net")
    g = net.graph.copy()
    next(n for n in g.nodes if n.op == "linear").annotations["device"] = 1
    chosen = choose(g, 32, "auto", 2, net.train.optimizer.model_dump(), get_profile("cpu"),
                    get_interconnect("shm"), jobs=1)
    assert chosen.best.spec.pipeline == 2
    assert {u.split("=")[0] for u in chosen.unavailable} == {"data", "tensor", "spatial"}
    assert all("places it on one device" in u for u in chosen.unavailable)


def test_auto_skips_only_pipelines_that_could_not_win():
    """auto builds a pipeline's micro-batch counts in rising order and stops once one is
    slower than the one before and than a split that fits (candidates.past_its_best): each
    candidate it did not build, built here, is slower than its choice; where nothing
    fits unplanned, it builds every one."""
    from netdsl.parallel.choose import candidates, choose
    net = api.load(ROOT / "examples" / "digits-cnn.net")
    kw = dict(batch=32, strategy="auto", devices=4, optimizer=net.train.optimizer.model_dump(),
              profile=get_profile("cpu"), link=get_interconnect("shm"), jobs=1)
    chosen = choose(net.graph, **kw)
    every = candidates("auto", 4, 32, None, {}, "sync", None, True)
    assert chosen.skipped and all(s.pipeline > 1 for s in chosen.skipped)
    assert sorted(map(str, [c.spec for c in chosen.considered] + chosen.skipped)) == \
        sorted(map(str, every))
    t = chosen.best.report.predicted_step_s
    peaks = {}
    for spec in chosen.skipped:
        alone = choose(net.graph, **dict(kw, strategy="hybrid" if spec.data > 1 else
                                         "pipeline", microbatches=spec.microbatches,
                                         schedule=spec.schedule))
        assert alone.best.spec == spec and alone.best.report.predicted_step_s > t
        peaks[spec] = max(d.peak_bytes for d in alone.best.report.per_device)
    out = runner.invoke(app, ["split", str(ROOT / "examples" / "digits-cnn.net"),
                              "--devices", "4", "--batch", "32", "--profile", "cpu",
                              "--interconnect", "shm", "--jobs", "1", "--json"])
    assert json.loads(out.output)["skipped"] == [s.describe() for s in chosen.skipped]
    # a budget only the most micro-batches fit: nothing fits before it, nothing skipped
    last = chosen.skipped[-1]
    tight = choose(net.graph, **dict(kw, mem=peaks[last]))
    assert tight.best.spec == last and not tight.skipped


CLIPPED = (ROOT / "examples" / "digits-cnn.net").read_text().replace(
    "optimizer = adam(lr=3e-3)", "optimizer = adam(lr=3e-3, clip_grad_norm=0.5)")


@pytest.mark.parametrize("strategy,devices,micro", [
    ("data", 2, None), ("pipeline", 2, 2), ("tensor", 2, None), ("spatial", 2, None),
    ("hybrid", 4, 1)])
def test_clip_grad_norm_split_equals_one_device(strategy, devices, micro):
    """With clip_grad_norm each device sums the squares of the gradients it owns (a
    parameter held by several devices is counted by its first), the sums are all-reduced
    and every device scales its gradients by the same factor: each split's step equals
    the single device's (the equivalence gate, float64)."""
    import netdsl
    net = netdsl.loads(CLIPPED)
    assert net.train.optimizer.clip_grad_norm == 0.5
    res = api.split(net, devices, strategy, batch=8, microbatches=micro, verify=True)
    assert res.gate.ok, res.gate
    g = res.chosen.best.graph
    # one partial sum a device (a zero where every parameter it holds another owns)
    partials = [n for n in g.nodes if n.name.startswith("optimizer.grad_sumsq")
                and n.op in ("grad_sumsq", "fill")]
    assert sorted(n.device for n in partials) == list(range(devices))
    if strategy == "hybrid":  # the second replica owns nothing
        assert {n.device for n in partials if n.op == "fill"} == {2, 3}
    assert len(g.by_op("clip_factor")) == devices
    assert len({n.attrs["group"] for n in g.by_op("all_reduce")
                if n.meta.get("phase") == "optimizer"}) == 1


def test_run_bn_local_normalises_per_device():
    """`run --bn sync` (the default) is the single-device step; `--bn local` normalises
    each device's rows by their own statistics (PyTorch DDP's default), another step."""
    cnn = str(ROOT / "examples" / "digits-cnn.net")

    def losses(*more):
        r = runner.invoke(app, ["run", cnn, "--steps", "2", "--dtype", "f64",
                                "--eval-samples", "0", "--json", *more])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["final_loss"]
    plain = losses()
    assert losses("--devices", "2", "--split", "data") == pytest.approx(plain, rel=1e-10)
    local = losses("--devices", "2", "--split", "data", "--bn", "local")
    assert abs(local - plain) > 1e-6 * abs(plain)
    r = runner.invoke(app, ["run", cnn, "--devices", "2", "--bn", "per-device"])
    assert r.exit_code == 1 and "--bn must be sync or local, not 'per-device'" in r.output
