"""The training state on its way to and from disk, one entry at a time: a checkpoint is
written as the entries come and read as they are asked for, so neither holds a second
copy of the state (tracemalloc measures it); the ranks' pieces of a split state are joined
in the single-device layout (`state_parts.gather_order`); a tensor split evaluates on its
joined shards."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import netdsl
from netdsl.errors import CheckpointError, NetdslError
from netdsl.runtime import checkpoint
from netdsl.runtime.options import RunOptions
from netdsl.runtime.state_parts import StateParts, gather_order
from netdsl.runtime.trainer import Trainer

MLP = """
network mlp {
    input x: f32[N, 256]
    input y: i64[N]
    h = relu(linear(x, 384))
    h = relu(linear(h, 384))
    h = relu(linear(h, 384))
    logits = linear(h, 10)
    output logits
    loss softmax_cross_entropy(logits, y)
}
train {
    data = synthetic(samples=32, test_samples=16)
    optimizer = sgd(lr=0.05, momentum=0.9)
    batch = 8
    seed = 1
}
"""


@pytest.fixture
def mlp():
    return netdsl.loads(MLP, "mlp.net")


def _extra_peak(fn):
    """tracemalloc's peak while fn runs, above what was held when it started."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        out = fn()
        return out, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_a_save_holds_no_second_copy_of_the_state(mlp, tmp_path):
    """The state (parameters and momentum, 2.8 MB in 16 entries) goes to disk entry by
    entry: the save holds well under a copy of it (the whole copy it held before)."""
    t = Trainer(mlp.graph, mlp.train, RunOptions(steps=1, eval_samples=0,
                                                 checkpoint=str(tmp_path / "ck")))
    t.fit()
    state = sum(a.nbytes for a in t.executor.state.values())
    largest = max(a.nbytes for a in t.executor.state.values())
    assert state > 2_500_000 and largest < state / 4
    _, extra = _extra_peak(t.save)
    assert extra < state / 4, (extra, state)
    arrays, header = checkpoint.load(tmp_path / "ck")
    for k, v in t.executor.state_dict().items():
        np.testing.assert_array_equal(arrays[k], v, err_msg=k)
    assert header["step"] == 1 and set(header["arrays"]) == set(arrays)


def test_a_resume_reads_one_entry_at_a_time(mlp, tmp_path):
    ck = tmp_path / "ck"
    done = Trainer(mlp.graph, mlp.train, RunOptions(steps=2, eval_samples=0,
                                                    checkpoint=str(ck)))
    done.fit()
    t = Trainer(mlp.graph, mlp.train, RunOptions(steps=3, eval_samples=0))
    state = sum(a.nbytes for a in t.executor.state.values())
    largest = max(a.nbytes for a in t.executor.state.values())

    def load():
        arrays, _ = checkpoint.load(ck)
        t.executor.load_state_dict(arrays)
    _, extra = _extra_peak(load)
    # an entry, and NumPy's read buffer (the entry again, up to 16 MiB), at a time
    assert extra < 2 * largest + 65536 < state / 2, (extra, largest, state)
    for k, v in done.executor.state_dict().items():
        np.testing.assert_array_equal(t.executor.state_dict()[k], v, err_msg=k)


def test_a_damaged_entry_is_named_when_it_is_read(tmp_path):
    """The header is checked when the file opens; an entry's bytes when it is read (the
    zip's CRC): either way a CheckpointError saying the file is corrupt."""
    checkpoint.save(tmp_path, {"a": np.arange(64.0), "b": np.ones(64)}, {"network": "n"})
    p = checkpoint.path_in(tmp_path)
    raw = bytearray(p.read_bytes())
    at = raw.find(np.ones(64).tobytes())
    raw[at + 100] ^= 0xFF  # one byte of b's data
    p.write_bytes(bytes(raw))
    arrays, _ = checkpoint.load(tmp_path)
    np.testing.assert_array_equal(arrays["a"], np.arange(64.0))
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        arrays["b"]


def test_save_takes_entries_from_an_iterator(tmp_path):
    pairs = iter([("w", np.ones((2, 3), np.float32)), ("n", np.int64(7))])
    checkpoint.save(tmp_path, pairs, {"network": "n", "step": 4})
    arrays, header = checkpoint.load(tmp_path)
    assert header["arrays"] == {"w": [[2, 3], "float32"], "n": [[], "int64"]}
    assert arrays["w"].tolist() == [[1, 1, 1]] * 2 and int(arrays["n"]) == 7


def _held(shape, axis, *ranges):
    return (shape, "float32", axis, list(ranges))


def test_gather_order_takes_a_whole_entry_from_its_first_holder():
    order = gather_order([{"b": _held((4,), None, None)},
                          {"a": _held((2, 2), None, None), "b": _held((4,), None, None)}])
    assert [(k, pieces) for k, _, pieces in order] == [("b", [(0, None)]),
                                                       ("a", [(1, None)])]


def test_gather_order_joins_shards_from_every_rank():
    """Rank 1 holds [2, 4) twice (two devices' replicas of one shard): fetched once."""
    order = gather_order([{"w": _held((4, 3), 0, (0, 2))},
                          {"w": _held((4, 3), 0, (2, 4), (2, 4))}])
    [(key, sp, pieces)] = order
    assert pieces == [(0, (0, 2)), (1, (2, 4))] and sp.axis == 0
    joined = sp.join([((0, 2), np.zeros((2, 3))), ((2, 4), np.ones((2, 3)))])
    assert joined.tolist() == [[0] * 3] * 2 + [[1] * 3] * 2


@pytest.mark.parametrize("ranges", [[(0, 2)], [(0, 2), (1, 4)], [(1, 4)]])
def test_shards_that_do_not_make_up_the_tensor_are_refused(ranges):
    with pytest.raises(NetdslError, match="do not make up the whole tensor"):
        gather_order([{"w": _held((4,), 0, *ranges)}])


def test_state_parts_join_along_a_later_axis():
    sp = StateParts((2, 5), "float64", 1, {(0, 3): "w", (3, 5): "w@d1"})
    a = np.arange(10.0).reshape(2, 5)
    assert np.array_equal(sp.join([((3, 5), a[:, 3:]), ((0, 3), a[:, :3])]), a)
    assert sp.piece_shape((3, 5)) == (2, 2)


def test_a_tensor_split_evaluates_on_its_joined_shards(mlp):
    """Its executor holds half of each weight per device under the single-device names:
    the evaluation runs the whole forward graph on the joined state, as an unsplit run
    loaded with that state does (it ran on device 0's shards and failed before)."""
    split = Trainer(mlp.graph, mlp.train, RunOptions(steps=2, devices=2, split="tensor"))
    assert not split.executor.holds_state_whole()
    r = split.fit()
    plain = Trainer(mlp.graph, mlp.train, RunOptions(steps=2))
    assert plain.executor.holds_state_whole()
    plain.executor.load_state_dict(split.state_dict())
    again = plain.evaluate()
    assert r.test_loss is not None
    assert (r.test_loss, r.test_accuracy) == (again["test_loss"], again["test_accuracy"])


def test_a_resume_reads_each_entry_once(mlp, tmp_path, monkeypatch):
    """Asking whether an entry is there reads nothing; loading reads each entry once (the
    Mapping default `in` read the array, so a resume read the whole file three times)."""
    ck = tmp_path / "ck"
    Trainer(mlp.graph, mlp.train, RunOptions(steps=1, eval_samples=0,
                                             checkpoint=str(ck))).fit()
    arrays, header = checkpoint.load(ck)
    reads = []
    real = type(arrays._npz).__getitem__
    monkeypatch.setattr(type(arrays._npz), "__getitem__",
                        lambda self, k: reads.append(k) or real(self, k))
    assert all(k in arrays for k in header["arrays"]) and reads == []
    t = Trainer(mlp.graph, mlp.train, RunOptions(steps=2, eval_samples=0))
    t.executor.load_state_dict(arrays)
    assert sorted(reads) == sorted(checkpoint.PREFIX + k for k in header["arrays"])
