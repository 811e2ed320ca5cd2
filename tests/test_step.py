"""The step layer: one builder of the training step (netdsl/step), the options declared
once (netdsl/options.py) and checked together, and one profile rule for every command."""
import ast
import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

import netdsl
from netdsl.config import TrainConfig
from netdsl.errors import NetdslError
from netdsl.options import RunOptions, StepOptions, conflicts, flag_of
from netdsl.step.build import build_step
from netdsl.step.request import gpu_profile, request_for, resolve_profile
from netdsl_cli.app import app

ROOT = Path(__file__).resolve().parent.parent
RESNET = str(ROOT / "examples" / "resnet20-cifar.net")


# -- the profile rule ----------------------------------------------------------------------

def test_the_profile_is_the_device_the_step_runs_on_unless_named():
    assert resolve_profile(None, None).name == "cpu"  # NumPy
    assert resolve_profile("k40-12gb", None).name == "k40-12gb"
    cfg = TrainConfig(batch=4)
    assert request_for(StepOptions(), cfg).profile.name == "cpu"
    # what plan and split (which do not run the step) plan for: the profile's device
    assert request_for(StepOptions(profile="k40-12gb"), cfg).device_kind == "gpu"
    assert request_for(StepOptions(), cfg).device_kind == "cpu"
    # a step that runs here takes the backend's kernels whatever profile predicts it
    run = request_for(StepOptions(profile="k40-12gb"), cfg, runs=True)
    assert run.device_kind == "cpu" and run.profile.name == "k40-12gb"


class _FakeCupy:
    """A CuPy backend's `xp` as far as the profile rule reads it."""

    def __init__(self, name: bytes, total: int):
        dev = SimpleNamespace(mem_info=(total // 2, total))
        self.cuda = SimpleNamespace(
            runtime=SimpleNamespace(getDeviceProperties=lambda d: {"name": name}),
            Device=lambda d: dev)


def test_on_cupy_the_profile_is_the_detected_gpus():
    be = SimpleNamespace(name="cupy", device=0, xp=_FakeCupy(b"NVIDIA H100 80GB HBM3",
                                                             85_520_809_984))
    p = resolve_profile(None, be)
    assert p.name == "h100-80gb" and p.capacity_bytes == 85_520_809_984 and not p.unified
    assert request_for(StepOptions(backend="cupy"), TrainConfig(), be,
                       runs=True).device_kind == "gpu"


@pytest.mark.parametrize("gpu, total, name, rates", [
    ("NVIDIA H200", 150_109_716_480, "h200", "h200"),
    ("NVIDIA A100-SXM4-40GB", 42_505_273_344, "a100-40gb", "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", 85_099_069_440, "a100-80gb", "a100-40gb"),
    ("Tesla K40m", 12_079_136_768, "k40-12gb", "k40-12gb"),
    ("Tesla V100-SXM2-16GB", 16_945_512_448, "v100-16gb", "v100-16gb"),
    ("NVIDIA GeForce RTX 4090", 25_393_692_672, "nvidia-geforce-rtx-4090-24gb", "h200"),
])
def test_gpu_profiles_take_their_familys_rates_and_their_own_memory(gpu, total, name, rates):
    from netdsl.memory.profiles import PROFILES
    p = gpu_profile(gpu, total)
    assert p.name == name and p.capacity_bytes == total
    assert p.flops_per_s == PROFILES[rates].flops_per_s
    assert gpu in p.source
    if rates == "h200" and name != "h200":
        assert "no built-in profile" in p.source and "calibrate" in p.source


def test_plan_and_run_name_the_same_profile_and_planned_peak():
    """The done-when of the step layer: on one machine, `plan --mem` and `run --mem`
    report the same profile and the same planned peak (they plan the same step)."""
    cmd = [sys.executable, "-m", "netdsl_cli"]
    common = [RESNET, "--batch", "8", "--mem", "20MB", "--json"]
    plan = json.loads(subprocess.run([*cmd, "plan", *common], capture_output=True,
                                     text=True, check=True).stdout)
    run = json.loads(subprocess.run([*cmd, "run", *common, "--steps", "1",
                                     "--eval-samples", "0"], capture_output=True, text=True,
                                    check=True).stdout)
    assert plan["profile"] == run["profile"] == run["memory_plan"]["profile"] == "cpu"
    assert plan["planned_peak_bytes"] == run["planned_peak_bytes"] <= 20_000_000
    assert run["counted_peak_bytes"] <= run["planned_peak_bytes"]


def test_split_names_its_profile():
    r = CliRunner().invoke(app, ["split", RESNET, "--devices", "2", "--split", "data",
                                 "--batch", "4", "--json", "--jobs", "1"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["profile"] == "cpu"
    r = CliRunner().invoke(app, ["split", RESNET, "--devices", "2", "--strategy", "data",
                                 "--batch", "4", "--profile", "k40-12gb", "--jobs", "1"])
    assert r.exit_code == 0, r.output
    assert "on k40-12gb over pcie3" in r.stdout


# -- one builder -------------------------------------------------------------------------

BUILDERS = {"training_graph", "accumulating_step", "split_training_step", "split_step"}


def test_one_place_builds_a_training_step():
    """Outside netdsl/step (and the split machinery that makes the candidates), nothing in
    the library or the CLI calls a step builder: every command goes through build_step.
    The equivalence gate builds, through the step layer's builder, the one-device
    reference it compares a split with."""
    allowed = {ROOT / "netdsl" / "step", ROOT / "netdsl" / "parallel"}
    gate = ROOT / "netdsl" / "runtime" / "gate.py"
    found = []
    for path in [*(ROOT / "netdsl").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]:
        if any(a in path.parents for a in allowed) or path == gate:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                if name in BUILDERS:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert found == []


def test_build_step_gives_run_plan_and_split_their_steps():
    net = netdsl.load(RESNET)
    cfg = TrainConfig(batch=4)
    one = build_step(net.graph, cfg, request_for(StepOptions(), cfg))
    assert one.split is None and one.memory_plan is None and one.fits
    assert one.roles == ("loss", "output", "updates", "logits")  # the loss's logits
    acc = build_step(net.graph, cfg, request_for(StepOptions(microbatches=2), cfg))
    assert acc.split == "microbatches=2" and acc.microbatches == 2
    planned = build_step(net.graph, cfg, request_for(StepOptions(mem="20MB"), cfg))
    assert planned.fits and planned.arena and planned.budget_from == "--mem"
    assert planned.planned_peak_bytes() <= 20_000_000
    split = build_step(net.graph, cfg, request_for(StepOptions(devices=2, split="data",
                                                               jobs=1), cfg))
    assert split.split == "data=2" and split.chosen.best.spec.data == 2
    assert set(split.planned_by_device()) == {0, 1}


# -- options declared once, checked together -----------------------------------------------

def test_every_run_option_is_declared_once_with_its_help():
    r = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "300"})
    assert r.exit_code == 0
    text = " ".join(r.output.split())
    for f in fields(RunOptions):
        if f.name == "interconnect":  # (run's devices are this process's)
            continue
        flag = flag_of(RunOptions, f.name)
        assert (flag.flags or ("--" + f.name.replace("_", "-"),))[0] in text, f.name
        assert " ".join(flag.help.split()[:4]) in text, f.name


@pytest.mark.parametrize("opts, warning", [
    (RunOptions(device=7), "--device 7 has no effect with the NumPy backend"),
    (RunOptions(split="data"), "--split data has no effect on one device"),
    (RunOptions(jobs=2), "--jobs 2 has no effect on one device"),
    (RunOptions(bn="local"), "--bn local has no effect without --devices"),
    (RunOptions(offload_state=True), "--offload-state has no effect without --mem"),
])
def test_an_option_that_does_nothing_is_named(opts, warning):
    assert [w for w in conflicts(opts) if w.startswith(warning)], conflicts(opts)


def test_options_that_mean_something_together_are_quiet():
    assert conflicts(RunOptions(devices=2, split="data", bn="local", jobs=2)) == []
    assert conflicts(RunOptions(microbatches=2, bn="local")) == []
    assert conflicts(RunOptions(mem="1GB", offload_state=True)) == []
    assert conflicts(RunOptions(backend="cupy", device=1)) == []


@pytest.mark.parametrize("opts, error", [
    (RunOptions(steps=1, epochs=1), "give --steps or --epochs, not both"),
    (RunOptions(dtype="f16"), "--dtype must be f32 or f64, not 'f16'"),
    (RunOptions(bn="none"), "--bn must be sync or local"),
    (RunOptions(resume=True), "--resume needs --checkpoint"),
    (RunOptions(devices=2, mem="1GB", offload_state=True), "--offload-state with --devices"),
])
def test_options_that_cannot_go_together_are_refused(opts, error):
    with pytest.raises(NetdslError, match=error):
        conflicts(opts)


def test_the_cli_warns_of_an_option_that_does_nothing():
    r = CliRunner().invoke(app, ["run", str(ROOT / "examples" / "digits-mlp.net"),
                                 "--steps", "1", "--device", "7", "--json",
                                 "--eval-samples", "0"])
    assert r.exit_code == 0, r.output
    warnings = json.loads(r.stdout)["warnings"]
    assert any(w.startswith("--device 7 has no effect") for w in warnings), warnings


def test_plan_takes_offload_state_without_mem():
    """plan plans into the profile's memory when no --mem is given, so --offload-state
    means something there (run without --mem does not plan: warned)."""
    assert conflicts(StepOptions(offload_state=True), budgeted=True) == []
    r = CliRunner().invoke(app, ["plan", RESNET, "--batch", "2", "--offload-state",
                                 "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["warnings"] == []
