"""`hf(dir)`: datasets saved by Hugging Face's `save_to_disk`, read through pyarrow. The
folders under tests/data/hf were written by the `datasets` package itself
(tests/data/hf/make.py), so these tests check its real layout, not our idea of it."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import netdsl
from netdsl.errors import NetdslError
from netdsl.runtime.data import load_dataset
from netdsl.runtime.data.sampler import Loader

pytest.importorskip("pyarrow")
Image = pytest.importorskip("PIL.Image")

SAVED = Path(__file__).parent / "data" / "hf"

NET = """
network tiny {{
    input x: f32[N, 3, 16, 16]
    input y: i64[N]
    logits = linear(flatten(x), 3)
    output logits
    loss softmax_cross_entropy(logits, y)
}}
train {{ data = {data}; batch = 2; steps = 3; seed = 5 }}
"""


def load(tmp_path, data):
    p = tmp_path / "tiny.net"
    p.write_text(NET.format(data=data))
    return netdsl.load(p)


def pictures():
    """The images make.py saved: the same generator, drawn again."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (16, 16, 3), dtype=np.uint8) for _ in range(9)]


def test_a_dataset_dicts_split_images_and_class_labels(tmp_path):
    shutil.copytree(SAVED / "pictures", tmp_path / "saved")
    net = load(tmp_path, 'hf("saved"); val = hf("saved", split="test")')
    data = load_dataset(net.graph, net.train)
    assert data.classes == ["emu", "cat", "dog"]  # the ClassLabel's order, not sorted
    assert list(data.train.source.labels) == [2, 0, 1, 1, 2, 0]
    assert list(data.test.source.labels) == [0, 2, 1]
    x, y = data.train.take(np.arange(6))
    want = np.stack(pictures()[:6]).transpose(0, 3, 1, 2) / 255
    np.testing.assert_allclose(x, want, rtol=1e-6)
    assert list(y) == [2, 0, 1, 1, 2, 0]
    xt, _ = data.test.take(np.arange(3))
    np.testing.assert_allclose(xt, np.stack(pictures()[6:]).transpose(0, 3, 1, 2) / 255,
                               rtol=1e-6)


def test_an_array_feature_and_integer_labels(tmp_path):
    net = load(tmp_path, f'hf("{SAVED / "tensors"}", test_fraction=0.4)')
    data = load_dataset(net.graph, net.train)
    assert data.classes is None and len(data.train) == 3 and len(data.test) == 2
    x, y = data.train.take(np.arange(3))
    rng = np.random.default_rng(0)
    for _ in range(9):
        rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    want = rng.standard_normal((5, 3, 16, 16)).astype(np.float32)
    np.testing.assert_array_equal(x, want[data.train.indices])
    assert list(y) == [[0, 1, 2, 1, 0][i] for i in data.train.indices]


def test_trains_with_background_workers(tmp_path):
    from netdsl.runtime.options import RunOptions
    from netdsl.runtime.trainer import Trainer
    net = load(tmp_path, f'hf("{SAVED / "pictures"}")')
    r = Trainer(net.graph, net.train, RunOptions(steps=3, workers=1, eval_samples=0)).fit()
    assert r.steps == 3 and np.isfinite(r.losses).all()
    x, _ = Loader(load_dataset(net.graph, net.train).train, 2, 5).next()
    assert x.shape == (2, 3, 16, 16)


@pytest.mark.parametrize("data, message", [
    ('hf("nowhere")', r"hf dataset .*nowhere does not exist"),
    ('hf("{p}", split="valid")', r"has splits train, test, not 'valid'"),
    ('hf("{t}", split="train")', r"is one Dataset, not a DatasetDict"),
    ('hf("{p}", image="photo")', r"has no column 'photo' for the samples; its columns are "
                                 r"picture, kind"),
])
def test_bad_folders_and_columns_are_named(tmp_path, data, message):
    net = load(tmp_path, data.format(p=SAVED / "pictures", t=SAVED / "tensors"))
    with pytest.raises(NetdslError, match=message):
        load_dataset(net.graph, net.train)


def test_a_truncated_arrow_file_is_named(tmp_path):
    shutil.copytree(SAVED / "tensors", tmp_path / "saved")
    arrow = tmp_path / "saved" / "data-00000-of-00001.arrow"
    arrow.write_bytes(arrow.read_bytes()[:3000])
    net = load(tmp_path, 'hf("saved")')
    with pytest.raises(NetdslError, match=r"cannot read Arrow file .*data-00000-of-00001"
                                          r"\.arrow .*truncated"):
        load_dataset(net.graph, net.train)


def test_a_corrupt_image_names_its_file_and_row(tmp_path):
    import pyarrow as pa
    src = SAVED / "pictures" / "train"
    shutil.copytree(src, tmp_path / "saved")
    table = pa.ipc.open_stream(pa.memory_map(str(src / "data-00000-of-00001.arrow"))).read_all()
    rows = table.to_pylist()
    rows[4]["picture"]["bytes"] = rows[4]["picture"]["bytes"][:40]
    bad = pa.Table.from_pylist(rows, schema=table.schema)
    with pa.ipc.new_stream(str(tmp_path / "saved" / "data-00000-of-00001.arrow"),
                           bad.schema) as w:
        w.write_table(bad)
    net = load(tmp_path, 'hf("saved")')
    data = load_dataset(net.graph, net.train)
    with pytest.raises(NetdslError, match=r"data-00000-of-00001\.arrow, row 4 \(sample 4\): "
                                          r"not a readable image"):
        data.train.take(np.arange(6))


def test_without_pyarrow_the_extra_is_named(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    net = load(tmp_path, f'hf("{SAVED / "tensors"}")')
    with pytest.raises(NetdslError, match=r"pip install 'netdsl\[hf\]'"):
        load_dataset(net.graph, net.train)
