"""The trainer: exact resume, checkpoint safety, logs, evaluation, CLI overrides."""
from __future__ import annotations

import json

import numpy as np
import pytest

import netdsl
from netdsl.config import Cosine, Step
from netdsl.errors import CheckpointError, NetdslError
from netdsl.runtime import checkpoint
from netdsl.runtime import data as data_mod
from netdsl.runtime.data import DrawnSplit, Loader, Split, synthetic
from netdsl.runtime.options import RunOptions
from netdsl.runtime.schedule import lr_at
from netdsl.runtime.trainer import Trainer

SMALL = """
network small {
    input x: f32[N, 3, 6, 6]
    input y: i64[N]
    h = relu(batchnorm(conv2d(x, 4, kernel=3, padding=1, bias=false)))
    h = dropout(flatten(global_avgpool(h)), p=0.25)
    logits = linear(h, 5)
    output logits
    loss softmax_cross_entropy(logits, y)
}
train {
    data = synthetic(samples=40, test_samples=12)
    optimizer = sgd(lr=0.05, momentum=0.9, weight_decay=1e-4)
    schedule = cosine(warmup=2, steps=12)
    batch = 8
    seed = 3
}
"""


@pytest.fixture
def net(tmp_path):
    p = tmp_path / "small.net"
    p.write_text(SMALL)
    return netdsl.load(p)


def _fit(net, **kw):
    return Trainer(net.graph, net.train, RunOptions(**kw)).fit()


def test_resume_is_exact(net, tmp_path):
    """2N steps == N steps + resume + N steps: losses and final weights identical."""
    full = _fit(net, steps=12)
    ck = tmp_path / "ck"
    first = _fit(net, steps=6, checkpoint=str(ck))
    second = Trainer(net.graph, net.train, RunOptions(steps=12, checkpoint=str(ck),
                                                       resume=True))
    rest = second.fit()
    assert rest.resumed_from == 6 and rest.steps == 12
    assert first.losses + rest.losses == full.losses
    arrays, header = checkpoint.load(ck)
    assert header["step"] == 12
    again = Trainer(net.graph, net.train, RunOptions(steps=12))
    again.fit()
    for k, v in again.executor.state_dict().items():
        np.testing.assert_array_equal(v, arrays[k], err_msg=k)


def test_loss_decreases_and_eval_runs(tmp_path):
    # the shared fixture's cosine schedule ends at step 12, and 4 channels barely fit the
    # random labels: learn with 16 channels over all 40 steps here (seeded: deterministic)
    p = tmp_path / "small40.net"
    p.write_text(SMALL.replace("steps=12)", "steps=40)").replace("conv2d(x, 4,", "conv2d(x, 16,"))
    r = _fit(netdsl.load(p), steps=40, eval_every=10)
    assert np.mean(r.losses[-5:]) < np.mean(r.losses[:5])
    assert 0.0 <= r.test_accuracy <= 1.0 and r.test_loss > 0
    assert r.peak_bytes > 0 and r.params == 16 * 3 * 9 + 2 * 16 + 16 * 5 + 5


def test_log_has_one_json_line_per_step(net, tmp_path):
    log = tmp_path / "m.jsonl"
    _fit(net, steps=5, log=str(log))
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert {"step", "loss", "lr", "images_per_s"} <= set(rows[0])
    assert rows[0]["lr"] == pytest.approx(0.025)  # warm-up: step 1 of 2


def test_corrupt_checkpoint_is_refused_and_left_alone(net, tmp_path):
    ck = tmp_path / "ck"
    _fit(net, steps=2, checkpoint=str(ck))
    f = checkpoint.path_in(ck)
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        _fit(net, steps=4, checkpoint=str(ck), resume=True)
    assert f.read_bytes() == data[: len(data) // 2]  # nothing overwritten


def test_checkpoint_of_another_network_is_refused(net, tmp_path):
    ck = tmp_path / "ck"
    _fit(net, steps=1, checkpoint=str(ck))
    other = netdsl.loads(SMALL.replace("conv2d(x, 4", "conv2d(x, 6"), "other.net")
    with pytest.raises(CheckpointError, match="is \\[4, 3, 3, 3\\].*but \\[6, 3, 3, 3\\]"):
        _fit(other, steps=2, checkpoint=str(ck), resume=True)
    renamed = netdsl.loads(SMALL.replace("network small", "network big"), "big.net")
    with pytest.raises(CheckpointError, match="belongs to network `small`"):
        _fit(renamed, steps=2, checkpoint=str(ck), resume=True)


def test_resume_rewinds_the_log_to_the_checkpoint(net, tmp_path):
    """A run killed after its last checkpoint leaves later steps (and maybe a torn line)
    in its log; resuming from the checkpoint drops them, so each step is logged once."""
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    _fit(net, steps=4, checkpoint=str(ck), log=str(log))
    with open(log, "a") as f:  # what the lost run wrote after the checkpoint
        f.write('{"step": 5, "loss": 9.0}\n{"step": 6, "loss": 9.0}\n{"step": 7, "lo')
    r = _fit(net, steps=6, checkpoint=str(ck), log=str(log), resume=True)
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert [x["step"] for x in recs] == [1, 2, 3, 4, 5, 6]
    assert [x["loss"] for x in recs[4:]] == r.losses
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_missing_checkpoint_and_resume_without_dir(net, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        _fit(net, steps=2, checkpoint=str(tmp_path / "none"), resume=True)
    with pytest.raises(NetdslError, match="--resume needs --checkpoint"):
        _fit(net, steps=2, resume=True)


def test_atomic_save_keeps_previous_on_failure(tmp_path, monkeypatch):
    """A disk that fills up part way through a save: a CheckpointError (a clear message,
    not an internal error), the previous checkpoint intact and no temporary file left."""
    checkpoint.save(tmp_path, {"w": np.ones(3, np.float32)}, {"network": "n", "step": 1})
    real = checkpoint._write

    def boom(zf, name, value):
        if name == "state/v":
            raise OSError(28, "No space left on device")
        real(zf, name, value)
    monkeypatch.setattr(checkpoint, "_write", boom)
    with pytest.raises(CheckpointError, match="could not write the checkpoint .*No space left"
                       ".*before this save \\(if any\\) is unchanged"):
        checkpoint.save(tmp_path, {"w": np.zeros(3, np.float32), "v": np.zeros(2)},
                        {"network": "n", "step": 2})
    arrays, header = checkpoint.load(tmp_path)
    assert header["step"] == 1 and arrays["w"].tolist() == [1, 1, 1]
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.npz"]  # no temp left


def test_loader_is_seeded_and_restorable():
    split = Split([np.arange(10), np.arange(10) * 2])
    a = Loader(split, 3, seed=1)
    seq = [a.next()[0].tolist() for _ in range(7)]
    assert sorted(sum(seq[:3], [])) == sorted(set(sum(seq[:3], [])))  # no repeats in epoch
    b = Loader(split, 3, seed=1)
    for _ in range(4):
        b.next()
    c = Loader(split, 3, seed=1)
    c.restore(b.state())
    assert [c.next()[0].tolist() for _ in range(3)] == seq[4:]


def test_large_synthetic_data_is_drawn_per_batch_with_the_same_values(monkeypatch):
    """A synthetic split over HELD_SYNTHETIC_BYTES is not held: each batch draws its
    samples, the same values (inputs and learnable labels) as the held split, so the
    loader's batches and an evaluation's are the same either way."""
    import tracemalloc

    from netdsl.config import Synthetic
    g = netdsl.loads(SMALL).graph
    cfg = Synthetic(samples=40, test_samples=12)
    held = synthetic(g, cfg, seed=3)
    assert isinstance(held.train, Split)
    monkeypatch.setattr(data_mod, "HELD_SYNTHETIC_BYTES", 1000)
    drawn = synthetic(g, cfg, seed=3)
    assert isinstance(drawn.train, DrawnSplit) and len(drawn.train) == 40
    assert len(drawn.test) == 12 and isinstance(drawn.test, DrawnSplit)
    for a, b in zip(held.train.arrays, drawn.train.take(np.arange(40)), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert len(np.unique(held.train.arrays[1])) > 1  # learnable labels, not a constant
    # sample 5 of the test split (part 1): its own stream, whatever was drawn before it
    own = np.random.Generator(np.random.Philox(key=[3, 1], counter=[0, 5, 0, 0]))
    assert np.array_equal(held.test.arrays[0][5],
                          own.standard_normal((3, 6, 6), dtype=np.float32))
    x, y = held.test.take(slice(3, 9))
    assert np.array_equal(x, drawn.test.take(slice(3, 9))[0])
    assert np.array_equal(y, drawn.test.take(np.arange(3, 9))[1])
    assert not np.array_equal(x, held.train.arrays[0][3:9])  # the splits differ
    for u, v in zip(Loader(held.train, 8, 3).next(), Loader(drawn.train, 8, 3).next(),
                    strict=True):
        assert np.array_equal(u, v)
    big = Synthetic(samples=1_000_000, test_samples=0)  # 432 MB of [3, 6, 6] images
    tracemalloc.start()
    try:
        d = synthetic(g, big, seed=3)
        batch = Loader(d.train, 8, 3).next()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert batch[0].shape == (8, 3, 6, 6) and peak < 50 * 2**20


def test_schedules():
    assert lr_at(Cosine(warmup=0), 1.0, 0, 10) == 1.0
    assert lr_at(Cosine(warmup=0), 1.0, 10, 10) == pytest.approx(0.0)
    assert lr_at(Cosine(warmup=4), 1.0, 1, 10) == 0.5
    assert lr_at(Step(step_size=3, gamma=0.5), 1.0, 7, 10) == 0.25


def test_command_line_overrides(net):
    t = Trainer(net.graph, net.train, RunOptions(steps=3, batch=4, lr=0.5, seed=9))
    assert (t.cfg.batch, t.cfg.optimizer.lr, t.cfg.seed, t.total) == (4, 0.5, 9, 3)
    assert t.cfg.optimizer.momentum == 0.9  # the rest of the file's section is kept
    t = Trainer(net.graph, net.train, RunOptions(steps=3, lr=0.5, clip_grad_norm=0.25))
    assert (t.cfg.optimizer.lr, t.cfg.optimizer.clip_grad_norm) == (0.5, 0.25)
    assert len(t.train_graph.by_op("clip_factor")) == 1  # (the step clips)
    with pytest.raises(NetdslError, match="`--clip-grad-norm` must be greater than 0"):
        Trainer(net.graph, net.train, RunOptions(steps=3, clip_grad_norm=0.0))


def test_untrainable_network_is_a_clear_error(tmp_path):
    n = netdsl.loads("network f { input x: f32[N, 4]\n output relu(x) }", "f.net")
    with pytest.raises(NetdslError, match="declares no `loss`"):
        _fit(n, steps=1)


def test_data_shape_mismatch_is_a_clear_error():
    n = netdsl.loads("network f { input x: f32[N, 4]\n input y: i64[N]\n"
                     " loss softmax_cross_entropy(linear(x, 10), y) }\n"
                     "train { data = digits() }", "f.net")
    pytest.importorskip("sklearn")
    with pytest.raises(NetdslError, match="samples shaped \\[1, 8, 8\\]"):
        _fit(n, steps=1)


def test_planned_memory_equals_the_executors_count(net):
    """The storage plan's peak, printed before the first step, is what the executor counts;
    the independent measurement (tracemalloc) is reported beside it."""
    t = Trainer(net.graph, net.train, RunOptions(steps=2))
    predicted = t.planned_peak_bytes()
    r = t.fit()
    assert r.counted_peak_bytes == predicted == r.planned_peak_bytes
    assert r.peak_bytes > 0


def test_the_backends_thread_set_up_is_held_across_the_whole_run(net, monkeypatch):
    """fit holds backend.running() from before its first draw to after its last
    evaluation, so that host-side NumPy between steps (synthetic labels' projection,
    accuracy) does not wake BLAS threads that would spin into the next step."""
    tr = Trainer(net.graph, net.train, RunOptions(steps=3, eval_every=2))
    be = tr.executor.backend
    depth, seen = [0], []
    inner = be.running

    class Held:
        def __enter__(self):
            depth[0] += 1
            self.ctx = inner()
            return self.ctx.__enter__()

        def __exit__(self, *exc):
            depth[0] -= 1
            return self.ctx.__exit__(*exc)  # (the BLAS thread count given back)

    monkeypatch.setattr(be, "running", Held)
    draw = tr.loader.next
    monkeypatch.setattr(tr.loader, "next",
                        lambda wanted=None: seen.append(depth[0]) or draw(wanted))
    evaluate = tr.evaluate
    monkeypatch.setattr(tr, "evaluate", lambda: seen.append(depth[0]) or evaluate())
    tr.fit()
    assert seen and min(seen) >= 1 and depth[0] == 0


def test_numpy_backends_set_up_loads_the_fused_kernels():
    """running() itself loads the fused kernels, so the first step of a loop is held too."""
    from netdsl.backends import numpy as numpy_backend
    be = numpy_backend.NumpyBackend()
    assert be._fused is numpy_backend._UNSET
    with be.running():
        pass
    assert be._fused is not numpy_backend._UNSET  # None where Numba is absent or off


def test_memory_is_metered_over_the_first_two_steps_only(net, monkeypatch):
    """tracemalloc slows every allocation: the meter closes after METERED_STEPS steps, and
    the peak it measured is the run's."""
    from netdsl.runtime import trainer as trainer_mod
    tr = Trainer(net.graph, net.train, RunOptions(steps=5, eval_samples=0))
    be = tr.executor.backend
    closed_at = []
    make = be.memory_meter

    def meter():
        m = make()
        close = m.__exit__
        m.__exit__ = lambda *exc: closed_at.append(tr.step) or close(*exc)
        return m

    monkeypatch.setattr(be, "memory_meter", meter)
    r = tr.fit()
    assert closed_at == [trainer_mod.METERED_STEPS] == [2] and r.steps == 5
    assert r.peak_bytes >= tr.planned_peak_bytes() * 0.5
