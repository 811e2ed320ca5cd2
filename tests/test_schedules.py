"""Pipeline schedules (netdsl.parallel.schedules, order.py): ZB-H1 and interleaved 1F1B
as orderings of the split graph. Their unit-time timelines give the papers' bubble
formulas; the split step's executed order replays to the same bubble; the executor's
measured bubble lies where the schedule puts it given the measured task times; the
float64 gate passes; the options and `parallel { }` refuse what cannot be built."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_split import setup

from netdsl import api
from netdsl.errors import NetdslError, SplitError
from netdsl.options import StepOptions, conflicts
from netdsl.parallel.order import chunks_of
from netdsl.parallel.schedules import formula_bubble, interleaved, one_f_one_b, timeline, zb_h1
from netdsl.parallel.split import SplitSpec, split_step
from netdsl.runtime.data import Loader, make_dataset
from netdsl.runtime.executor import Executor
from netdsl.runtime.gate import verify_split
from netdsl.runtime.timeline import bubble_bounds, measure, pipeline_bubble, replay
from netdsl.step.graphs import split_training_step

CHAIN = Path(__file__).parent / "nets" / "linear-chain.net"
P, M = 4, 8
SCHEDULES = {"gpipe": SplitSpec(pipeline=P, microbatches=M),
             "1f1b": SplitSpec(pipeline=P, microbatches=M, schedule="1f1b"),
             "zb-h1": SplitSpec(pipeline=P, microbatches=M, schedule="zb-h1"),
             "interleaved": SplitSpec(pipeline=P, microbatches=M, schedule="1f1b",
                                      virtual_stages=2)}


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 16), (8, 8)])
def test_unit_timelines_give_the_papers_bubbles(p, m):
    for sched in ("gpipe", "1f1b", "zb-h1"):
        assert timeline(sched, p, m).bubble == pytest.approx(formula_bubble(sched, p, m))
    for v in (2, 3):
        assert timeline("1f1b", p, m, v).bubble == pytest.approx(
            formula_bubble("1f1b", p, m, v))
    # ZB-H1 about a third of 1F1B's bubble time: (p-1) units against 3(p-1)
    assert timeline("zb-h1", p, m).makespan == 3 * m + p - 1
    assert timeline("1f1b", p, m).makespan == 3 * m + 3 * (p - 1)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 5)])
def test_zb_h1_holds_no_more_micro_batches_than_1f1b_at_its_peak(p, m):
    """A micro-batch's activations live from its F to its W (to its B in 1F1B)."""
    def peak(seq, freed_by):
        held = top = 0
        for phase, _, _ in seq:
            held += (phase == "F") - (phase == freed_by)
            top = max(top, held)
        return top
    one = max(peak(s, "B") for s in one_f_one_b(p, m).values())
    assert max(peak(s, "W") for s in zb_h1(p, m).values()) == one == min(p, m)


def test_interleaved_follows_megatron_order():
    """Device s's forwards: micro-batches in groups of p through its chunks s, s + p ..."""
    seq = interleaved(2, 4, 2)
    assert [t for t in seq[0] if t[0] == "F"][:6] == [
        ("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 2, 1), ("F", 0, 2), ("F", 0, 3)]
    assert [t for t in seq[1] if t[0] == "B"][:2] == [("B", 3, 0), ("B", 3, 1)]
    assert len(seq[0]) == 2 * 4 * 2


def chain_step(spec: SplitSpec, batch: int = 2048):
    net = api.load(CHAIN)
    return net, split_training_step(net.graph, batch, spec, net.train.optimizer.model_dump())


def tasks_in_order(g, p):
    """Each device's (phase, chunk, micro-batch) tasks in the order its products run."""
    chunk = chunks_of(g, p)
    seq = {d: [] for d in range(p)}
    for n in g.nodes:
        if n.op.startswith("linear"):
            phase = "F" if n.meta.get("phase") != "backward" else n.meta.get("backward_part",
                                                                            "B")
            t = (phase, chunk[n.name], int(re.search(r"@m(\d+)", n.name).group(1)))
            if not seq[n.device] or seq[n.device][-1] != t:
                seq[n.device].append(t)
    return seq


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_split_steps_order_is_the_schedule(name):
    """Each device runs its tasks in the schedule's order, and the executed order replayed
    with every product taking the same time (each stage's costs equal) has the
    formula's bubble exactly."""
    spec = SCHEDULES[name]
    _, g = chain_step(spec)
    want = {"interleaved": lambda: interleaved(P, M, 2), "zb-h1": lambda: zb_h1(P, M),
            "1f1b": lambda: one_f_one_b(P, M)}.get(name)
    if want is not None:
        assert tasks_in_order(g, P) == want()
    rep = replay(g, [n.name for n in g.nodes],
                 {n.name: 1.0 if n.op.startswith("linear") else 0.0 for n in g.nodes})
    assert pipeline_bubble(g, rep) == pytest.approx(
        formula_bubble(spec.schedule, P, M, spec.virtual_stages), abs=1e-12)


def test_zb_h1_marks_weight_gradients_w_and_input_gradients_b():
    _, g = chain_step(SCHEDULES["zb-h1"])
    parts = {n.op: set() for n in g.nodes if n.meta.get("phase") == "backward"}
    for n in g.nodes:
        if n.meta.get("phase") == "backward":
            parts[n.op].add(n.meta["backward_part"])
    assert parts["linear_grad_weight"] == {"W"} and parts["linear_grad_input"] == {"B"}
    assert parts["send"] == {"B"}  # what the stage before waits for


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_executors_measured_bubble_equals_the_formula(name):
    """Each kernel timed by the executor, the devices' work replayed side by side: the
    measured bubble lies in the interval the measured task times allow around the
    formula (`bubble_bounds`: it holds the formula's whatever the times, and shrinks to
    it as the task times become equal)."""
    spec = SCHEDULES[name]
    net, g = chain_step(spec)
    data = make_dataset(net.graph, net.train.data, 0)
    feeds = dict(zip(data.input_names, Loader(data.train, 2048, 0).next(), strict=True))
    order, durations = measure(Executor(g, "numpy", "f32", 0), feeds, runs=3)
    b = bubble_bounds(g, replay(g, order, durations))
    assert b.low <= b.measured <= b.high, b


@pytest.mark.parametrize("net_name", ["transformer", "resnet20"])
@pytest.mark.parametrize("spec", [
    SplitSpec(pipeline=2, microbatches=4, schedule="zb-h1"),
    SplitSpec(pipeline=4, microbatches=4, schedule="zb-h1"),
    SplitSpec(pipeline=2, microbatches=4, schedule="1f1b", virtual_stages=2),
    SplitSpec(data=2, pipeline=2, microbatches=2, schedule="1f1b", virtual_stages=2)],
    ids=["zb-h1-2", "zb-h1-4", "interleaved-2x2", "hybrid-interleaved"])
def test_gate_passes_for_the_new_schedules(net_name, spec):
    """float64, against one device (resnet20: the same micro-batched step, batchnorm)."""
    net, opt, feeds = setup(net_name)
    r = verify_split(net.graph, 8, spec, opt, feeds)
    assert r.ok and max(r.loss_rel, r.grad_rel, r.state_rel) <= 1e-9, r


def test_the_predictor_ranks_the_schedules_as_their_formulas_do():
    """The simulator runs each order with roofline node times and the link's transfers:
    its bubble is near the formula where the link is fast, so auto can rank orders."""
    from netdsl.memory.profiles import get_profile
    from netdsl.parallel.predict import get_interconnect, report
    bubbles = {}
    for name, spec in SCHEDULES.items():
        _, g = chain_step(spec, 512)
        rep, _ = report(g, 1.0, get_profile("cpu"), get_interconnect("nvlink4"))
        bubbles[name] = rep.bubble
        assert abs(rep.bubble - rep.ideal_bubble) <= 0.06, (name, rep.bubble)
    assert bubbles["zb-h1"] < bubbles["interleaved"] < bubbles["1f1b"]


def test_split_report_gives_the_schedules_formula():
    from netdsl.memory.profiles import get_profile
    from netdsl.parallel.predict import get_interconnect, report
    _, g = chain_step(SCHEDULES["zb-h1"], 256)
    rep, _ = report(g, 1.0, get_profile("cpu"), get_interconnect("shm"))
    assert rep.ideal_bubble == pytest.approx(3 / 27) and rep.detail["schedule"] == "zb-h1"


def test_virtual_stages_refusals():
    net = api.load(CHAIN)
    opt = {"kind": "sgd", "lr": 0.1}
    with pytest.raises(SplitError, match="micro-batches a multiple of the stages; .* has 3 "):
        split_step(net.graph, 12, SplitSpec(pipeline=2, microbatches=3, schedule="1f1b",
                                            virtual_stages=2), opt)
    with pytest.raises(SplitError, match="has schedule gpipe"):
        split_step(net.graph, 8, SplitSpec(pipeline=2, microbatches=2, virtual_stages=2), opt)
    with pytest.raises(SplitError, match=r"into 4 x 10 = 40 chunks, but it has 10 operators; "
                                         "use at most 2 virtual stages"):
        split_step(net.graph, 8, SplitSpec(pipeline=4, microbatches=4, schedule="1f1b",
                                           virtual_stages=10), opt)
    for kw, msg in [(dict(devices=1), "runs on one device"),
                    (dict(devices=2, split="data"), "--split data has no pipeline"),
                    (dict(devices=2, schedule="zb-h1"), "does not combine with --schedule"),
                    (dict(devices=2, shard=1), "give one of them")]:
        with pytest.raises(NetdslError, match=msg):
            conflicts(StepOptions(virtual_stages=2, **kw))
    with pytest.raises(NetdslError, match="--schedule must be gpipe, 1f1b or zb-h1"):
        conflicts(StepOptions(schedule="zigzag"))


def test_parallel_declaration_takes_virtual_stages_with_located_errors(tmp_path):
    src = CHAIN.read_text().replace("    output h\n", "    parallel { SETTINGS }\n    output h\n")
    ok = tmp_path / "ok.net"
    ok.write_text(src.replace("SETTINGS", 'pipeline = 2; microbatches = 4; '
                                         'virtual_stages = 2; schedule = "1f1b"'))
    assert api.load(ok).graph.parallel["virtual_stages"] == 2
    bad = tmp_path / "bad.net"
    bad.write_text(src.replace("SETTINGS", "pipeline = 2; microbatches = 3; "
                                           "virtual_stages = 2"))
    # (line 13, column 48: the setting `virtual_stages`)
    with pytest.raises(NetdslError, match=r"bad.net:13:48: .*virtual_stages \(interleaved 1F1B\) "
                                          "needs .* microbatches a multiple of pipeline"):
        api.load(bad)


def test_auto_weighs_the_other_orders_of_the_pipeline_it_chose_and_says_why():
    """Layers pinned to devices leave auto pipelines alone (interleaving refuses pins):
    it weighs ZB-H1 against the 1F1B it chose, by the predicted step, and says so."""
    from netdsl.memory.profiles import get_profile
    from netdsl.parallel.choose import choose
    from netdsl.parallel.predict import get_interconnect
    net = api.load(CHAIN)
    g = net.graph.copy()
    for k, n in enumerate(n for n in g.nodes if n.op == "linear"):
        n.annotations["device"] = k // 2
    kw = dict(optimizer=net.train.optimizer.model_dump(), profile=get_profile("cpu"),
              link=get_interconnect("shm"), jobs=1)
    chosen = choose(g, 512, "auto", 4, **kw)
    spec = chosen.best.spec
    assert spec.pipeline == 4 and spec.schedule == "zb-h1", spec
    assert re.search(r"ZB-H1 .* bubble \d+\.\d%; against 1F1B .* bubble", chosen.reason)
    # an order asked for is kept
    assert choose(g, 512, "auto", 4, schedule="1f1b", **kw).best.spec.schedule == "1f1b"


@pytest.mark.slow
@pytest.mark.parametrize("order", [["--schedule", "zb-h1"],
                                   ["--schedule", "1f1b", "--virtual-stages", "2"]],
                         ids=["zb-h1", "interleaved"])
def test_two_mpi_ranks_run_the_new_orders_as_one_process_does(tmp_path, order):
    """Each rank runs its nodes in the schedule's order, its recvs blocking: no rank
    waits on a message sent later, and the losses are one process's, bit for bit."""
    pytest.importorskip("mpi4py")
    from test_mpi import MPIEXEC, losses, netdsl
    if MPIEXEC is None:
        pytest.skip("no mpiexec")
    args = ["--steps", "3", "--split", "pipeline", "--microbatches", "4", *order]
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    a = netdsl(*args, "--devices", "2", "--log", str(one))
    b = netdsl(*args, "--log", str(two), ranks=2)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert losses(two) == losses(one)


def test_zb_h1_marks_stay_w_through_the_replicas_gradient_all_reduce():
    net = api.load(CHAIN)
    g = split_step(net.graph, 64, SplitSpec(data=2, pipeline=2, microbatches=2,
                                            schedule="zb-h1"), {"kind": "sgd", "lr": 0.1})
    parts = {n.meta["backward_part"] for n in g.nodes if n.op == "linear_grad_weight"}
    assert parts == {"W"}


def test_split_command_reports_the_schedule_and_refuses_in_words():
    import json

    from typer.testing import CliRunner

    from netdsl_cli.app import app
    runner = CliRunner()
    base = ["split", str(CHAIN), "--devices", "2", "--strategy", "pipeline", "--batch", "64",
            "--microbatches", "4"]
    out = runner.invoke(app, [*base, "--schedule", "zb-h1", "--json"])
    assert out.exit_code == 0, out.output
    d = json.loads(out.output)
    assert d["schedule"] == "zb-h1" and d["ideal_bubble"] == pytest.approx(1 / 13)
    assert 0 < d["bubble"] < 1
    out = runner.invoke(app, [*base, "--virtual-stages", "2"])
    assert out.exit_code == 0 and "its formula (p-1)/(vm+p-1) = 11.1%" in out.output, \
        out.output
    out = runner.invoke(app, [*base, "--virtual-stages", "2", "--schedule", "zb-h1"])
    assert out.exit_code != 0 and "Traceback" not in out.output
    assert "does not combine with --schedule zb-h1" in out.output
