"""`netdsl run`'s edges: checks before the first step, paths relative to the file,
resume past --steps, useless option combinations, the learning rate's dtype, non-finite
losses in words (no NumPy warnings), the first-step ETA, and init in the training dtype."""
from __future__ import annotations

import io
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import netdsl
from netdsl.errors import NetdslError
from netdsl.ir.graph import Node
from netdsl.ir.types import TensorType
from netdsl.runtime.executor import init_value
from netdsl.runtime.options import RunOptions
from netdsl.runtime.trainer import Callback, Trainer

ROOT = Path(__file__).resolve().parents[1]

TINY = """
network tiny {
    input x: f32[N, 6]
    input y: i64[N]
    logits = linear(relu(linear(x, 8)), 3)
    output logits
    loss softmax_cross_entropy(logits, y)
}
train { data = synthetic(samples=32, test_samples=8); batch = 8; steps = 3 }
"""


@pytest.fixture
def tiny(tmp_path):
    p = tmp_path / "tiny.net"
    p.write_text(TINY)
    return netdsl.load(p)


class Spy(Callback):
    def __init__(self):
        self.steps = 0

    def on_step(self, record):
        self.steps += 1


def _fails_before_training(net, **kw) -> str:
    spy = Spy()
    with pytest.raises(NetdslError) as info:
        Trainer(net.graph, net.train, RunOptions(**kw), spy).fit()
    assert spy.steps == 0
    return info.value.message


def test_a_checkpoint_path_that_is_a_file(tiny, tmp_path):
    f = tmp_path / "ck"
    f.write_text("x")
    assert "is a file, not a directory" in _fails_before_training(tiny, checkpoint=str(f))


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_unwritable_checkpoint_folder(tiny, tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        assert "not writable" in _fails_before_training(tiny, checkpoint=str(d / "ck"))
    finally:
        d.chmod(0o700)


def test_a_checkpoint_is_not_replaced_by_a_run_that_forgot_resume(tiny, tmp_path):
    """A folder that holds a checkpoint: a fresh run is refused before it starts (its first
    save would replace the trained state), and says how to go on; --overwrite starts over."""
    from netdsl.runtime import checkpoint
    ck = tmp_path / "ck"
    Trainer(tiny.graph, tiny.train, RunOptions(steps=2, checkpoint=str(ck))).fit()
    msg = _fails_before_training(tiny, steps=1, checkpoint=str(ck))
    assert msg == (f"--checkpoint {ck} already holds a checkpoint (network `tiny`, step 2); "
                   "give --resume to go on from it, --overwrite to start over and replace "
                   "it, or another directory")
    assert checkpoint.load(ck)[1]["step"] == 2
    Trainer(tiny.graph, tiny.train, RunOptions(steps=1, checkpoint=str(ck),
                                               overwrite=True)).fit()
    assert checkpoint.load(ck)[1]["step"] == 1
    for bad in ({"overwrite": True}, {"overwrite": True, "resume": True,
                                      "checkpoint": str(ck)}):
        with pytest.raises(NetdslError, match="--overwrite"):
            Trainer(tiny.graph, tiny.train, RunOptions(steps=1, **bad))


def test_a_log_that_cannot_be_written(tiny, tmp_path):
    msg = _fails_before_training(tiny, log=str(tmp_path / "no" / "such" / "dir" / "x.log"))
    assert "--log" in msg and "cannot be written" in msg
    assert "is a directory" in _fails_before_training(tiny, log=str(tmp_path))


def test_a_missing_data_file_fails_before_set_up(tmp_path):
    p = tmp_path / "n.net"
    p.write_text(TINY.replace("synthetic(samples=32, test_samples=8)", 'npz(path="d.npz")'))
    net = netdsl.load(p)
    assert "does not exist" in _fails_before_training(net)


def test_data_paths_are_relative_to_the_file(tmp_path, monkeypatch):
    sub = tmp_path / "project"
    sub.mkdir()
    rng = np.random.default_rng(0)
    np.savez(sub / "d.npz", x=rng.standard_normal((16, 6)).astype(np.float32),
             y=rng.integers(0, 3, 16))
    (sub / "n.net").write_text(TINY.replace("synthetic(samples=32, test_samples=8)",
                                            'npz(path="d.npz")'))
    monkeypatch.chdir(tmp_path)  # not the file's folder
    net = netdsl.load("project/n.net")
    assert net.train.data.path == str((sub / "d.npz").resolve())
    assert Trainer(net.graph, net.train, RunOptions(steps=2)).fit().steps == 2


def test_resume_past_the_last_step_trains_nothing(tiny, tmp_path):
    ck = str(tmp_path / "ck")
    Trainer(tiny.graph, tiny.train, RunOptions(steps=3, checkpoint=ck)).fit()
    r = Trainer(tiny.graph, tiny.train, RunOptions(steps=2, checkpoint=ck, resume=True)).fit()
    assert r.final_loss is None and r.steps == 3 and "nothing to train" in r.note
    out = subprocess.run([sys.executable, "-m", "netdsl_cli", "run", str(tmp_path / "tiny.net"),
                          "--steps", "2", "--checkpoint", ck, "--resume"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "nothing to train" in out.stdout and "nan" not in out.stdout.lower()


def test_useless_option_combinations(tiny):
    assert "--checkpoint-every needs --checkpoint" in _fails_before_training(
        tiny, checkpoint_every=1)
    r = Trainer(tiny.graph, tiny.train, RunOptions(steps=1, device=1)).fit()
    assert any("--device 1 has no effect" in w for w in r.warnings)


@pytest.mark.parametrize("dtype,np_dtype", [("f32", np.float32), ("f64", np.float64)])
def test_the_learning_rate_is_fed_at_the_executor_dtype(tiny, dtype, np_dtype):
    t = Trainer(tiny.graph, tiny.train, RunOptions(steps=1, dtype=dtype))
    seen = []
    run = t.executor.run

    def spy(feeds, **kw):
        seen.append(feeds["lr"])
        return run(feeds, **kw)
    t.executor.run = spy
    t.fit()
    assert seen and all(type(v) is np_dtype for v in seen)


def test_a_non_finite_loss_names_the_first_node_and_warns_nothing(tmp_path):
    p = tmp_path / "blow.net"
    p.write_text(TINY.replace("steps = 3", "steps = 20; optimizer = sgd(lr=1e30)"))
    net = netdsl.load(p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a leaked RuntimeWarning fails the test
        with pytest.raises(NetdslError) as info:
            Trainer(net.graph, net.train, RunOptions()).fit()
    msg = info.value.message
    assert msg.startswith("the loss became NaN or Inf at step") or \
        msg.startswith("the logits became NaN or Inf at step"), msg
    assert "the first non-finite value: " in msg and "%" in msg  # a node, by name
    assert info.value.loc is not None and info.value.loc.line > 1


def test_the_eta_is_estimated_after_the_first_step():
    from rich.console import Console

    from netdsl_cli.run_cmd import _Bar
    bar = _Bar(quiet=False)
    buf = io.StringIO()
    bar.err = Console(file=buf, width=200)
    bar.on_start({"network": "n", "params": 1, "backend": "numpy", "device": "cpu",
                  "batch": 8, "dataset": "synthetic", "train_samples": 8,
                  "planned_peak_bytes": 1, "start_step": 0, "total_steps": 101})
    rec = {"loss": 1.0, "images_per_s": 1.0, "total_steps": 101}
    bar.on_step({**rec, "step": 1, "step_time_s": 5.0})  # set-up: 50x a later step
    assert "ETA" not in buf.getvalue()
    bar.on_step({**rec, "step": 2, "step_time_s": 0.1})
    bar.close()
    assert "ETA about 10 s" in buf.getvalue()  # 99 steps x 0.1 s, not 99 x 5 s


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("init", ["kaiming_normal", "kaiming_uniform", "normal", "zeros"])
def test_parameters_are_initialised_in_the_training_dtype(dtype, init):
    n = Node("w", "param", (), TensorType((256, 64)), {"init": init, "fan_in": 64})
    v = init_value(n, dtype, seed=0)
    assert v.dtype == np.dtype(dtype)
    if init == "kaiming_normal":
        assert abs(v.std() - math.sqrt(2 / 64)) < 0.01
    if init == "kaiming_uniform":
        assert abs(v).max() <= 1 / 8 and abs(v.std() - 1 / 8 / math.sqrt(3)) < 0.01


SEG = """
network seg {
    input x: f32[N, 3, 6, 6]
    input y: i64[N, 6, 6]
    logits = conv2d(relu(conv2d(x, 8, kernel=3, padding=1)), 4, kernel=1)
    output relu(logits)
    loss softmax_cross_entropy(logits, y)
}
train { data = synthetic(samples=64, test_samples=16); batch = 16; steps = 40
        optimizer = adam(lr=0.01) }
"""

TOKENS = """
network lm {
    input ids: i64[N, 7]
    input y: i64[N, 7]
    h = embedding(ids, 13, 16)
    logits = linear(h, 13)
    loss softmax_cross_entropy(logits, y, axis=-1)
}
train { data = synthetic(samples=64, test_samples=16); batch = 16; steps = 60
        optimizer = adam(lr=0.05) }
"""


def test_per_pixel_labels_and_accuracy_from_the_losss_logits():
    """Labels [N, H, W] for [N, C, H, W] scores (classes at dim 1, as PyTorch); the
    network's first output is not the logits, so accuracy must come from the loss."""
    net = netdsl.loads(SEG, file="seg.net")
    r = Trainer(net.graph, net.train, RunOptions()).fit()
    assert 0.0 <= r.train_accuracy <= 1.0 and r.test_accuracy is not None
    assert r.train_accuracy > 0.6  # per-pixel labels are a learnable function of x
    assert r.losses[-1] < r.losses[0]


def test_per_token_labels_train():
    # [N, T] labels of [N, T] tokens are a next-token task; its successor table is a
    # per-token map (untied: a tied E E^T is symmetric and cannot hold a permutation)
    net = netdsl.loads(TOKENS, file="lm.net")
    r = Trainer(net.graph, net.train, RunOptions()).fit()
    assert r.train_accuracy > 0.5 and r.losses[-1] < r.losses[0] / 2


@pytest.mark.parametrize("src,label_shape", [
    ("input x: f32[N, 3, 6, 6]\n input y: i64[N, 6, 6]\n"
     " loss softmax_cross_entropy(conv2d(x, 4), y)", (6, 6)),  # per pixel
    ("input x: f32[N, 40]\n input y: i64[N, 5]\n"
     " loss softmax_cross_entropy(reshape(x, (N, 5, 8)), y, axis=-1)", (5,)),
    ("input x: f32[N, 3, 64, 64]\n input y: i64[N]\n"  # 12,288 features, pooled
     " loss softmax_cross_entropy(linear(flatten(global_avgpool(x)), 4), y)", ()),
], ids=["pixels", "positions", "samples"])
def test_synthetic_labels_of_any_rank(src, label_shape):
    from netdsl.config import Synthetic
    from netdsl.runtime.data import synthetic
    g = netdsl.loads(f"network n {{\n {src}\n}}\n", file="n.net").graph
    d = synthetic(g, Synthetic(samples=32, test_samples=8), seed=0)
    x_arr, y_arr = d.train.arrays
    assert x_arr.dtype == np.float32  # drawn in the input's dtype
    assert y_arr.shape == (32,) + label_shape
    assert y_arr.min() >= 0 and y_arr.max() < 8 and len(np.unique(y_arr)) > 1
    again = synthetic(g, Synthetic(samples=32, test_samples=8), seed=0)
    assert (again.train.arrays[1] == y_arr).all()  # a fixed function of (x, seed)


class EvalSpy(Callback):
    def __init__(self):
        self.progress, self.evals = [], []

    def on_eval_progress(self, done, total):
        self.progress.append((done, total))

    def on_eval(self, record):
        self.evals.append(record)


@pytest.mark.parametrize("eval_samples,used", [(None, 8), (0, 0), (5, 5), (100, 8)])
def test_evaluation_can_be_limited_or_skipped(tiny, eval_samples, used):
    """Synthetic data evaluates one batch by default; `eval_samples` limits it (0 skips),
    and progress is reported batch by batch."""
    spy = EvalSpy()
    r = Trainer(tiny.graph, tiny.train, RunOptions(steps=2, eval_every=1,
                                                   eval_samples=eval_samples), spy).fit()
    if used == 0:
        assert r.test_accuracy is None and spy.progress == [] and spy.evals == [{}, {}]
        return
    assert r.test_accuracy is not None
    assert [e["eval_samples"] for e in spy.evals] == [used, used]
    assert spy.progress[-1] == (1, 1) and spy.progress[0] == (0, 1)


def test_real_data_evaluates_everything_by_default(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((16, 6)).astype(np.float32),
             y=rng.integers(0, 3, 16), x_test=rng.standard_normal((20, 6)).astype(np.float32),
             y_test=rng.integers(0, 3, 20))
    (tmp_path / "n.net").write_text(TINY.replace("synthetic(samples=32, test_samples=8)",
                                                 'npz(path="d.npz")'))
    net = netdsl.load(tmp_path / "n.net")
    spy = EvalSpy()
    Trainer(net.graph, net.train, RunOptions(steps=1, eval_every=1), spy).fit()
    assert spy.evals[0]["eval_samples"] == 20 and spy.progress[-1] == (3, 3)
    with pytest.raises(NetdslError, match="--eval-samples must be 0"):
        Trainer(net.graph, net.train, RunOptions(steps=1, eval_samples=-1))


HUGE = ("network huge {\n    input x: f32[N, 1048576]\n"
        "    loss mse(linear(x, 134217728), linear(x, 134217728))\n}\n"
        "train { data = synthetic(samples=4, test_samples=0); batch = 2 }\n")


def test_out_of_memory_is_said_in_words(tmp_path, monkeypatch):
    """512 TiB of weights: refused before anything is allocated, since no plan fits the
    free memory (exit 1, no traceback); where the free memory cannot be read, NumPy's
    MemoryError (more than any address space, so the allocation fails at once even where
    the kernel overcommits) becomes what is needed and what to change."""
    p = tmp_path / "huge.net"
    p.write_text(HUGE)
    out = subprocess.run([sys.executable, "-m", "netdsl_cli", "run", str(p), "--steps", "1"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 1, out.stderr
    assert ("out of memory before the first step: a training step needs about 2251.80 TB "
            "as written (at batch 2), about") in out.stderr
    assert "is free on this machine, and no memory plan fits" in out.stderr
    assert "the least a plan needs is about 2251.80 TB" in out.stderr
    assert "--batch 1" in out.stderr
    assert "Traceback" not in out.stderr and "internal error" not in out.stderr
    from netdsl.step import room
    monkeypatch.setattr(room, "available_bytes", lambda be: None)
    net = netdsl.load(p)
    with pytest.raises(NetdslError, match="out of memory allocating the parameters: a "
                       "training step needs about .* this machine has less free"):
        Trainer(net.graph, net.train, RunOptions(steps=1))


DEEP = """
network deep {
    input x: f32[N, 64]
    input y: i64[N]
    h = x
    repeat 24 { h = relu(linear(h, 256)) }
    logits = linear(h, 10)
    output logits
    loss softmax_cross_entropy(logits, y)
}
train { data = synthetic(samples=1024, test_samples=64); batch = 1024; steps = 2 }
"""


def test_a_step_that_does_not_fit_the_free_memory_is_planned_into_it(tmp_path,
                                                                     monkeypatch):
    """Without --mem, a step whose storage plan is more than the free memory is planned
    into nine tenths of it (Linux would let it start and then kill it), says so, and
    trains to the same numbers; one that no plan fits is refused before anything is
    allocated, with what a plan needs."""
    from netdsl.step import room
    p = tmp_path / "deep.net"
    p.write_text(DEEP)
    net = netdsl.load(p)
    whole = Trainer(net.graph, net.train, RunOptions(steps=2))
    # its storage plan, and its batch and interpreter objects besides
    need = (whole.planned_peak_bytes()
            + whole._held_besides_plan(whole.train_graph, whole.executor.backend))
    assert whole.mem is None and whole.warnings == []
    expected = whole.fit()
    free = int(need * 0.7)
    monkeypatch.setattr(room, "available_bytes", lambda be: free)
    t = Trainer(net.graph, net.train, RunOptions(steps=2))
    assert t.mem == room.budget_within(free) == f"{int(free * 0.9 / 1e6)}MB"
    assert t.warnings == [f"the step as written needs about {need / 1e6:.2f} MB and about "
                          f"{free / 1e6:.2f} MB is free on this machine: planned into --mem "
                          f"{t.mem} (activations recomputed or offloaded, so a step takes "
                          "longer; give --mem to choose the budget)"]
    r = t.fit()
    assert r.memory_plan["budget"] == "free memory" and r.memory_plan["decisions"]["recompute"]
    assert r.planned_peak_bytes <= r.budget_bytes < free
    assert r.peak_bytes <= r.budget_bytes  # measured (tracemalloc + the state's arrays)
    np.testing.assert_allclose(r.losses, expected.losses, rtol=1e-5)
    monkeypatch.setattr(room, "available_bytes", lambda be: need // 4)
    with pytest.raises(NetdslError) as info:
        Trainer(net.graph, net.train, RunOptions(steps=1))
    msg = info.value.message
    assert msg.startswith("out of memory before the first step: a training step needs "
                          f"about {need / 1e6:.2f} MB as written (at batch 1024), about "
                          f"{need / 4e6:.2f} MB is free on this machine, and no memory plan "
                          "fits")
    assert "the least a plan needs is about" in msg and "--batch 512" in msg


def test_a_step_planned_past_the_free_memory_is_refused_before_it_starts(tiny,
                                                                        monkeypatch):
    """Memory taken by others after the plan was made: the planned peak is more than the
    memory left after the state, so the step is refused up front, with the --mem to plan
    it into; with --mem already given, the budget is named instead."""
    from netdsl.step import room
    t = Trainer(tiny.graph, tiny.train, RunOptions(steps=1))
    need = t.planned_peak_bytes() + t._held_besides_plan(t.train_graph, t.executor.backend)
    monkeypatch.setattr(room, "available_bytes", lambda be: need // 4)
    with pytest.raises(NetdslError) as info:
        t._refuse_what_cannot_fit(t.executor.backend)
    msg = info.value.message
    assert msg.startswith("out of memory before the first step: a training step needs")
    free = need // 4 + t._state_bytes()  # (the state is allocated already)
    assert (f"is free on this machine; use --mem {room.budget_within(free)} to plan "
            "the step into it") in msg
    assert "--batch 4" in msg
    monkeypatch.setattr(room, "available_bytes", lambda be: 40 * need)
    Trainer(tiny.graph, tiny.train, RunOptions(steps=1)).fit()  # room enough: it runs
    monkeypatch.setattr(room, "available_bytes", lambda be: 10)
    with pytest.raises(NetdslError, match="use a --mem budget below what is free"):
        Trainer(tiny.graph, tiny.train, RunOptions(steps=1, mem=1_000_000))


def test_ranks_sharing_a_machine_are_refused_together(tiny):
    """Over MPI the ranks on one machine count together (`MPIComm.memory_totals`; a
    stand-in here, the real split in tests/test_mpi.py): each could fit alone where all
    of them cannot, and the error says so and sizes --mem for each rank."""
    t = Trainer(tiny.graph, tiny.train, RunOptions(steps=1))
    be = t.executor.backend
    besides = t._held_besides_plan(t.train_graph, be)  # its batch, interpreter objects
    assert besides > 0
    need, state = t.planned_peak_bytes() + besides, t._state_bytes()
    seen = []

    class Peers:  # three ranks like this one; the least free memory any of them read
        def __init__(self, free):
            self.free = free

        def memory_totals(self, color, n, s, read_free):
            seen.append((color, n, s))
            return 3 * n, 3 * s, self.free, 3

    t._refuse_what_cannot_fit(t.executor.backend, Peers(4 * (need - state)))  # fits
    with pytest.raises(NetdslError):  # the plans fit; with what each holds besides, not
        t._refuse_what_cannot_fit(be, Peers(3 * (need - state) - besides))
    seen.pop()
    with pytest.raises(NetdslError) as info:
        t._refuse_what_cannot_fit(t.executor.backend, Peers(2 * (need - state)))
    assert seen == [(0, need, state)] * 2  # the host's memory: colour 0
    msg = info.value.message
    assert msg.startswith("out of memory before the first step: the 3 ranks sharing this "
                          "machine need about")
    assert "to plan the step into it for each rank" in msg
    assert "fewer ranks on one machine" in msg
    t.budget = 10 ** 6  # with --mem given: each rank's share of the free memory
    with pytest.raises(NetdslError, match="a --mem budget below each rank's share of what"):
        t._refuse_what_cannot_fit(t.executor.backend, Peers(2 * (need - state)))


def test_the_devices_of_a_split_in_one_process_are_refused_together(tiny, monkeypatch):
    """A split run in one process holds every device's part in this process's memory:
    the plan's peak (all of them at once) is checked against what is free, as a single
    device's is (it was not checked at all)."""
    from netdsl.step import room
    t = Trainer(tiny.graph, tiny.train, RunOptions(steps=1, devices=2, split="data"))
    need, state = t.planned_peak_bytes(), t._state_bytes()
    assert need > max(t._planned_by_device().values())  # both devices' values
    monkeypatch.setattr(room, "available_bytes", lambda be: (need - state) // 2)
    with pytest.raises(NetdslError) as info:
        Trainer(tiny.graph, tiny.train, RunOptions(steps=1, devices=2, split="data"))
    msg = info.value.message
    assert msg.startswith("out of memory before the first step: the 2 devices of the split, "
                          "all in this process, need about")
    free = (need - state) // 2 + state
    assert f"use --mem {room.budget_within(free, 2)} to plan the step into it for " \
        "each device" in msg and ", another --split, or a smaller network" in msg


def test_out_of_memory_during_a_step(tiny, monkeypatch):
    t = Trainer(tiny.graph, tiny.train, RunOptions(steps=2))

    def no_memory(*a, **k):
        raise MemoryError("Unable to allocate 3.0 GiB")
    monkeypatch.setattr(t.executor, "run", no_memory)
    with pytest.raises(NetdslError) as info:
        t.fit()
    msg = info.value.message
    assert msg.startswith("out of memory at step 1: a training step needs about")
    assert "at batch 8" in msg and "--batch 4" in msg


def test_free_memory_is_the_smaller_of_the_hosts_and_the_cgroups(monkeypatch):
    from netdsl.backends import host_memory
    from netdsl.backends.numpy import NumpyBackend
    from netdsl.step import room
    be = NumpyBackend()
    monkeypatch.setattr(host_memory, "_cgroup_room", lambda: None)
    host = room.available_bytes(be)
    assert host is None or host > 1000
    monkeypatch.setattr(host_memory, "_cgroup_room", lambda: 1000)
    assert room.available_bytes(be) == 1000


def test_free_gpu_memory_counts_what_cupys_pool_holds_free():
    """A second run in one process finds the first one's blocks in CuPy's pool: free for
    its step, though the device does not count them as free."""
    from types import SimpleNamespace as NS

    from netdsl.step import room
    xp = NS(cuda=NS(Device=lambda: NS(mem_info=(1000, 8000))),
            get_default_memory_pool=lambda: NS(free_bytes=lambda: 500))
    assert room.available_bytes(NS(name="cupy", xp=xp)) == 1500
