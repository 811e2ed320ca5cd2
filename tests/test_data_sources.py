"""Data read from disk: the train section's sources and transforms, what they read, and
every bad input said with its file and sample (netdsl/runtime/data)."""
from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest

import netdsl
from netdsl.errors import NetdslError
from netdsl.runtime.data import load_dataset
from netdsl.runtime.data.sampler import Loader
from netdsl.runtime.data.sources import expand
from netdsl.runtime.data.transforms import Pipeline, rrc_box

Image = pytest.importorskip("PIL.Image")

NET = """
network tiny {{
    input x: f32[N, {c}, {s}, {s}]
    input y: i64[N]
    logits = linear(flatten(x), {classes})
    output logits
    loss softmax_cross_entropy(logits, y)
}}
train {{ data = {data}; batch = 4; steps = 4; seed = 5
  train_transforms = [{train}]
  eval_transforms = [{eval}] }}
"""


def write_folder(root, classes=("ant", "bee", "cat"), per=6, size=(20, 16), seed=0,
                 ext="png"):
    rng = np.random.default_rng(seed)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per):
            img = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(img).save(root / c / f"{i:03d}.{ext}")
    return root


def load(tmp_path, data, c=3, s=16, classes=3, train="random_crop(16), flip()",
         eval="center_crop(16)"):
    p = tmp_path / "tiny.net"
    p.write_text(NET.format(c=c, s=s, classes=classes, data=data, train=train, eval=eval))
    return netdsl.load(p)


# -- the train section ------------------------------------------------------------------

def test_sources_and_transforms_parse_with_positional_arguments_and_relative_paths(tmp_path):
    net = load(tmp_path, 'images("pics", test_fraction=0.25); val = arrays("vx.npy", y="vy.npy")',
               train="random_resized_crop(16, scale=(0.5, 1.0)), flip(p=0.25), "
                     "normalize((0.5, 0.4, 0.3), (0.2, 0.2, 0.2))")
    cfg = net.train
    assert cfg.data.path == str(tmp_path / "pics") and cfg.data.test_fraction == 0.25
    assert (cfg.val.x, cfg.val.y) == (str(tmp_path / "vx.npy"), str(tmp_path / "vy.npy"))
    kinds = [t.kind for t in cfg.train_transforms]
    assert kinds == ["random_resized_crop", "flip", "normalize"]
    assert cfg.train_transforms[0].scale == (0.5, 1.0) and cfg.train_transforms[1].p == 0.25
    assert cfg.eval_transforms[0].size == 16


@pytest.mark.parametrize("data, message", [
    ('images("a", "b")', "images() takes at most 1 positional argument"),
    ('images("a", path="b")', "images() is given `path` twice"),
    ('sgd("a")', "sgd() takes keyword arguments only"),
])
def test_bad_calls_are_named(tmp_path, data, message):
    with pytest.raises(NetdslError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load(tmp_path, data)


def test_shard_ranges_expand():
    assert expand("a-{08..11}.tar") == ["a-08.tar", "a-09.tar", "a-10.tar", "a-11.tar"]
    assert expand("s{0..1}-{0..1}") == ["s0-0", "s0-1", "s1-0", "s1-1"]
    with pytest.raises(NetdslError, match="empty"):
        expand("a-{3..1}.tar")


# -- transforms ----------------------------------------------------------------------

def _cfg(**kw):
    from netdsl.config import TrainConfig
    return TrainConfig.model_validate(kw)


def test_transforms_match_pillow_and_numpy_references():
    """random_crop with padding, flip, center_crop, resize and normalize against the same
    operations written directly (the draws taken from the sample's own stream)."""
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, (3, 10, 12), dtype=np.uint8)
    cfg = _cfg(train_transforms=[{"kind": "random_crop", "size": 8, "padding": 3},
                                 {"kind": "flip", "p": 1.0},
                                 {"kind": "normalize", "mean": [0.5, 0.4, 0.3],
                                  "std": [0.2, 0.25, 0.5]}])
    pipe = Pipeline(cfg.train_transforms, seed=9)
    out = np.empty((3, 8, 8), np.float32)
    pipe.into(a, out, epoch=2, index=7)
    draws = pipe.rng.at(2, 7)
    top, left = int(draws.integers(0, 10 + 6 - 8 + 1)), int(draws.integers(0, 12 + 6 - 8 + 1))
    padded = np.pad(a, ((0, 0), (3, 3), (3, 3)))[:, top:top + 8, left:left + 8][..., ::-1]
    mean, std = np.array([0.5, 0.4, 0.3])[:, None, None], np.array([0.2, 0.25, 0.5])[:, None, None]
    np.testing.assert_allclose(out, (padded / 255 - mean) / std, rtol=1e-5, atol=1e-5)
    # eval: resize (shorter side) then center crop, as Pillow's bilinear resize does them
    img = Image.fromarray(a.transpose(1, 2, 0))
    ev = Pipeline(_cfg(eval_transforms=[{"kind": "resize", "size": 6},
                                        {"kind": "center_crop", "size": 6}]).eval_transforms, 0)
    got = np.empty((3, 6, 6), np.float32)
    ev.into(img, got, 0, 0)
    want = np.asarray(img.resize((7, 6), Image.Resampling.BILINEAR))[:, 0:6].transpose(2, 0, 1)
    np.testing.assert_allclose(got, want / 255, rtol=1e-6)


def test_random_resized_crop_is_torchvisions_box_then_a_bilinear_resize():
    """The box follows torchvision's get_params (area and log-ratio uniform, inside the
    image), and the crop is Pillow's resize of that box."""
    img = Image.fromarray(np.random.default_rng(2).integers(0, 256, (30, 40, 3), np.uint8))
    t = _cfg(train_transforms=[{"kind": "random_resized_crop", "size": 12}]).train_transforms
    pipe = Pipeline(t, seed=4)
    for index in range(20):
        out = np.empty((3, 12, 12), np.float32)
        pipe.into(img, out, 1, index)
        top, left, h, w = rrc_box(30, 40, (0.08, 1.0), (3 / 4, 4 / 3), pipe.rng.at(1, index))
        assert 0 <= top and top + h <= 30 and 0 <= left and left + w <= 40
        assert 0.08 * 1200 * 0.9 <= h * w <= 1200 and 3 / 4 * 0.8 <= w / h <= 4 / 3 * 1.2
        want = img.resize((12, 12), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
        np.testing.assert_allclose(out, np.asarray(want).transpose(2, 0, 1) / 255, atol=1e-6)


def test_a_samples_augmentation_depends_on_seed_epoch_and_index_only():
    t = _cfg(train_transforms=[{"kind": "random_crop", "size": 6, "padding": 2},
                               {"kind": "flip"}]).train_transforms
    a = np.random.default_rng(3).random((1, 6, 6)).astype(np.float32)

    def draw(pipe, epoch, index):
        out = np.empty((1, 6, 6), np.float32)
        pipe.into(a, out, epoch, index)
        return out
    p, q = Pipeline(t, seed=1), Pipeline(t, seed=1)
    first = [draw(p, e, i) for e in (0, 1) for i in range(8)]
    again = [draw(q, e, i) for e in (1, 0) for i in reversed(range(8))]
    again = again[8:][::-1] + again[:8][::-1]  # (the same draws, asked in another order)
    assert all(np.array_equal(u, v) for u, v in zip(first, again))
    assert sum(np.array_equal(first[i], first[8 + i]) for i in range(8)) < 8  # epochs differ


# -- sources -------------------------------------------------------------------------

def test_image_folder_classes_sorted_labels_and_a_fixed_held_out_part(tmp_path):
    write_folder(tmp_path / "pics", classes=("zebra", "ant", "moth"), per=5)
    net = load(tmp_path, 'images("pics", test_fraction=0.2)')
    data = load_dataset(net.graph, net.train)
    assert data.classes == ["ant", "moth", "zebra"]
    assert len(data.train) == 12 and len(data.test) == 3
    labels = data.train.source.labels
    assert list(labels) == [0] * 5 + [1] * 5 + [2] * 5
    x, y = Loader(data.train, 4, 5).next()
    assert x.shape == (4, 3, 16, 16) and x.dtype == np.float32 and 0 <= x.min() <= x.max() <= 1
    assert set(y.tolist()) <= {0, 1, 2}
    again = load_dataset(net.graph, net.train)
    assert np.array_equal(again.test.indices, data.test.indices)


def test_a_one_channel_network_reads_images_in_grey(tmp_path):
    write_folder(tmp_path / "pics", per=2, size=(16, 16))
    net = load(tmp_path, 'images("pics")', c=1, train="", eval="center_crop(16)")
    data = load_dataset(net.graph, net.train)
    x, _ = data.train.take(np.arange(2))
    grey = Image.open(tmp_path / "pics" / "ant" / "000.png").convert("L")
    assert x.shape == (2, 1, 16, 16)
    np.testing.assert_allclose(x[0, 0], np.asarray(grey) / 255, rtol=1e-6)


def test_arrays_are_memory_mapped_and_only_a_batch_is_read(tmp_path):
    import tracemalloc
    x = np.random.default_rng(0).random((4000, 3, 16, 16), dtype=np.float32)  # 12 MB
    y = np.arange(4000) % 3
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    net = load(tmp_path, 'arrays("x.npy", "y.npy")', train="", eval="")
    data = load_dataset(net.graph, net.train)
    loader = Loader(data.train, 4, 5)
    tracemalloc.start()
    try:
        bx, by = loader.next()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    idx = np.random.default_rng((5, 0)).permutation(4000)[:4]
    assert np.array_equal(bx, x[idx]) and np.array_equal(by, y[idx])


def write_shards(root, count=2, per=5, seed=0):
    rng = np.random.default_rng(seed)
    for s in range(count):
        with tarfile.open(root / f"part-{s:02d}.tar", "w") as tar:
            for r in range(per):
                key = f"s{s}r{r:03d}"
                buf = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, (16, 16, 3), np.uint8)).save(buf, "PNG")
                for name, data in ((f"{key}.png", buf.getvalue()),
                                   (f"{key}.cls", str((s * per + r) % 3).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return "part-{00.." + f"{count - 1:02d}" + "}.tar"


def test_shards_stream_through_a_shuffle_buffer_each_record_once(tmp_path):
    write_shards(tmp_path, count=3, per=7)
    net = load(tmp_path, 'shards("part-{00..02}.tar", shuffle_buffer=4)')
    data = load_dataset(net.graph, net.train)
    src = data.train.source
    assert len(data.train) == 21 and list(src.labels) == [i % 3 for i in range(21)]
    order = src.stream_order(5, 0, 4)
    assert sorted(order.tolist()) == list(range(21))  # every record once
    assert not np.array_equal(order, src.stream_order(5, 1, 4))  # reshuffled each epoch
    # the stream: shards whole, one after the other, records at most a buffer apart
    starts = {int(src.shard[i]) for i in order[:3]}
    assert len(starts) == 1  # (the first records come from the first shard streamed)
    plain = load(tmp_path, 'shards("part-{00..02}.tar")', train="")
    x, y = load_dataset(plain.graph, plain.train).train.take(np.arange(3))
    img = Image.open(io.BytesIO(tarfile.open(tmp_path / "part-00.tar").extractfile(
        "s0r000.png").read()))
    np.testing.assert_allclose(x[0], np.asarray(img).transpose(2, 0, 1) / 255, rtol=1e-6)
    assert list(y) == [0, 1, 2]


# -- bad data: each said with its file and its sample ------------------------------------

def test_a_missing_folder_and_an_empty_class_are_named(tmp_path):
    net = load(tmp_path, 'images("nowhere")')
    with pytest.raises(NetdslError, match=r"image folder .*nowhere does not exist"):
        load_dataset(net.graph, net.train)
    write_folder(tmp_path / "pics", per=2)
    (tmp_path / "pics" / "dog").mkdir()
    net = load(tmp_path, 'images("pics")', classes=4)
    with pytest.raises(NetdslError, match=r"class folder .*dog has no images"):
        load_dataset(net.graph, net.train)


def test_a_label_out_of_range_names_its_sample(tmp_path):
    write_folder(tmp_path / "pics", classes=("a", "b", "c"), per=2)
    net = load(tmp_path, 'images("pics")', classes=2)
    with pytest.raises(NetdslError, match=r"label out of range: .*pics/c/000.png \(sample 4\) "
                                          r"has label 2, but network `tiny` has 2 classes"):
        load_dataset(net.graph, net.train)
    np.save(tmp_path / "x.npy", np.zeros((5, 3, 16, 16), np.float32))
    np.save(tmp_path / "y.npy", np.array([0, 1, 2, -1, 0]))
    net = load(tmp_path, 'arrays("x.npy", "y.npy")', train="", eval="")
    with pytest.raises(NetdslError, match=r"x.npy \(sample 3\) has label -1"):
        load_dataset(net.graph, net.train)


def test_x_and_y_of_different_lengths(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((5, 3, 16, 16), np.float32))
    np.save(tmp_path / "y.npy", np.zeros(4, np.int64))
    net = load(tmp_path, 'arrays("x.npy", "y.npy")', train="", eval="")
    with pytest.raises(NetdslError, match=r"x .*x.npy has 5 samples but y .*y.npy has 4"):
        load_dataset(net.graph, net.train)


@pytest.mark.parametrize("cut", [700, 1536 + 100, -1])
def test_a_shard_that_ends_mid_record(tmp_path, cut):
    pattern = write_shards(tmp_path, count=1, per=3)
    path = tmp_path / "part-00.tar"
    data = path.read_bytes()
    # cut into a record's image, into the header after it, or before the closing zeros
    end = len(data.rstrip(b"\0"))
    path.write_bytes(data[:cut] if cut > 0 else data[:end - 10])
    net = load(tmp_path, f'shards("{pattern}")')
    with pytest.raises(NetdslError, match=r"shard .*part-00.tar (ends mid-record|: record)"):
        load_dataset(net.graph, net.train)


def test_a_corrupt_image_stops_the_run_or_is_skipped_and_counted(tmp_path):
    write_folder(tmp_path / "pics", per=4)
    bad = tmp_path / "pics" / "bee" / "001.png"
    bad.write_bytes(bad.read_bytes()[:60])  # truncated
    net = load(tmp_path, 'images("pics")')
    data = load_dataset(net.graph, net.train)
    with pytest.raises(NetdslError, match=r"bad data: .*bee/001.png \(sample 5\): not a "
                                          r"readable image.*--bad-images skip"):
        data.train.take(np.arange(12))
    skipping = load_dataset(net.graph, net.train, bad="skip")
    x, y = skipping.train.take(np.arange(12))
    assert list(skipping.train.skipped) == [5]
    ok = skipping.train.take(np.array([6]))  # sample 5 is replaced by sample 6
    assert np.array_equal(x[5], ok[0][0]) and y[5] == ok[1][0] == 1


def test_classes_written_next_to_checkpoints_and_data_wait_logged(tmp_path):
    from netdsl.runtime.options import RunOptions
    from netdsl.runtime.trainer import Trainer
    write_folder(tmp_path / "pics", classes=("b", "a"), per=4)
    net = load(tmp_path, 'images("pics")', classes=2)
    log, ck = tmp_path / "log.jsonl", tmp_path / "ck"
    r = Trainer(net.graph, net.train, RunOptions(steps=3, workers=0, log=str(log),
                                                  checkpoint=str(ck))).fit()
    assert json.loads((ck / "classes.json").read_text()) == ["a", "b"]
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(recs) == 3 and all(rec["data_wait_s"] > 0 for rec in recs)
    assert r.data_wait_s == pytest.approx(np.mean([rec["data_wait_s"] for rec in recs]))
