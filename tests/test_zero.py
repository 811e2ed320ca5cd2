"""Sharded data parallelism (ZeRO stages 1 to 3, netdsl.parallel.zero and zero_params): the
float64 gate against one device, each replica's 1/N of the optimizer state (and of the
parameters, stage 3), the bytes the collectives move against plain data parallelism's,
gradients freed at their bucket in stage 2, stage 3's units gathered one ahead and again
for the backward, checkpoints in the single-device layout across shard counts, `auto`
sharding where data parallelism does not fit, and the errors for what it does not
combine with."""
from __future__ import annotations

import json

import numpy as np
import pytest
from test_split import NETS, ROOT, runner, setup

from netdsl import api
from netdsl.errors import NetdslError, SplitError
from netdsl.ir.placement import FLAT, Shard, canonical
from netdsl.memory.plan import device_peaks, make_plan
from netdsl.memory.profiles import get_profile
from netdsl.options import RunOptions, conflicts
from netdsl.parallel.memplan import plan_split
from netdsl.parallel.predict import get_interconnect, report, step_time
from netdsl.parallel.split import SplitSpec, split_forward, split_step
from netdsl.passes.pipeline import run_pipeline
from netdsl.runtime.data import Loader, make_dataset
from netdsl.runtime.executor import Executor
from netdsl.runtime.gate import verify_split
from netdsl_cli.app import app

BATCH = 8
CPU, SHM = get_profile("cpu"), get_interconnect("shm")


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("shard", [1, 2, 3])
@pytest.mark.parametrize("name", ["resnet20", "transformer"])
def test_sharded_step_equals_single_device_step(name, shard, devices):
    """Loss, every gradient piece, and every parameter and optimizer state entry after the
    update (joined from the replicas' pieces) agree with one device to 1e-9 in float64
    (SGD with momentum on ResNet-20, AdamW on the transformer); the collectives move
    what plain data parallelism's all-reduce moves (2 (N - 1) x the parameters' bytes
    in all), and stage 3 a second all-gather more: (N - 1) x the bytes of the units
    whose backward reads their parameters (not an embedding's, nor a first convolution's)."""
    net, opt, feeds = setup(name)
    spec = SplitSpec(data=devices, shard=shard)
    g = split_step(net.graph, BATCH, spec, opt)
    r = verify_split(net.graph, BATCH, spec, opt, feeds, split=g)
    assert r.ok, (r.worst, r.loss_rel, r.grad_rel, r.state_rel, r.first_divergence)
    plain = verify_split(net.graph, BATCH, SplitSpec(data=devices), opt, feeds)
    again = sum(n.type.numel() for n in g.nodes if n.op == "all_gather"
                and n.attrs["index"] == 0 and n.meta.get("phase") == "backward"
                and n.name.startswith("unit"))
    params = sum(p.type.numel() for p in net.graph.params())
    assert (shard < 3 and again == 0) or 0.8 * params <= again < params
    extra = (devices - 1) * again * 8  # float64
    assert sum(r.comm_bytes.values()) == sum(plain.comm_bytes.values()) + extra


def _optimizer_state(g) -> dict[int, int]:
    out: dict[int, int] = {}
    for n in g.nodes:
        if n.op == "buffer" and n.attrs.get("role") == "optimizer_state":
            out[n.device or 0] = out.get(n.device or 0, 0) + n.type.nbytes()
    return out


@pytest.mark.parametrize("name", ["resnet20", "transformer"])
def test_each_replica_holds_its_share_of_the_optimizer_state(name):
    """Each replica's optimizer state is 1/N of one device's (its ranges of every bucket:
    even to one element a bucket), the pieces are ranges of the flattened entries, and
    the report's per-device state bytes say so."""
    net, opt, _ = setup(name)
    single = _optimizer_state(split_step(net.graph, BATCH, SplitSpec(), opt))[0]
    for devices in (2, 4):
        g = split_step(net.graph, BATCH, SplitSpec(data=devices, shard=1), opt)
        mine = _optimizer_state(g)
        assert sum(mine.values()) == single
        buckets = len(g.meta["zero"]["buckets"])
        itemsize = 4 * (2 if name == "transformer" else 1)  # adam: two slots an element
        assert max(mine.values()) - single / devices <= buckets * itemsize + 8  # (adam's step)
        pieces = [n for n in g.nodes if n.attrs.get("role") == "optimizer_state"
                  and n.type.shape]
        assert all(Shard.of(n).axis == FLAT for n in pieces)
        rep, _ = report(g, 1.0, CPU, SHM)
        assert {d.device: d.optimizer_state_bytes for d in rep.per_device} == mine
        plain, _ = report(split_step(net.graph, BATCH, SplitSpec(data=devices), opt), 1.0,
                          CPU, SHM)
        # (adam's step counter is counted once, on device 0)
        assert all(single - 8 <= d.optimizer_state_bytes <= single for d in plain.per_device)
        assert all(a.comm_bytes == b.comm_bytes or abs(a.comm_bytes - b.comm_bytes) <= 64
                   for a, b in zip(rep.per_device, plain.per_device, strict=True))


def _step(fwd, opt, shard: int, bucket_bytes: int):
    """A data=2 step of `fwd` at batch 2 with buckets of `bucket_bytes`."""
    o = dict(opt)
    kind = o.pop("kind")
    sync = [("shard_gradients", {"stage": shard, "bucket_bytes": bucket_bytes})] if shard \
        else [("sync_gradients", {"bucket_bytes": bucket_bytes})]
    return run_pipeline(split_forward(fwd, 2, SplitSpec(data=2)),
                        ["autodiff", *sync, ("optimizer", {"kind": kind, **o}),
                         *(["gather_parameters"] if shard else [])])


def test_stage_2_frees_each_gradient_at_its_bucket():
    """Stage 1 reduce-scatters after the whole backward pass, holding every gradient to
    its end; stage 2 reduce-scatters each bucket as soon as it is complete, so the full
    gradients die there and the planned peak (the transformer at batch 2, where the
    state is most of it) falls from stage 0 to 1 to 2."""
    net, opt, _ = setup("transformer")
    peaks, lasts = {}, {}
    for shard in (0, 1, 2):
        g = _step(net.graph, opt, shard, 200_000)
        peaks[shard] = max(device_peaks(g, make_plan(g, ("loss", "updates"))).values())
        if shard:
            pos = {n.name: k for k, n in enumerate(g.nodes)}
            rs = [pos[n.name] for n in g.nodes if n.op == "reduce_scatter"]
            backward = max(k for k, n in enumerate(g.nodes)
                           if n.meta.get("phase") == "backward" and "grad_sync" not in n.meta)
            lasts[shard] = (min(rs), backward, len(g.meta["zero"]["buckets"]))
    assert peaks[2] < peaks[1] < peaks[0], peaks
    assert lasts[1][0] > lasts[1][1]  # stage 1: after the backward pass
    assert lasts[2][0] < lasts[2][1] and lasts[2][2] > 2  # stage 2: during it


def test_checkpoints_resume_on_another_shard_count_exactly(tmp_path):
    """A run sharded over 4 devices saves the single-device layout (whole momentum
    buffers): resumed on one device, on 2 sharded ones and on 4 unsharded, the runs
    continue as one device's run (float64, to the rounding of the sums' order)."""
    net = str(ROOT / "examples" / "digits-cnn.net")
    common = ["--batch", "8", "--seed", "3", "--dtype", "f64", "--json", "--eval-samples", "0"]
    base = json.loads(runner.invoke(app, ["run", net, "--steps", "4", *common]).output)
    ck = tmp_path / "ck"
    first = runner.invoke(app, ["run", net, "--devices", "4", "--shard", "1", "--steps", "2",
                                "--checkpoint", str(ck), *common])
    assert first.exit_code == 0, first.output
    with np.load(ck / "checkpoint.npz") as saved:  # whole entries, single-device names
        loaded = api.load(net)
        single = Executor(split_step(loaded.graph, 8, SplitSpec(),
                                     loaded.train.optimizer.model_dump()), "numpy", "f64")
        spec = single.state_spec()
        moments = [k for k in spec if k.endswith(("exp_avg", "exp_avg_sq"))]
        assert moments and all(saved[f"state/{k}"].shape == spec[k][0] for k in moments)
    runs = ([], ["--devices", "2", "--shard", "2"], ["--devices", "4", "--split", "data"],
            ["--devices", "2", "--shard", "3"])
    for k, extra in enumerate(runs):
        again = tmp_path / f"ck{k}"
        again.mkdir()
        for f in ck.iterdir():
            (again / f.name).write_bytes(f.read_bytes())
        out = runner.invoke(app, ["run", net, "--steps", "4", "--resume", "--checkpoint",
                                  str(again), *extra, *common])
        assert out.exit_code == 0, out.output
        r = json.loads(out.output)
        assert r["resumed_from"] == 2, extra
        assert r["final_loss"] == pytest.approx(base["final_loss"], rel=1e-12), extra


def round_trip_state(net, opt, spec: SplitSpec):
    """`spec`'s step and an executor of it, whose state in the single-device layout is
    one device's at the start and takes a single-device state dict back."""
    g = split_step(net.graph, BATCH, spec, opt)
    ex = Executor(g, "numpy", "f64", seed=3)
    single = Executor(split_step(net.graph, BATCH, SplitSpec(), opt), "numpy", "f64", seed=3)
    a, b = ex.state_dict(), single.state_dict()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    b = {k: v + np.arange(v.size).reshape(v.shape) for k, v in b.items()}
    ex.load_state_dict(b)
    assert all(np.array_equal(ex.state_dict()[k], b[k]) for k in b)
    return g, ex


def test_state_dict_joins_the_pieces_and_loads_them():
    """The executor's state in the single-device layout: the pieces joined into whole
    entries, equal to one device's at the start; loaded back by range."""
    net, opt, _ = setup("transformer")
    g, ex = round_trip_state(net, opt, SplitSpec(data=4, shard=2))
    pieces = [x for x in ex.layout if len(ex.layout[x]) > 1
              and Shard.of(g[ex.layout[x][0]]) is not None]
    assert pieces and all(canonical(ex.layout[x][0]) == x for x in pieces)


def test_clipping_the_gradient_norm_over_pieces():
    """--clip-grad-norm: each replica sums the squares of its pieces, one all-reduce adds
    them, and the step is still one device's (float64 gate)."""
    net, opt, feeds = setup("resnet20")
    opt = dict(opt, clip_grad_norm=0.01)
    r = verify_split(net.graph, BATCH, SplitSpec(data=2, shard=1), opt, feeds)
    assert r.ok, (r.worst, r.grad_rel, r.state_rel)


def test_accumulating_replicas_shard_too():
    """Replicas accumulating micro-batches reduce-scatter the accumulated gradients."""
    net, opt, feeds = setup("transformer")
    r = verify_split(net.graph, BATCH, SplitSpec(data=2, microbatches=2, schedule="1f1b",
                                                 shard=2), opt, feeds)
    assert r.ok, (r.worst, r.grad_rel, r.state_rel)


def test_auto_shards_the_data_split_only_where_it_does_not_fit():
    """auto weighs the data split with its state sharded at each stage, but takes one
    only where the replicated data split does not fit a device, nor (with --mem) once
    planned (`candidates.needless`), and says why; the sharded splits rank as exact."""
    from netdsl.parallel.choose import choose
    net = api.load(NETS["resnet20"])
    kw = dict(batch=16, strategy="auto", devices=4,
              optimizer=net.train.optimizer.model_dump(), profile=CPU, link=SHM, jobs=1)
    free = choose(net.graph, **kw)
    assert free.best.spec == SplitSpec(data=4, schedule="1f1b") and free.reason is None
    sharded = {c.spec.shard: c for c in free.considered if c.spec.data == 4}
    assert set(sharded) == {0, 1, 2, 3} and all(c.exact and c.fits for c in sharded.values())
    peaks = {s: max(d.peak_bytes for d in c.report.per_device) for s, c in sharded.items()}
    assert peaks[3] < peaks[2] <= peaks[1] < peaks[0]
    tight = choose(net.graph, **dict(kw, mem=peaks[0] - 1))
    assert tight.best.spec.data == 4 and tight.best.spec.shard >= 1 and tight.best.exact
    assert tight.reason.startswith(f"auto sharded the replicas' state (ZeRO stage "
                                   f"{tight.best.spec.shard}): data=4 needs ")
    assert f"({peaks[0]:,} bytes) on a device, more than" in tight.reason
    # with --mem the data split is planned first (recomputing activations): what stops it
    # fitting here is not its state, so it is not sharded
    out = runner.invoke(app, ["split", str(NETS["resnet20"]), "--devices", "4", "--batch",
                              "16", "--profile", "cpu", "--interconnect", "shm", "--jobs",
                              "1", "--mem", str(peaks[0] - 1), "--json"])
    assert out.exit_code == 0, out.output
    j = json.loads(out.output)
    assert j["spec"] == "data=4" and j["memory_plan"] is not None and j["reason"] is None
    plain = {d["device"]: d["optimizer_state_bytes"] for d in j["per_device"]}
    out = runner.invoke(app, ["split", str(NETS["resnet20"]), "--devices", "4", "--batch",
                              "16", "--shard", "2", "--json"])
    j = json.loads(out.output)
    assert j["spec"] == "data=4, shard=2" and j["shard"] == 2
    assert all(abs(4 * d["optimizer_state_bytes"] - plain[d["device"]]) <= 4 * 4
               and d["optimizer_state_bytes"] < d["state_bytes"] for d in j["per_device"])


@pytest.mark.parametrize("opts, phrase", [
    (RunOptions(shard=1), "the step runs on one device"),
    (RunOptions(shard=2, devices=2, split="pipeline"), "does not combine with --split "
                                                        "pipeline"),
    (RunOptions(shard=4, devices=2), "--shard must be 0"),
    (RunOptions(shard=1, devices=2, precision="bf16"), "does not combine with --precision"),
])
def test_shard_options_that_cannot_mean_what_was_asked(opts, phrase):
    with pytest.raises(NetdslError, match=phrase):
        conflicts(opts)


def test_shard_with_another_split_is_a_split_error():
    net, opt, _ = setup("resnet20")
    with pytest.raises(SplitError, match="does not combine with yet|no data split"):
        split_step(net.graph, BATCH, SplitSpec(pipeline=2, shard=1), opt)
    with pytest.raises(SplitError, match="f16 does not combine with --shard"):
        split_step(net.graph, BATCH, SplitSpec(data=2, shard=1), opt, precision="f16")
    out = runner.invoke(app, ["run", str(NETS["resnet20"]), "--devices", "2", "--split",
                              "tensor", "--shard", "1", "--steps", "1"])
    assert out.exit_code != 0 and "Traceback" not in out.output
    assert "does not combine with --split tensor" in " ".join(out.output.split())


def test_predicted_bytes_equal_the_counted_bytes():
    """What the report predicts each device sends (the ring's lower bound of every
    reduce-scatter and all-gather) is what the in-process communicator counts."""
    net, opt, feeds = setup("transformer")
    spec = SplitSpec(data=4, shard=2)
    g = split_step(net.graph, BATCH, spec, opt)
    r = verify_split(net.graph, BATCH, spec, opt, feeds, split=g)
    rep, _ = report(g, step_time(split_step(net.graph, BATCH, SplitSpec(), opt), CPU, SHM),
                    CPU, SHM, "f64")
    predicted = {d.device: d.comm_bytes for d in rep.per_device}
    # the ring moves 2 (N - 1) x each bucket's bytes in all, as an all-reduce of it does
    buckets = sum(g[n.inputs[0]].type.numel() for n in g.nodes
                  if n.op == "reduce_scatter" and n.attrs["index"] == 0)
    sends = sum(8 * g[n.inputs[0]].type.numel() for n in g.nodes if n.op == "send")
    assert sum(r.comm_bytes.values()) == sum(predicted.values()) == \
        2 * 3 * buckets * 8 + sends
    # each device's own share: the parts are even to one element
    assert all(abs(predicted[d] - r.comm_bytes[d]) <= 8 * 4 for d in predicted)


def test_stage_3_gathers_each_unit_one_ahead_and_again_for_the_backward():
    """Each replica holds 1/N of every parameter (pieces of axis FLAT); each unit (a
    layer's parameters) is all-gathered before the previous unit's layer runs, no
    backward node reads the forward's gathered parameters (each unit is gathered again,
    in the backward phase, before its layer's backward, where that reads them), and the
    planned peak falls below stage 2's."""
    net, opt, _ = setup("transformer")
    g = split_step(net.graph, BATCH, SplitSpec(data=4, shard=3), opt)
    params = [n for n in g.nodes if n.op == "param"]
    assert params and all(Shard.of(n).axis == FLAT for n in params)
    held: dict[int, int] = {}
    for n in params:
        held[n.device] = held.get(n.device, 0) + n.type.numel()
    whole = sum(p.type.numel() for p in net.graph.params())
    units = g.meta["zero"]["buckets"]
    assert sum(held.values()) == whole and max(held.values()) - whole / 4 <= len(units)
    pos = {n.name: k for k, n in enumerate(g.nodes)}
    gathers = [n for n in g.nodes if n.op == "all_gather" and n.attrs["index"] == 0
               and ".all_gather" in n.name and n.name.startswith("unit")]
    forward = [n for n in gathers if n.meta.get("phase") is None]
    backward = [n for n in gathers if n.meta.get("phase") == "backward"]
    # (a unit whose backward does not read it, an embedding's, is not gathered again)
    assert len(forward) == len(units) and 0.8 * len(units) <= len(backward) < len(units)
    wholes = {w for u in units for per in u["whole"] for w in per}
    readers = {w: [r for r in g.nodes if w in r.inputs] for w in wholes}
    assert all(r.meta.get("phase") != "backward" for rs in readers.values() for r in rs)
    layers = sorted(min(pos[r.name] for w in per for r in readers[w])
                    for u in units for per in u["whole"][:1])
    starts = sorted(pos[n.name] for n in forward)
    assert all(s < layer for s, layer in zip(starts[1:], layers, strict=False))
    peaks = {s: max(device_peaks(x, make_plan(x, ("loss", "updates"))).values())
             for s in (2, 3) for x in [split_step(net.graph, BATCH, SplitSpec(data=4, shard=s),
                                                  opt)]}
    assert peaks[3] < peaks[2]


def _alive_at_once(g, device: int) -> int:
    """The most gathered unit elements alive at once on `device`: each unit's all-gather
    output lives until the last reader of the parameters cut out of it."""
    order = [n.name for n in g.nodes]
    pos = {name: k for k, name in enumerate(order)}
    readers: dict[str, list[str]] = {}
    for n in g.nodes:
        for i in n.inputs:
            readers.setdefault(i, []).append(n.name)
    spans = []
    for n in g.nodes:
        if n.op == "all_gather" and n.device == device and n.name.startswith("unit"):
            last, todo = pos[n.name], [n.name]
            while todo:  # through the slices and reshapes that cut the parameters out
                for r in readers.get(todo.pop(), ()):
                    last = max(last, pos[r])
                    if g[r].op in ("slice", "reshape"):
                        todo.append(r)
            spans.append((pos[n.name], last, n.type.numel()))
    return max(sum(s for a, z, s in spans if a <= k <= z) for k, _, _ in spans)


def test_shard_unit_makes_each_block_instance_one_unit():
    """`@shard_unit` on a statement in a `repeat` makes each copy's parameters one unit
    (a whole decoder layer gathered by one all-gather), the float64 gate passes with
    those units at 2 and 4 replicas, and the gathered elements alive at once follow the
    unit: at least a whole layer and at most two units with `@shard_unit`, less than one
    layer with the default per-layer units (gpt-tiny, the same network unannotated)."""
    units_net, tiny = api.load(ROOT / "tests" / "nets" / "gpt-units.net"), \
        api.load(ROOT / "examples" / "gpt-tiny.net")
    layer = sum(p.type.numel() for p in tiny.graph.params() if ".decoder_layer." in p.name
                and ".decoder_layer[" not in p.name)
    assert layer == 49_984
    opt = units_net.train.optimizer.model_dump()
    data = make_dataset(units_net.graph, units_net.train.data, 0)
    feeds = dict(zip(data.input_names, Loader(data.train, BATCH, 0).next(), strict=True))
    for devices in (2, 4):
        spec = SplitSpec(data=devices, shard=3)
        g = split_step(units_net.graph, BATCH, spec, opt)
        r = verify_split(units_net.graph, BATCH, spec, opt, feeds, split=g)
        assert r.ok, (r.worst, r.loss_rel, r.grad_rel, r.state_rel, r.first_divergence)
    sizes = {p.name: p.type.numel() for p in units_net.graph.params()}
    units = [sum(sizes[k] for k in u["params"]) for u in g.meta["zero"]["buckets"]]
    assert units.count(layer) == 2 and len(units) == 6  # + embedding, table, norm, head
    annotated = _alive_at_once(g, 0)
    assert layer <= annotated <= 2 * max(units)
    g = split_step(tiny.graph, BATCH, SplitSpec(data=4, shard=3), tiny.train.optimizer
                   .model_dump())
    assert len(g.meta["zero"]["buckets"]) > 6 and _alive_at_once(g, 0) < layer


@pytest.mark.slow
def test_auto_weighs_shards_against_planning_on_time_where_the_state_is_the_peak():
    """Where the replicated data split's state is most of its peak (gpt-tiny with AdamW,
    not resnet20 with SGD: `state_bound`), a shard stage that fits as it is competes with
    the planned splits on predicted step time, and auto takes the fastest exact split
    that fits, saying whether sharding won and against what (resnet20 keeps planning the
    data split first: test_auto_shards_the_data_split_only_where_it_does_not_fit)."""
    from netdsl.parallel.candidates import state_bound
    from netdsl.parallel.choose import choose
    tiny, r20 = api.load(ROOT / "examples" / "gpt-tiny.net"), api.load(NETS["resnet20"])

    def chosen(net, **extra):
        return choose(net.graph, batch=16, strategy="auto", devices=4, profile=CPU, link=SHM,
                      optimizer=net.train.optimizer.model_dump(), jobs=1, **extra)
    plain = {n: next(c for c in chosen(net).considered if c.spec.describe() == "data=4")
             for n, net in (("tiny", tiny), ("r20", r20))}
    assert state_bound(plain["tiny"]) and not state_bound(plain["r20"])
    need = max(d.peak_bytes for d in plain["tiny"].report.per_device)
    for mem in (need * 4 // 5, need * 3 // 4):
        ch = chosen(tiny, mem=mem, plan=True)
        fitting = [c for c in ch.considered if c.fits and c.exact]
        assert ch.best.report.predicted_step_s == min(c.report.predicted_step_s
                                                      for c in fitting)
        assert ch.best.spec.shard and ch.reason.startswith(
            f"auto sharded the replicas' state (ZeRO stage {ch.best.spec.shard}): data=4 "
            f"needs ")
        assert "s a step, it beats " in ch.reason
    # unplanned, with room for stage 3 only: the pipeline is faster, and auto says so
    ch = chosen(tiny, mem=need * 3 // 4)
    assert ch.best.spec.pipeline > 1 and not ch.best.spec.shard
    assert ch.reason.startswith(f"sharded data parallelism does not beat "
                                f"{ch.best.spec.describe()}: the fastest shard stage "
                                f"that fits, data=4, shard=3 (")


@pytest.mark.slow
def test_offload_state_streams_each_devices_pieces_from_its_host():
    """ZeRO-Offload (`--offload-state` with `--shard` over `--devices`): under a budget no
    plan of the sharded split fits with its optimizer state on the devices, each device's
    state pieces live in its host's memory, copied in before their update and written
    back after it; the planned step passes the float64 gate against one device. The
    option takes --shard (a split without it, or over MPI, is refused)."""
    from netdsl.parallel.choose import choose
    net, opt, feeds = setup("transformer")
    kw = dict(batch=BATCH, strategy="data", devices=2, optimizer=opt, shard=1, jobs=1,
              profile=get_profile("k40-12gb"), link=SHM, mem=4_000_000, plan=True,
              float_dtype="f64")
    with pytest.raises(SplitError, match="no split onto 2 device"):
        choose(net.graph, **kw)
    best = choose(net.graph, **kw, offload_state=True).best
    g = best.graph
    hosted = [n for n in g.nodes if n.op == "buffer" and n.meta.get("space") == "host"
              and n.attrs.get("role") == "optimizer_state"]
    back = [n for n in g.nodes if n.op == "to_host_into"]
    assert {n.device for n in hosted} == {0, 1} and len(back) == len(hosted)
    assert all(Shard.of(n).axis == FLAT for n in hosted)  # (the replicas' pieces)
    r = verify_split(net.graph, BATCH, best.spec, opt, feeds, split=g)
    assert r.ok, (r.worst, r.loss_rel, r.grad_rel, r.state_rel, r.first_divergence)
    # a step counter read by its increment alone (the fused step) is not streamed: the
    # search once offloaded it with no copy in, and its cost model failed on the read
    one = split_step(net.graph, BATCH, SplitSpec(), opt)
    _, res = plan_split(one, 2_265_858, get_profile("k40-12gb"), "f64", offload_state=True)
    assert res.state_offloaded > 0 and res.decisions.get("optimizer.step") is None
    args = ["split", str(NETS["transformer"]), "--devices", "2", "--shard", "1", "--batch",
            "8", "--mem", "2.2MB", "--profile", "k40-12gb", "--jobs", "1", "--json"]
    assert runner.invoke(app, args).exit_code == 3  # (no plan fits with the state held)
    out = runner.invoke(app, [*args, "--offload-state"])
    assert out.exit_code == 0, out.output
    j = json.loads(out.output)
    assert j["spec"] == "data=2, shard=1" and all(
        d["peak_bytes"] <= 2_200_000 and d["offload"] > 0
        for d in j["memory_plan"]["per_device"].values())
    assert conflicts(RunOptions(devices=2, shard=1, mem="4MB", offload_state=True)) == []
    for opts in (RunOptions(devices=2, mem="4MB", offload_state=True),
                 RunOptions(distributed=True, shard=1, mem="4MB", offload_state=True)):
        with pytest.raises(NetdslError, match="but for a sharded data split"):
            conflicts(opts)
