"""Splits of three dimensions (netdsl.parallel.split): tensor ranks inside pipeline stages,
with data replicas and their state sharded (ZeRO over the replicas of each stage and
tensor rank). The float64 gate against one device on the transformer, the tiny GPT and
ResNet-20 at 4 and 8 devices; Megatron-LM's device order in the graph, the report and
`split --json`; every state element held once with shards; checkpoints in the
single-device layout; `--split data=2,pipeline=2,tensor=2` and `parallel { }` and their
errors; `auto`'s 3-D candidates and the reason it gives for one."""
from __future__ import annotations

import json

import numpy as np
import pytest
from test_split import NETS, ROOT, runner, setup
from test_zero import round_trip_state

from netdsl import api
from netdsl.errors import NetdslError, SplitError
from netdsl.ir.placement import FLAT, Shard, flat_piece_shard, position_of
from netdsl.ir.types import TensorType
from netdsl.memory.profiles import get_profile
from netdsl.options import RunOptions, conflicts, split_sizes
from netdsl.parallel.candidates import Choice, candidates, choice_reason, exact
from netdsl.parallel.check import SplitCheckError, check
from netdsl.parallel.predict import SplitReport, get_interconnect, report
from netdsl.parallel.split import SplitSpec, device_index, split_step
from netdsl.runtime.executor import Executor
from netdsl.runtime.gate import verify_split
from netdsl_cli.app import app

NETS = {**NETS, "gpt": ROOT / "examples" / "gpt-tiny.net"}
BATCH = 8
CPU, SHM = get_profile("cpu"), get_interconnect("shm")
SPECS = {
    # 4 devices
    "tensor2-pipeline2": SplitSpec(tensor=2, pipeline=2, microbatches=2, schedule="1f1b"),
    "data2-pipeline2-shard1": SplitSpec(data=2, pipeline=2, microbatches=2, shard=1),
    "data2-tensor2-shard3": SplitSpec(data=2, tensor=2, shard=3),
    # 6 devices: channels not divisible by the tensor ranks (uneven shards)
    "tensor3-pipeline2": SplitSpec(tensor=3, pipeline=2, microbatches=2),
    # 8 devices
    "tensor2-pipeline4": SplitSpec(tensor=2, pipeline=4, microbatches=4, schedule="1f1b"),
    "data2-tensor2-pipeline2": SplitSpec(data=2, tensor=2, pipeline=2, microbatches=2),
    "data2-tensor2-pipeline2-shard1": SplitSpec(data=2, tensor=2, pipeline=2, microbatches=2,
                                                shard=1, schedule="1f1b"),
    "data2-tensor2-pipeline2-shard2": SplitSpec(data=2, tensor=2, pipeline=2, microbatches=2,
                                                shard=2),
    "data2-tensor2-pipeline2-shard3": SplitSpec(data=2, tensor=2, pipeline=2, microbatches=2,
                                                shard=3),
}


@pytest.mark.parametrize("spec", sorted(SPECS))
@pytest.mark.parametrize("name", ["transformer", "gpt"])
def test_3d_split_step_equals_single_device_step(name, spec):
    """Loss, every gradient (piece) and every state value after the update to 1e-9."""
    net, opt, feeds = setup3(name)
    r = verify_split(net.graph, BATCH, SPECS[spec], opt, feeds)
    assert r.ok, (r.worst, r.loss_rel, r.grad_rel, r.state_rel, r.first_divergence)
    assert r.reference == "single-device step"
    assert len(r.comm_bytes) == SPECS[spec].devices


@pytest.mark.parametrize("spec, reference", [
    (SplitSpec(tensor=2, pipeline=2), "single-device step"),
    (SplitSpec(data=2, tensor=2, pipeline=2), "single-device step"),
    (SplitSpec(data=2, tensor=2, pipeline=2, microbatches=2, shard=1), "same micro-batches"),
    (SplitSpec(tensor=2, pipeline=2, microbatches=2, bn="local"), "same parts"),
])
def test_3d_split_with_batchnorm(spec, reference):
    """ResNet-20: each tensor rank's batchnorm copies are synchronised over the replicas
    (micro-batch by micro-batch), its mirrors not counted twice; several micro-batches
    normalise alone, against the single-device step over the same parts."""
    net, opt, feeds = setup("resnet20")
    r = verify_split(net.graph, BATCH, spec, opt, feeds)
    assert r.ok, (r.worst, r.loss_rel, r.grad_rel, r.state_rel, r.first_divergence)
    assert reference in r.reference


def setup3(name: str):
    if name != "gpt":
        return setup(name)
    from netdsl.runtime.data import Loader, make_dataset
    net = api.load(NETS["gpt"])
    data = make_dataset(net.graph, net.train.data, 0)
    feeds = dict(zip(data.input_names, Loader(data.train, BATCH, 0).next(), strict=True))
    return net, net.train.optimizer.model_dump(), feeds


def test_the_gate_weighs_a_shards_gradient_against_its_whole():
    """A piece whose gradient is rounding noise alone (tensor=3 cuts a key projection's
    bias, whose gradient is zero mathematically, out of the packed q/k/v bias) is
    compared at the scale of the whole parameter's gradient, not its own noise."""
    from netdsl.runtime.gate import rel
    noise, whole = np.array([2e-19, -1e-19]), np.array([0.5, 2e-19, -1e-19, 0.25])
    assert rel(noise, np.zeros(2)) > 1e100  # (its own scale: 1e-300)
    assert rel(noise, np.zeros(2), whole=whole) == pytest.approx(4e-19)


def test_devices_follow_megatrons_order():
    """Replica r's stage s, tensor rank t on (r * P + s) * T + t: a tensor group's
    collectives join the ranks of one replica and stage, side by side; a shard's gradient
    is summed over the replicas of its stage and rank; `position_of` inverts it."""
    net, opt, _ = setup("transformer")
    spec = SplitSpec(data=2, tensor=2, pipeline=2, microbatches=2)
    g = split_step(net.graph, BATCH, spec, opt)
    for d in range(8):
        pos = position_of(g.meta["split"], d)
        assert device_index(spec, pos["replica"], pos["stage"], pos["tensor_rank"]) == d
    assert [position_of(g.meta["split"], d)["stage"] for d in range(8)] == \
        [0, 0, 1, 1, 0, 0, 1, 1]
    stages = {s["first"]: s["stage"] for s in g.meta["split"]["stages"]}
    assert set(stages.values()) == {0, 1}
    gathers = [n for n in g.nodes if n.op == "all_gather" and n.meta.get("phase") is None
               and n.attrs["index"] == 0]
    assert gathers
    for n in gathers:  # a tensor group: the two ranks of one replica and stage
        a, b = (position_of(g.meta["split"], d) for d in n.attrs["group"])
        assert (a["replica"], a["stage"], a["tensor_rank"]) == \
            (b["replica"], b["stage"], 0) and b["tensor_rank"] == 1
    sums = [n for n in g.nodes if n.op == "all_reduce" and n.meta.get("grad_sync")
            and n.attrs["index"] == 0]
    by_size = {len(n.attrs["group"]) for n in sums}
    assert by_size == {2, 4}  # shards over the replicas; replicated parameters over all
    for n in sums:
        ps = [position_of(g.meta["split"], d) for d in n.attrs["group"]]
        assert len({p["stage"] for p in ps}) == 1  # one stage's parameters
    rep, _ = report(g, 1.0, CPU, SHM)
    assert [d.position for d in rep.per_device] == [position_of(g.meta["split"], d)
                                                    for d in range(8)]
    g.nodes[-1].device = 8  # a node placed outside the layout
    with pytest.raises(SplitCheckError, match=r"device\(s\) \[8\] lie outside the split's 8"):
        check(g, net.graph)


@pytest.mark.parametrize("shard", [0, 3])
def test_predicted_bytes_are_what_the_communicator_sent(shard):
    """Each device's predicted bytes (sends, the tensor groups' and the replicas'
    collectives) are what the in-process communicator counts, to the ring's one-element
    rounding of each collective's parts."""
    net, opt, feeds = setup("transformer")
    spec = SplitSpec(data=2, tensor=2, pipeline=2, microbatches=2, shard=shard)
    g = split_step(net.graph, BATCH, spec, opt)
    rep, _ = report(g, 1.0, CPU, SHM, "f64")
    counted = verify_split(net.graph, BATCH, spec, opt, feeds, split=g).comm_bytes
    for d in rep.per_device:
        assert d.comm_bytes > 0 and abs(counted[d.device] - d.comm_bytes) <= 16 * d.collectives


@pytest.mark.parametrize("shard", [0, 1, 3])
def test_sharded_3d_state_is_held_once(shard):
    """ZeRO over the replicas of each stage and tensor rank: the devices' optimizer state
    adds up to one device's (each element held once) from stage 1, and so does the whole
    state at stage 3; unsharded, every replica holds its stage's and rank's whole share."""
    net, opt, _ = setup("transformer")
    single, _ = report(split_step(net.graph, BATCH, SplitSpec(), opt), 1.0, CPU, SHM)
    spec = SplitSpec(data=2, tensor=2, pipeline=2, microbatches=2, shard=shard)
    rep, _ = report(split_step(net.graph, BATCH, spec, opt), 1.0, CPU, SHM)
    opt_total = sum(d.optimizer_state_bytes for d in rep.per_device)
    state_total = sum(d.state_bytes for d in rep.per_device)
    one = single.per_device[0]
    if shard == 0:  # each of the 2 replicas holds what tensor=2, pipeline=2 holds
        rep1, _ = report(split_step(net.graph, BATCH, SplitSpec(tensor=2, pipeline=2,
                                                                microbatches=2), opt),
                         1.0, CPU, SHM)
        # (but the optimizer's step count, one scalar of 8 bytes, held once either way)
        assert opt_total == 2 * sum(d.optimizer_state_bytes for d in rep1.per_device) - 8
        assert opt_total > 2 * one.optimizer_state_bytes  # (tensor ranks replicate some)
    else:
        assert opt_total == one.optimizer_state_bytes
    if shard == 3:
        assert state_total == one.state_bytes
        # and as the executors allocate it (not the report's count)
        held = Executor(split_step(net.graph, BATCH, spec, opt), "numpy", "f32").state
        alone = Executor(split_step(net.graph, BATCH, SplitSpec(), opt), "numpy", "f32").state
        assert sum(v.nbytes for v in held.values()) == sum(v.nbytes for v in alone.values())
    else:
        assert state_total > one.state_bytes


def test_3d_sharded_checkpoints_are_in_the_single_device_layout():
    """The pieces of tensor shards (ranges of a shard's rows) join into the single-device
    entries, and a single-device state dict loads into them."""
    net, opt, _ = setup("transformer")
    g, _ = round_trip_state(net, opt, SplitSpec(data=2, tensor=2, pipeline=2, shard=3))
    pieces = [n for n in g.nodes if n.op == "param" and Shard.of(n) is not None
              and Shard.of(n).axis == FLAT and n.name.count("@d")]
    assert any(Shard.of(n).lo > 0 for n in pieces)  # pieces of tensor shards' rows


def test_a_piece_of_a_tensor_shard_is_a_range_of_the_whole():
    from netdsl.ir.graph import Node
    w = Node("w@d1", "param", (), TensorType((3, 4), "f64"), {"shape": (3, 4)},
             meta={"shard": (0, 3, 6, (6, 4))})  # rows 3..6 of a [6, 4] weight
    assert flat_piece_shard(w, 2, 7) == (-1, 14, 19, (6, 4))
    whole = np.arange(24.0).reshape(6, 4)
    assert np.array_equal(whole[3:6].reshape(-1)[2:7], whole.reshape(-1)[14:19])
    cols = Node("v@d1", "param", (), TensorType((6, 2), "f64"), {"shape": (6, 2)},
                meta={"shard": (1, 2, 4, (6, 4))})
    with pytest.raises(ValueError, match="not a contiguous range"):
        flat_piece_shard(cols, 0, 3)


def test_shards_gather_every_layer_instead_of_pairing():
    """A pair's second layer is split by input channels, whose pieces would not be ranges
    of its weight: with shards every layer is gathered (unsharded, the pairs stay)."""
    net, opt, _ = setup("transformer")
    plain = split_step(net.graph, BATCH, SplitSpec(data=2, tensor=2, pipeline=2), opt)
    sharded = split_step(net.graph, BATCH, SplitSpec(data=2, tensor=2, pipeline=2, shard=1),
                         opt)
    assert plain.meta["tensor_pairs"] and not sharded.meta["tensor_pairs"]


def test_pins_and_accumulation_with_tensor_ranks_are_refused_by_name():
    """@device(k) is stage k of a pipeline over the devices; with tensor ranks a stage is
    several devices, so the pin cannot mean what it says; micro-batches without a pipeline
    (accumulation) do not combine with tensor ranks."""
    net, opt, _ = setup("vgg")
    g = net.graph.copy()
    next(n for n in g.nodes if n.op == "linear").annotations["device"] = 1
    with pytest.raises(SplitError, match=r"@device\(1\) on %.*each tensor rank of a stage"):
        split_step(g, BATCH, SplitSpec(pipeline=2, tensor=2), opt)
    with pytest.raises(SplitError, match="microbatches apply to pipelines"):
        split_step(net.graph, BATCH, SplitSpec(data=2, tensor=2, microbatches=2), opt)


# -- declaring them ---------------------------------------------------------------------


def test_split_sizes_parse_and_refuse():
    assert split_sizes("data=2,pipeline=2,tensor=2") == {"data": 2, "pipeline": 2, "tensor": 2}
    assert split_sizes("tensor = 2, pipeline = 4, microbatches = 8") == {
        "tensor": 2, "pipeline": 4, "microbatches": 8}
    assert split_sizes("hybrid") is None and split_sizes(None) is None
    for bad, phrase in [("data=2,tensr=2", "`tensr` is not one of"),
                        ("data=2,data=4", "`data` is given twice"),
                        ("tensor=0", "must be a whole number of 1 or more, not '0'"),
                        ("tensor=two", "not 'two'")]:
        with pytest.raises(NetdslError, match=phrase):
            split_sizes(bad)


@pytest.mark.parametrize("opts, phrase", [
    (RunOptions(devices=4, split="data=2,pipeline=2,tensor=2"),
     "splits the step over 8 devices, but --devices is 4"),
    (RunOptions(devices=4, split="spatial=2,tensor=2"), "spatial splits combine with data"),
    (RunOptions(devices=4, split="pipeline=2,tensor=2", shard=1), "has no data replicas"),
    (RunOptions(devices=4, split="data=2,spatial=2", shard=1), "a spatial split"),
    (RunOptions(devices=4, split="pipeline=4,microbatches=4", microbatches=2),
     "give them once"),
    (RunOptions(devices=4, split="tensor=4,microbatches=2"), "microbatches apply to"),
])
def test_3d_options_that_cannot_mean_what_was_asked(opts, phrase):
    with pytest.raises(NetdslError, match=phrase):
        conflicts(opts)


def test_sizes_that_miss_the_ranks_are_a_split_error():
    """Under mpiexec the devices are the ranks, known only once the step is built."""
    with pytest.raises(SplitError, match="over 4 devices, but there are 2 .*mpiexec -n 4"):
        candidates("pipeline=2,tensor=2", 2, BATCH, None, {}, "sync")
    assert candidates("pipeline=2,tensor=2", 4, BATCH, None, {"schedule": "1f1b"}, "sync") \
        == [SplitSpec(pipeline=2, tensor=2, schedule="1f1b")]


def test_3d_options_that_are_fine():
    assert conflicts(RunOptions(devices=8, split="data=2,pipeline=2,tensor=2", shard=3)) == []
    assert conflicts(RunOptions(split="pipeline=2,tensor=2", distributed=True)) == []


def test_split_command_takes_the_sizes_and_reports_positions():
    out = runner.invoke(app, ["split", str(NETS["transformer"]), "--devices", "8", "--batch",
                              "8", "--split", "data=2,pipeline=2,tensor=2", "--shard", "1",
                              "--json"])
    assert out.exit_code == 0, out.output
    j = json.loads(out.output)
    assert (j["data"], j["pipeline"], j["tensor"], j["shard"]) == (2, 2, 2, 1)
    assert [d["position"] for d in j["per_device"]][:4] == [
        {"replica": 0, "stage": 0, "tensor_rank": 0}, {"replica": 0, "stage": 0,
                                                       "tensor_rank": 1},
        {"replica": 0, "stage": 1, "tensor_rank": 0}, {"replica": 0, "stage": 1,
                                                       "tensor_rank": 1}]
    assert all(0 < d["optimizer_state_bytes"] < d["state_bytes"] for d in j["per_device"])
    bad = runner.invoke(app, ["split", str(NETS["transformer"]), "--devices", "4",
                              "--split", "data=2,pipeline=2,tensor=2"])
    assert bad.exit_code != 0 and "Traceback" not in bad.output
    assert "--devices 8" in " ".join(bad.output.split())
    assert j["reason"] is None  # (the sizes asked for: no choice to explain)


def test_a_file_declares_a_sharded_3d_split(tmp_path):
    src = NETS["transformer"].read_text()
    name = next(line for line in src.splitlines() if line.startswith("network "))
    path = tmp_path / "t3d.net"
    path.write_text(src.replace(name, name + "\n    parallel { data = 2; pipeline = 2; "
                                "tensor = 2; shard = 1 }"))
    net = api.load(path)
    assert candidates(None, 8, BATCH, None, dict(net.graph.parallel), "sync") == [
        SplitSpec(data=2, pipeline=2, tensor=2, shard=1, schedule="gpipe")]


# -- auto ------------------------------------------------------------------------------


def test_auto_weighs_3d_splits_with_the_exactness_rule():
    specs = candidates("auto", 8, 16, None, {}, "sync")
    three = [s for s in specs if s.tensor > 1 and s.pipeline > 1]
    assert {(s.data, s.pipeline, s.tensor) for s in three} == {(2, 2, 2), (1, 4, 2),
                                                                (1, 2, 4)}
    assert {(s.pipeline, s.microbatches) for s in three} == {(2, 1), (2, 8), (4, 1), (4, 16)}
    assert not [s for s in candidates("auto", 4, 16, None, {}, "sync")
                if s.tensor > 1 and s.data > 1 and s.pipeline > 1]  # 4 = 2 x 2 at most
    micro = SplitSpec(tensor=2, pipeline=2, microbatches=2)
    assert exact(micro, batch_statistics=False) and not exact(micro, batch_statistics=True)
    assert exact(SplitSpec(data=2, tensor=2, pipeline=2), batch_statistics=True)


def test_auto_with_shards_weighs_the_3d_splits_sharded_alike():
    """--shard S with auto: the data split and the 3-D splits with data replicas, each
    sharded at stage S (on 4 devices there is no 3-D split with replicas)."""
    specs = candidates("auto", 8, 16, None, {}, "sync", shard=1)
    assert specs[0] == SplitSpec(data=8, shard=1, schedule="1f1b")
    assert {(s.data, s.pipeline, s.tensor, s.microbatches, s.shard) for s in specs[1:]} == {
        (2, 2, 2, 1, 1), (2, 2, 2, 8, 1)}
    assert candidates("auto", 4, 16, None, {}, "sync", shard=2) == [
        SplitSpec(data=4, shard=2, schedule="1f1b")]


def _choice(spec: SplitSpec, step: float, fits: bool = True) -> Choice:
    rep = SplitReport("x", spec.devices, [], step, 1.0, 0.0, None, 0, "cpu", "shm", {})
    return Choice(spec, None, rep, fits)


def test_auto_says_why_it_chose_a_3d_split():
    best = _choice(SplitSpec(data=2, pipeline=2, tensor=2), 0.010)
    flat = _choice(SplitSpec(data=8), 0.013)
    big = _choice(SplitSpec(pipeline=8, microbatches=8), 0.009, fits=False)
    why = choice_reason(best, [best, flat, big], 16 * 10**9)
    assert why.startswith("auto chose data=2, pipeline=2, microbatches=1, tensor=2")
    assert "0.01 s a step predicted, against 0.013 s for data=8" in why
    alone = choice_reason(best, [best, big], 16 * 10**9)
    assert "no split of fewer dimensions that computes the same numbers fits 16.00 GB" in alone
    assert choice_reason(flat, [best, flat], 16 * 10**9) is None
    assert choice_reason(best, [best], 16 * 10**9) is None  # asked for, not chosen


def test_a_3d_split_is_planned_into_a_budget_per_device():
    """`run --mem` plans each device's part of a sharded 3-D split (recomputing what does
    not fit) and every device's counted peak stays within the budget."""
    out = runner.invoke(app, ["run", str(NETS["transformer"]), "--devices", "8", "--batch",
                              "16", "--split", "data=2,pipeline=2,tensor=2,microbatches=4",
                              "--shard", "1", "--mem", "1.8MB", "--steps", "1",
                              "--eval-samples", "0", "--json"])
    assert out.exit_code == 0, out.output
    j = json.loads(out.output[out.output.index("{"):])
    plan = j["memory_plan"]
    assert plan["feasible"] and plan["unplanned_peak_bytes"] > 1_800_000
    assert sum(d["recompute"] for d in plan["per_device"].values()) > 0
    assert len(j["peak_by_device"]) == 8
    assert all(0 < v <= 1_800_000 for v in j["peak_by_device"].values())
