"""Steps recorded once and replayed (netdsl.runtime.replay, NETDSL_CUDA_GRAPH=1 on CuPy):
the executor's side, on NumPy with a stand-in for CUDA graphs. Recording runs nothing and
a launch runs the recorded step; the stand-in runs the step when "recording" and makes the
first launch a no-op, so that each step still runs once, then re-runs it per launch on the
buffers the recording read. tests/test_gpu.py checks the real thing on a GPU."""
from __future__ import annotations

import numpy as np
import pytest
from _examples import example_feeds, load

from netdsl.backends.numpy import NumpyBackend
from netdsl.passes.autodiff import autodiff
from netdsl.passes.optimizer import add_optimizer
from netdsl.runtime.executor import Executor, NonFinite
from netdsl.runtime.replay import GRAPH_ENV

ROLES = ("loss", "grads", "updates")


class FakeGraph:
    def __init__(self, backend, fn, outputs):
        self.backend, self.fn, self.outputs, self.launches = backend, fn, outputs, 0

    def launch(self):
        self.launches += 1
        if self.launches == 1:  # the recording already ran this step
            return
        ex = self.backend.executor
        step = ex.step
        again = self.fn()  # the recorded run, on the recorded input buffers
        ex.step = step
        for role, arrays in again.items():  # into the arrays the recording returned
            for old, new in zip(self.outputs[role], arrays, strict=True):
                np.copyto(old, new)


class RecordingNumpy(NumpyBackend):
    """NumPy with the CuPy backend's graph methods, faked as the module docstring says."""

    def __init__(self, fail: Exception | None = None):
        super().__init__()
        self.fail, self.captures, self.executor = fail, 0, None
        self.graph_stream_uses = 0

    def graph_stream(self):
        from contextlib import nullcontext
        self.graph_stream_uses += 1
        return nullcontext()

    def capture(self, fn):
        self.captures += 1
        if self.fail is not None:
            raise self.fail
        out = fn()
        return FakeGraph(self, fn, out), out

    def replay(self, graph):
        graph.launch()


def step_graph(example="resnet20-cifar", batch=2, kind="sgd"):
    hyper = {"lr": 0.05, "momentum": 0.9} if kind == "sgd" else {"lr": 1e-3}
    return add_optimizer(autodiff(load(f"{example}.net").lower(batch)), kind, **hyper)


def batches(g, k):
    """k different batches: the replays must read each step's feeds."""
    base = example_feeds(g)
    out = []
    for i in range(k):
        rng = np.random.default_rng(i)
        out.append({name: (v + 0.1 * rng.standard_normal(v.shape)).astype(v.dtype)
                    if np.asarray(v).dtype.kind == "f" and np.ndim(v) else v
                    for name, v in base.items()})
    return out


def recorded(g, monkeypatch, backend=None, **kw):
    monkeypatch.setenv(GRAPH_ENV, "1")
    be = backend or RecordingNumpy()
    ex = Executor(g, be, dtype="f64", seed=3, **kw)
    be.executor = ex
    return ex, be


def test_replayed_steps_equal_ordinary_steps(monkeypatch):
    g = step_graph()
    feeds = batches(g, 4)
    plain = Executor(g, "numpy", dtype="f64", seed=3)
    ex, be = recorded(g, monkeypatch)
    assert ex.replay is not None
    outs = []
    for f in feeds:
        a, b = plain.run(f, roles=ROLES), ex.run(f, roles=ROLES)
        # the recorded loss takes the general cross-entropy path: the same sums, rounded
        # in another order
        np.testing.assert_allclose(b["loss"][0], a["loss"][0], rtol=1e-9)
        for x, y in zip(a["grads"], b["grads"], strict=True):
            np.testing.assert_allclose(y, x, rtol=1e-9, atol=1e-12)
        outs.append(b["loss"][0])
    assert be.captures == 1  # run 1 ordinary, run 2 recorded, runs 3 and 4 replayed
    assert outs[2] is outs[3]  # a replay's outputs are the same arrays every run
    assert ex.step == plain.step == 4
    for k, v in plain.state_dict().items():
        np.testing.assert_allclose(ex.state_dict()[k], v, rtol=1e-9, atol=1e-12, err_msg=k)


def test_random_draws_and_failed_captures_run_as_before(monkeypatch):
    from test_strategies import DROPOUT_NET  # dropout: a replay would repeat the masks

    import netdsl
    g = add_optimizer(autodiff(netdsl.loads(DROPOUT_NET, file="drop.net").lower(4)), "adam",
                      lr=1e-2)
    feeds = example_feeds(g)
    ex, be = recorded(g, monkeypatch)
    for _ in range(3):
        ex.run(feeds, roles=ROLES)
    assert be.captures == 0
    assert "draws random numbers" in ex.replay.reasons[(ROLES, True)]

    g = step_graph()
    ex, be = recorded(g, monkeypatch, RecordingNumpy(fail=RuntimeError("sync in capture")))
    plain = Executor(g, "numpy", dtype="f64", seed=3)
    for _ in range(3):
        a, b = plain.run(feeds := example_feeds(g), roles=ROLES), ex.run(feeds, roles=ROLES)
        np.testing.assert_array_equal(b["loss"][0], a["loss"][0])
    assert be.captures == 1  # tried once, then ordinary runs
    assert "sync in capture" in ex.replay.reasons[(ROLES, True)]


def test_each_node_that_cannot_be_recorded_is_named_with_its_source_line(monkeypatch):
    from test_strategies import DROPOUT_NET

    import netdsl
    from netdsl.runtime.run_memory import replay_warnings
    g = add_optimizer(autodiff(netdsl.loads(DROPOUT_NET, file="drop.net").lower(4)), "adam",
                      lr=1e-2)
    ex, _ = recorded(g, monkeypatch)
    ex.run(example_feeds(g), roles=ROLES)
    why = ex.replay.reasons[(ROLES, True)]
    masks = [n for n in g.nodes if n.op == "dropout_mask"]
    assert len(masks) == 2 and all(n.loc is not None for n in masks)
    assert why == (", ".join(f"%{n.name} (dropout_mask at {n.loc})" for n in masks)
                   + ": each draws random numbers (a replay would repeat them)")
    assert replay_warnings(ex) == ["NETDSL_CUDA_GRAPH: training runs were not recorded as a "
                                   f"CUDA graph: {why}"]


class DeviceDraws(NumpyBackend):
    """NumPy drawing as the CuPy backend does: from the step in a device buffer."""

    def device_rng(self, seed, key, step):
        from netdsl.backends.counter_rng import DeviceRNG
        return DeviceRNG(np, None, seed, key, step)


class RecordingDeviceDraws(DeviceDraws, RecordingNumpy):
    """A recording whose host numbers are baked in, as a CUDA graph's are: its replays run
    with the step the recording saw."""

    def capture(self, fn):
        graph, out = super().capture(fn)
        baked, launch = self.executor.step, graph.launch

        def replay():
            now, self.executor.step = self.executor.step, baked
            try:
                launch()
            finally:
                self.executor.step = now
        graph.launch = replay
        return graph, out


def test_dropout_is_recorded_and_each_replay_draws_its_own_masks(monkeypatch):
    from test_strategies import DROPOUT_NET

    import netdsl
    g = add_optimizer(autodiff(netdsl.loads(DROPOUT_NET, file="drop.net").lower(4)), "adam",
                      lr=1e-2)
    feeds = example_feeds(g)
    ex, be = recorded(g, monkeypatch, RecordingDeviceDraws())
    plain = Executor(g, DeviceDraws(), dtype="f64", seed=3)
    assert plain.replay is None
    losses = []
    for _ in range(5):
        a, b = plain.run(feeds, roles=ROLES), ex.run(feeds, roles=ROLES)
        np.testing.assert_array_equal(b["loss"][0], a["loss"][0])
        losses.append(float(a["loss"][0]))
    assert be.captures == 1 and not ex.replay.reasons  # recorded, replayed three times
    assert len(set(losses)) == 5  # (new masks, and updates, every step)


def test_a_nonfinite_replayed_loss_stops_the_run(monkeypatch):
    g = step_graph()
    ex, _ = recorded(g, monkeypatch)
    ex.stop_if_nonfinite = set(g.outputs["loss"])
    feeds = example_feeds(g)
    ex.run(feeds, roles=ROLES)
    ex.run(feeds, roles=ROLES)
    bad = {k: (np.full_like(v, np.nan) if np.asarray(v).dtype.kind == "f" and np.ndim(v)
               else v) for k, v in feeds.items()}
    with pytest.raises(NonFinite):
        ex.run(bad, roles=ROLES)


def test_off_unless_asked_and_on_backends_that_record(monkeypatch):
    g = step_graph()
    monkeypatch.delenv(GRAPH_ENV, raising=False)
    assert Executor(g, RecordingNumpy()).replay is None
    monkeypatch.setenv(GRAPH_ENV, "1")
    assert Executor(g, "numpy").replay is None  # NumPy records nothing
