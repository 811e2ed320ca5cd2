"""`netdsl plan` and `netdsl calibrate` from the command line: output, JSON keys, exit 3."""
import json
from pathlib import Path

from typer.testing import CliRunner

from netdsl_cli.app import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent
NET = str(ROOT / "examples" / "resnet20-cifar.net")
KEYS = {"budget_bytes", "baseline_peak_bytes", "planned_peak_bytes", "feasible",
        "predicted_step_s", "predicted_overhead", "offload_bytes", "recompute_flops",
        "decisions", "plan_s"}


def plan(*args):
    return runner.invoke(app, ["plan", NET, "--batch", "2", *args])


def test_plan_json_keys_and_fit():
    r = plan("--mem", "5MB", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert KEYS <= set(d)
    assert d["feasible"] and d["planned_peak_bytes"] <= 5 * 10**6 == d["budget_bytes"]
    assert d["baseline_peak_bytes"] > d["budget_bytes"]
    dec = d["decisions"]
    assert {"keep", "recompute", "offload", "by_layer_type", "by_block"} <= set(dec)
    assert dec["offload"] + dec["recompute"] == len(dec["values"]) > 0
    assert "conv" in dec["by_layer_type"]


def test_without_mem_the_budget_is_the_profiles_memory():
    for profile, budget in (("k40-12gb", 12 * 10**9), ("cpu", 24 * 10**9)):
        r = plan("--profile", profile, "--json")
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["budget_bytes"] == budget


def test_plan_table():
    # a device's profile (the default is the CPU's, where offloading frees nothing)
    r = plan("--mem", "5MB", "--strategy", "offload-all", "--profile", "k40-12gb")
    assert r.exit_code == 0, r.output
    for text in ("budget", "peak without a plan", "planned peak", "predicted step",
                 "to / from host", "recomputed", "basic[1..2] x2", "offload"):
        assert text in r.stdout


def test_impossible_budget_exits_3():
    r = plan("--mem", "1MB")
    assert r.exit_code == 3
    assert "smallest budget that works is" in r.stderr and "persistent state" in r.stderr
    r = plan("--mem", "1MB", "--json")
    assert r.exit_code == 3
    d = json.loads(r.stdout)
    assert not d["feasible"] and d["min_feasible_bytes"] > 10**6


def test_bad_inputs_exit_1(tmp_path):
    for args, text in ((["--mem", "12XB"], "unknown unit"),
                       (["--mem", "5MB", "--profile", "p100"], "unknown device profile"),
                       (["--mem", "5MB", "--strategy", "fast"], "unknown strategy")):
        r = plan(*args)
        assert r.exit_code == 1 and text in r.stderr, r.output
        assert "Traceback" not in r.output


def test_calibrate_roundtrip(tmp_path):
    out = tmp_path / "me.json"
    r = runner.invoke(app, ["calibrate", "--json", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["flops_per_s"] > 0
    r = plan("--mem", "6MB", "--profile", str(out), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["profile"] == "calibrated"


def test_plot(tmp_path):
    import pytest
    pytest.importorskip("matplotlib")
    out = tmp_path / "mem.png"
    r = plan("--mem", "5MB", "--plot", str(out))
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_plan_is_verified_by_the_rewrite():
    r = plan("--mem", "5MB", "--json")
    d = json.loads(r.stdout)
    # checked as an arena run holds the rewritten step: its values packed by lifetime
    assert d["planned_peak_bytes"] <= d["verified_peak_bytes"] <= 5 * 10**6
    assert d["verified_peak_bytes"] >= d["state_bytes"] + d["arena_bytes"]


def test_the_smallest_budget_an_error_names_fits():
    """The floor is checked as a run holds the step (the packed arena, and in unified
    memory the batch and the interpreter's objects), so the budget it names plans, and
    a byte less does not."""
    r = plan("--mem", "1MB", "--profile", "cpu", "--json")
    assert r.exit_code == 3
    need = json.loads(r.stdout)["min_feasible_bytes"]
    d = json.loads(plan("--mem", str(need), "--profile", "cpu", "--json").stdout)
    assert d["feasible"] and d["verified_peak_bytes"] <= need
    assert d["outside_plan_bytes"] > 0
    assert plan("--mem", str(need - 1), "--profile", "cpu", "--json").exit_code == 3


def test_every_example_plans_without_an_internal_error():
    """Every example's training step can be planned (the backward ops' cost rules run)."""
    import netdsl
    from netdsl.config import TrainConfig
    from netdsl.memory.search import plan_memory
    from netdsl.step.graphs import training_graph
    for ex in sorted((ROOT / "examples").glob("*.net")):
        if ex.name in ("resnet2504.net", "resnet152.net", "vgg16.net", "resnet1001-cifar.net"):
            continue  # large: covered by the benches
        net = netdsl.load(ex)
        step = training_graph(net.lower(2), net.train or TrainConfig())
        res = plan_memory(step, "1GB", "cpu")
        assert res.planned_peak_bytes > 0, ex.name
