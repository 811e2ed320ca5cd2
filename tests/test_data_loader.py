"""Background loading: worker processes into shared memory give the batches the plain
loader gives, resume exactly, read only a rank's rows, and fail in words, never a hang
(netdsl/runtime/data/background.py)."""
from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
from test_data_sources import load, write_folder
from typer.testing import CliRunner

from netdsl.errors import NetdslError
from netdsl.runtime.data import load_dataset
from netdsl.runtime.data.background import BackgroundLoader
from netdsl.runtime.data.feed import rows_read
from netdsl.runtime.data.sampler import Loader
from netdsl.runtime.options import RunOptions
from netdsl.runtime.trainer import Trainer

pytest.importorskip("PIL.Image")


@pytest.fixture
def folder_net(tmp_path):
    write_folder(tmp_path / "pics", per=6)
    return load(tmp_path, 'images("pics", test_fraction=0.2)')


def test_workers_give_the_plain_loaders_batches_across_epochs(folder_net):
    data = load_dataset(folder_net.graph, folder_net.train)
    plain = Loader(data.train, 4, 5)
    bg = BackgroundLoader(data.train, 4, 5, workers=2)
    try:
        for _ in range(2 * plain.batches_per_epoch + 1):  # (into a third epoch)
            for a, b in zip(plain.next(), bg.next(), strict=True):
                assert np.array_equal(a, b)
        assert bg.epoch == plain.epoch == 2
    finally:
        bg.close()
    assert not any(p.is_alive() for p in bg._procs)
    assert not any(os.path.exists(f"/dev/shm/{b.name}") for b in bg._blocks)


def test_resume_with_workers_is_the_uninterrupted_run(folder_net, tmp_path):
    """6 steps with 2 workers == 3 steps, a checkpoint, and 3 more resumed (mid-epoch:
    an epoch is 3 batches of 4), with 1 worker and with none."""
    cfg = folder_net.train
    full = Trainer(folder_net.graph, cfg, RunOptions(steps=6, workers=2)).fit()
    ck = str(tmp_path / "ck")
    first = Trainer(folder_net.graph, cfg, RunOptions(steps=4, workers=1,
                                                      checkpoint=ck)).fit()
    rest = Trainer(folder_net.graph, cfg, RunOptions(steps=6, workers=0, checkpoint=ck,
                                                     resume=True)).fit()
    assert first.losses + rest.losses == full.losses
    assert full.test_accuracy == rest.test_accuracy


def test_data_replicas_read_disjoint_rows_and_no_sample_twice_in_an_epoch(folder_net):
    """Two data-parallel replicas (as two MPI ranks are fed): each reads its rows of the
    global batch only, the labels whole; over an epoch no sample is read twice."""
    data = load_dataset(folder_net.graph, folder_net.train)
    src = data.train.source
    read: list[list[int]] = [[], []]
    inner = src.read

    def counting(i, who):
        read[who].append(i)
        return inner(i)
    loaders = [Loader(data.train, 4, 5) for _ in range(2)]
    whole = Loader(data.train, 4, 5)
    for r, lo in enumerate((0, 2)):
        loaders[r].only([True, True], (lo, lo + 2))
    for _ in range(whole.batches_per_epoch):
        src.read = inner
        want = whole.next()
        for r, lo in enumerate((0, 2)):
            src.read = lambda i, r=r: counting(i, r)
            x, y = loaders[r].next()
            assert np.array_equal(x[lo:lo + 2], want[0][lo:lo + 2])
            assert np.array_equal(y, want[1])
    src.read = inner
    assert len(read[0]) == len(read[1]) == 2 * whole.batches_per_epoch
    assert not set(read[0]) & set(read[1])
    assert len(set(read[0] + read[1])) == len(read[0] + read[1])


def test_rows_read_follows_a_data_splits_copies():
    import netdsl
    from netdsl.options import StepOptions
    net = netdsl.loads("network m { input x: f32[N, 4]\n input y: i64[N]\n"
                       "loss softmax_cross_entropy(linear(x, 3), y) }")
    step = netdsl.api.build(net, StepOptions(batch=8, devices=2, split="data"))
    assert rows_read(step.graph, "x", 8) == (0, 8)  # (one process holds both replicas)
    part = [n for n in step.graph.nodes if n.op == "input" and n.meta.get("rows") == (4, 8)]
    assert part, "a data split's copies say their rows"
    from netdsl.ir.graph import Graph
    mine = Graph("rank1", [n for n in step.graph.nodes if n.meta.get("rows") != (0, 4)],
                 {}, 8)
    assert rows_read(mine, "x", 8) == (4, 8)


def test_a_worker_that_dies_is_named_and_nothing_hangs(folder_net):
    data = load_dataset(folder_net.graph, folder_net.train)
    bg = BackgroundLoader(data.train, 4, 5, workers=2)
    try:
        bg.next()
        os.kill(bg._procs[1].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(NetdslError, match=r"data worker 1 \(pid \d+\) was killed by "
                                              r"SIGKILL while making a batch of samples .*pics"):
            for _ in range(4):
                bg.next()
        assert time.monotonic() - start < 10
    finally:
        bg.close()
    assert not any(p.is_alive() for p in bg._procs)


def test_a_batch_that_does_not_come_stops_the_run(folder_net):
    data = load_dataset(folder_net.graph, folder_net.train)
    bg = BackgroundLoader(data.train, 4, 5, workers=1, timeout=1.0)
    try:
        bg.next()
        os.kill(bg._procs[0].pid, signal.SIGSTOP)  # alive, and answering nothing
        with pytest.raises(NetdslError, match=r"made no batch in 1 s"):
            for _ in range(4):
                bg.next()
    finally:
        bg.close()


def test_a_corrupt_image_mid_run_stops_with_its_name_and_the_checkpoint_kept(tmp_path):
    from netdsl_cli.app import app
    write_folder(tmp_path / "pics", per=6)
    net_file = tmp_path / "tiny.net"
    load(tmp_path, 'images("pics")')
    runner = CliRunner()
    ck = tmp_path / "ck"
    # which sample the fourth batch reads first, then that file made corrupt
    data = load_dataset(load(tmp_path, 'images("pics")').graph,
                        load(tmp_path, 'images("pics")').train)
    loader = Loader(data.train, 4, 5)
    for _ in range(3):
        loader.advance()
    victim = data.train.source.root / data.train.source.files[int(loader.advance()[1][0])]
    victim.write_bytes(b"not an image")
    r = runner.invoke(app, ["run", str(net_file), "--steps", "5", "--workers", "2",
                            "--checkpoint", str(ck)])
    assert r.exit_code == 1, r.output
    said = " ".join(r.output.split())
    assert f"bad data: {victim} (sample" in said and "not a readable image" in said
    assert "holds step 3: --resume goes on from there" in said
    assert "Traceback" not in r.output
    r = runner.invoke(app, ["run", str(net_file), "--steps", "5", "--workers", "2",
                            "--checkpoint", str(ck), "--resume", "--bad-images", "skip",
                            "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout[r.stdout.index("{"):])
    assert out["resumed_from"] == 3 and out["steps"] == 5 and out["skipped_samples"] == 1
    assert any(str(victim) in w for w in out["warnings"])


def test_netdsl_data_reports_counts_classes_shapes_speed_and_a_png(folder_net, tmp_path):
    from netdsl_cli.app import app
    png = tmp_path / "grid.png"
    r = CliRunner().invoke(app, ["data", folder_net.file, "--workers", "1", "--batches", "2",
                                 "--png", str(png), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["train_samples"], out["test_samples"]) == (14, 4)
    assert out["classes"] == ["ant", "bee", "cat"] and out["workers"] == 1
    assert out["inputs"][0]["shape"] == [4, 3, 16, 16] and out["inputs"][1]["dtype"] == "int64"
    assert out["images_per_s"] > 0
    from PIL import Image
    assert Image.open(png).size == (4 * 18, 18)
    r = CliRunner().invoke(app, ["data", folder_net.file, "--workers", "0", "--batches", "1"])
    assert r.exit_code == 0 and "classes: 3 (ant, bee, cat)" in r.output
    assert "in this process" in r.output


def test_netdsl_data_saves_a_data_set_as_the_image_folder_images_reads(tmp_path):
    """--save-images writes every sample (training, then held out) as LABEL/N.png; the
    folder read back with images() gives the same pixels (8-bit) and labels."""
    from netdsl_cli.app import app
    rng = np.random.default_rng(0)
    x = (rng.integers(0, 256, (10, 3, 16, 16)) / 255).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, y=np.arange(10) % 3)
    npz_net = load(tmp_path, 'npz(path="d.npz")', train="", eval="")
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["data", npz_net.file, "--save-images", str(out)])
    assert r.exit_code == 0 and "wrote 10 images" in r.output, r.output
    back = load(tmp_path, 'images("out")', train="", eval="")
    data = load_dataset(back.graph, back.train)
    assert data.classes == ["0", "1", "2"]
    got = {int(np.round(a.sum() * 255)): int(c) for a, c in zip(*data.train.take(np.arange(10)))}
    want = {int(np.round(a.sum() * 255)): int(c) for a, c in zip(x, np.arange(10) % 3)}
    assert got == want
    r = CliRunner().invoke(app, ["data", npz_net.file, "--save-images", str(out)])
    assert r.exit_code == 1 and "is not an empty folder" in r.output


class FakeGpu:
    """A stand-in for the CuPy backend's two calls the loader makes: `pin_host` and
    `upload` (host arrays play the device's)."""

    name, xp = "cupy", np

    def __init__(self):
        self.pinned, self.unpinned, self.uploads = [], [], []
        self.synced_before_unpin = None

    def pin_host(self, array):
        self.pinned.append(array.ctypes.data)
        ptr = array.ctypes.data
        return lambda: self.unpinned.append(ptr)

    def synchronize(self):
        if self.synced_before_unpin is None:
            self.synced_before_unpin = not self.unpinned

    def upload(self, host, out):
        out[...] = host
        self.uploads.append(out)


def test_on_a_gpu_the_next_batch_is_sent_while_the_step_runs(folder_net):
    """After the step is queued (`send_ahead`), the next batch is copied from its
    page-locked slot into one of two device buffers used in turn; `next` then gives its
    host arrays (labels for the accuracy) and `device_batch`, what the step is fed."""
    data = load_dataset(folder_net.graph, folder_net.train)
    plain = Loader(data.train, 4, 5)
    bg = BackgroundLoader(data.train, 4, 5, workers=2)
    gpu = FakeGpu()
    try:
        first = bg.next()
        assert bg.device_batch is None  # (nothing was sent before the first step)
        assert all(np.array_equal(a, b) for a, b in zip(first, plain.next()))
        buffers = []
        for step in range(5):
            bg.send_ahead(gpu)
            assert len(gpu.uploads) == 2 * (step + 1)  # x and y, before `next` is called
            host = bg.next()
            want = plain.next()
            assert all(np.array_equal(d, w) for d, w in zip(bg.device_batch, want))
            assert all(np.array_equal(h, w) for h, w in zip(host, want))
            assert not np.shares_memory(bg.device_batch[0], host[0])
            buffers.append(id(bg.device_batch[0]))
        assert len(set(buffers)) == 2 and buffers[0] != buffers[1]  # two sets, in turn
        assert len(gpu.pinned) == bg.prefetch + 1  # every slot, once
    finally:
        bg.close()
    assert sorted(gpu.unpinned) == sorted(gpu.pinned) and gpu.synced_before_unpin


def test_a_rank_that_reads_no_samples_starts_no_workers(folder_net):
    data = load_dataset(folder_net.graph, folder_net.train)
    bg = BackgroundLoader(data.train, 4, 5, workers=2)
    bg.only([False, True], (0, 4))  # (a pipeline's last stage: the labels only)
    try:
        x, y = bg.next()
        bg.send_ahead(FakeGpu())
    finally:
        bg.close()
    assert x is None and y.shape == (4,) and not bg._procs and bg.device_batch is None


def test_workers_end_when_their_main_process_is_killed(folder_net, tmp_path):
    """A main process killed outright (nothing tells its workers to stop) leaves no
    worker behind: each sees its parent gone within a second or two and ends."""
    import subprocess
    import sys
    script = tmp_path / "orphan.py"
    script.write_text(f"""
import os, sys
import netdsl
from netdsl.runtime.data import load_dataset
from netdsl.runtime.data.background import BackgroundLoader
net = netdsl.load({str(folder_net.file)!r})
data = load_dataset(net.graph, net.train)
bg = BackgroundLoader(data.train, 4, 5, workers=2)
bg.next()
print(" ".join(str(p.pid) for p in bg._procs), flush=True)
os._exit(0)
""")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2, out.stderr

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        status = open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0]
        return status != "Z"
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids)


def test_a_failure_found_while_sending_ahead_is_said_by_the_next_batch(folder_net):
    """send_ahead runs after a step is queued: a worker's death found there is raised by
    the following `next`, so that the trainer counts (and saves) the step queued."""
    data = load_dataset(folder_net.graph, folder_net.train)
    fill = data.train.fill
    data.train.fill = lambda *a: time.sleep(0.5) or fill(*a)  # (each batch takes 0.5 s)
    bg = BackgroundLoader(data.train, 4, 5, workers=1)
    gpu = FakeGpu()
    try:
        bg.next()
        bg._procs[0].kill()  # (the next batch not yet made)
        bg.send_ahead(gpu)  # no error here
        with pytest.raises(NetdslError, match="data worker 0 .* was killed by SIGKILL"):
            bg.next()
    finally:
        bg.close()
