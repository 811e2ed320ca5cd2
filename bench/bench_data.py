"""Real data in (images(), arrays(); netdsl/runtime/data), measured four ways, each against
its reference in the same run:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_data.py \
        [decode] [keeps-up] [big] [digits] [shards] [--dir /tmp/netdsl-bench-data]

decode    images/s through random_resized_crop(224) + flip + normalize on a folder of
          ImageNet-like JPEGs (500x375, quality 90), with 1 and 2 workers, against
          PyTorch's DataLoader with the same operations written on Pillow and NumPy
keeps-up  resnet20-cifar on a CIFAR-shaped PNG folder (random_crop(32, padding=4), flip),
          loaded in the background, against the same run on the same images held in
          memory (npz): wall time a step, waiting included
big       an arrays() source of 4 GB trains; the process's anonymous memory (RssAnon, read
          from /proc/self/status; the file's pages are the page cache's) against the
          step's planned peak
digits    the digits as a PNG image folder against digits(): test accuracy of
          examples/digits-cnn.net
shards    tar shards of those JPEGs read and decoded through a shuffle buffer in one
          process, against the webdataset package (when installed; not a dependency)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def _images(folder: Path, count: int, size: tuple[int, int], classes: int, fmt: str,
            seed: int = 0) -> Path:
    """A class folder of smooth random pictures (a low-resolution random image upscaled,
    plus a little noise: JPEGs of ImageNet's size and quality)."""
    from PIL import Image
    if (folder / ".done").exists():
        return folder
    rng = np.random.default_rng(seed)
    for k in range(count):
        c = folder / f"c{k % classes:02d}"
        c.mkdir(parents=True, exist_ok=True)
        small = rng.integers(0, 256, (max(size[1] // 16, 2), max(size[0] // 16, 2), 3),
                             dtype=np.uint8)
        img = np.asarray(Image.fromarray(small).resize(size, Image.Resampling.BICUBIC),
                         dtype=np.int16)
        img = np.clip(img + rng.integers(-12, 13, img.shape), 0, 255).astype(np.uint8)
        opts = {"quality": 90} if fmt == "jpg" else {}
        Image.fromarray(img).save(c / f"{k:06d}.{fmt}", **opts)
    (folder / ".done").write_text("")
    return folder


NET_224 = """
network imagenet_in {
    input x: f32[N, 3, 224, 224]
    input y: i64[N]
    logits = linear(flatten(global_avgpool(x)), 10)
    output logits
    loss softmax_cross_entropy(logits, y)
}
train {
    data = images("%s")
    batch = 64
    train_transforms = [random_resized_crop(224), flip(),
                        normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]
}
"""


def _torch_loader(folder: Path, workers: int, batch: int):
    """PyTorch's DataLoader over the folder, its transforms on Pillow and NumPy:
    torchvision's RandomResizedCrop box, a bilinear resize, a flip, ToTensor, Normalize."""
    import math
    import random

    import torch
    from PIL import Image
    files = sorted(folder.glob("*/*.jpg"))
    labels = [int(f.parent.name[1:]) for f in files]
    mean = np.array([0.485, 0.456, 0.406], np.float32)
    std = np.array([0.229, 0.224, 0.225], np.float32)

    class Folder(torch.utils.data.Dataset):
        def __len__(self):
            return len(files)

        def __getitem__(self, i):
            img = Image.open(files[i]).convert("RGB")
            w, h = img.size
            for _ in range(10):
                area = w * h * random.uniform(0.08, 1.0)
                ar = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
                cw, ch = round(math.sqrt(area * ar)), round(math.sqrt(area / ar))
                if 0 < cw <= w and 0 < ch <= h:
                    top, left = random.randint(0, h - ch), random.randint(0, w - cw)
                    break
            else:
                top, left, ch, cw = 0, 0, h, w
            img = img.resize((224, 224), Image.Resampling.BILINEAR,
                             box=(left, top, left + cw, top + ch))
            if random.random() < 0.5:
                img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            a = (np.asarray(img, np.float32) / 255 - mean) / std
            return torch.from_numpy(a.transpose(2, 0, 1).copy()), labels[i]

    return torch.utils.data.DataLoader(Folder(), batch_size=batch, shuffle=True,
                                       num_workers=workers, drop_last=True,
                                       persistent_workers=False)


def _rate(batches, batch: int, count: int) -> float:
    """Images/s over `count` batches after the first (the workers' start excluded)."""
    it = iter(batches)
    next(it)
    start = time.perf_counter()
    for _ in range(count):
        next(it)
    return count * batch / (time.perf_counter() - start)


def decode(args) -> dict:
    import netdsl
    from netdsl.runtime.data import load_dataset
    from netdsl.runtime.data.background import BackgroundLoader
    folder = _images(Path(args.dir) / "jpeg", args.jpegs, (500, 375), 10, "jpg")
    net_file = Path(args.dir) / "imagenet_in.net"
    net_file.write_text(NET_224 % folder)
    net = netdsl.load(net_file)
    data = load_dataset(net.graph, net.train)
    count = args.jpegs // 64 - 2
    out = {}
    for rnd in range(args.rounds):
        for k in (1, 2):
            loader = BackgroundLoader(data.train, 64, rnd, workers=k)
            try:
                mine = _rate(iter(lambda: loader.next(), None), 64, count)
            finally:
                loader.close()
            theirs = _rate(_torch_loader(folder, k, 64), 64, count)
            best = out.setdefault(k, [0.0, 0.0])
            best[0], best[1] = max(best[0], mine), max(best[1], theirs)
            print(f"round {rnd}, {k} worker(s): netdsl {mine:.0f} images/s, PyTorch "
                  f"DataLoader {theirs:.0f}, ratio {mine / theirs:.2f}", flush=True)
    return {f"workers={k}": {"netdsl": v[0], "torch": v[1], "ratio": v[0] / v[1]}
            for k, v in out.items()}


def _run(net: Path, *extra) -> dict:
    cmd = [PY, "-m", "netdsl_cli.app", "run", str(net), "--json", "--eval-samples", "0",
           *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr}{r.stdout}")
    return json.loads(r.stdout)


def keeps_up(args) -> dict:
    from PIL import Image
    folder = _images(Path(args.dir) / "cifar", 5000, (32, 32), 10, "png")
    npz = Path(args.dir) / "cifar.npz"
    if not npz.exists():
        files = sorted(folder.glob("*/*.png"))
        x = np.stack([np.asarray(Image.open(f)).transpose(2, 0, 1) for f in files])
        y = np.array([int(f.parent.name[1:]) for f in files])
        np.savez(npz, x=(x / 255).astype(np.float32), y=y)
    src = (ROOT / "examples/resnet20-cifar.net").read_text()
    head = src[:src.index("train {")]
    nets = {}
    for name, data in (("memory", f'npz("{npz}")'), ("images", f'images("{folder}")')):
        nets[name] = Path(args.dir) / f"r20-{name}.net"
        nets[name].write_text(head + f"train {{ data = {data}; batch = {args.batch}\n"
                              "  train_transforms = [random_crop(32, padding=4), flip()] }\n")
    rows: dict[str, list] = {}
    for _ in range(args.rounds):
        for name, workers in [("memory", "0")] + [("images", k)
                                                  for k in args.workers.split(",")]:
            r = _run(nets[name], "--steps", str(args.steps), "--workers", workers)
            wall = r["step_time_s"] + r["data_wait_s"]
            rows.setdefault(f"{name}, workers {workers}", []).append(
                (wall, r["step_time_s"], r["data_wait_s"]))
            print(f"{name} (--workers {workers}): step {r['step_time_s']:.3f} s + "
                  f"wait {r['data_wait_s']:.4f} s", flush=True)
    best = {k: min(v) for k, v in rows.items()}
    ref = best["memory, workers 0"][0]
    return {k: {"wall_s": w, "step_s": s, "wait_s": d, "vs_memory": w / ref}
            for k, (w, s, d) in best.items()}


NET_BIG = """
network big_in {
    input x: f32[N, 3, 64, 64]
    input y: i64[N]
    h = relu(conv2d(x, 16, kernel=3, stride=2, padding=1))
    logits = linear(flatten(global_avgpool(h)), 10)
    output logits
    loss softmax_cross_entropy(logits, y)
}
train { data = arrays(x="big-x.npy", y="big-y.npy"); batch = 64 }
"""


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def big(args) -> dict:
    import netdsl
    from netdsl.runtime.options import RunOptions
    from netdsl.runtime.trainer import Trainer
    d = Path(args.dir)
    n = int(args.gb * 1e9) // (3 * 64 * 64 * 4)
    if not (d / "big-y.npy").exists():
        x = np.lib.format.open_memmap(d / "big-x.npy", "w+", np.float32, (n, 3, 64, 64))
        rng = np.random.default_rng(0)
        for i in range(0, n, 4096):
            x[i:i + 4096] = rng.standard_normal((min(4096, n - i), 3, 64, 64), np.float32)
        x.flush()
        del x
        np.save(d / "big-y.npy", np.arange(n) % 10)
    (d / "big.net").write_text(NET_BIG)
    net = netdsl.load(d / "big.net")
    before = _rss_anon()
    tr = Trainer(net.graph, net.train, RunOptions(steps=args.big_steps, eval_samples=0,
                                                  workers=2))
    r = tr.fit()
    after = _rss_anon()
    size = os.path.getsize(d / "big-x.npy")
    return {"file_bytes": size, "samples": n, "steps": r.steps,
            "samples_read": r.steps * 64, "rss_anon_before": before,
            "rss_anon_after": after, "planned_peak_bytes": r.planned_peak_bytes,
            "beyond_plan": after - r.planned_peak_bytes}


def digits(args) -> dict:
    from PIL import Image
    from sklearn.datasets import load_digits
    folder = Path(args.dir) / "digits-png"
    if not (folder / ".done").exists():
        dg = load_digits()
        for k, (img, y) in enumerate(zip(dg.images, dg.target)):
            (folder / str(y)).mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.clip(img * 16, 0, 255).astype(np.uint8)).save(
                folder / str(y) / f"{k:04d}.png")
        (folder / ".done").write_text("")
    src = (ROOT / "examples/digits-cnn.net").read_text()
    png_net = Path(args.dir) / "digits-png.net"
    png_net.write_text(src.replace("data      = digits()",
                                   f'data      = images("{folder}", test_fraction=0.2)'))
    out = {}
    for name, f in (("digits()", ROOT / "examples/digits-cnn.net"), ("images()", png_net)):
        r = subprocess.run([PY, "-m", "netdsl_cli.app", "run", str(f), "--json"],
                           capture_output=True, text=True, cwd=ROOT)
        out[name] = json.loads(r.stdout)["test_accuracy"]
        print(f"{name}: test accuracy {out[name]:.4f}", flush=True)
    return out


def _shards(folder: Path, out: Path, per: int) -> str:
    """The JPEG folder as WebDataset shards of `per` records (KEY.jpg + KEY.cls)."""
    import io
    import tarfile
    files = sorted(folder.glob("*/*.jpg"))
    count = -(-len(files) // per)
    if not (out / ".done").exists():
        out.mkdir(parents=True, exist_ok=True)
        for s in range(count):
            with tarfile.open(out / f"part-{s:04d}.tar", "w") as tar:
                for f in files[s * per:(s + 1) * per]:
                    for name, data in ((f"{f.stem}.jpg", f.read_bytes()),
                                       (f"{f.stem}.cls", f.parent.name[1:].encode())):
                        info = tarfile.TarInfo(name)
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
        (out / ".done").write_text("")
    return str(out / ("part-{0000.." + f"{count - 1:04d}" + "}.tar"))


def shards(args) -> dict:
    """Reading and decoding tar shards in one process, through a shuffle buffer of 1,000:
    netdsl's reader (headers indexed, records by offset) against the webdataset package's
    stream, where it is installed (it is no dependency of netdsl)."""
    from netdsl.runtime.data.sources import TarShards
    folder = _images(Path(args.dir) / "jpeg", args.jpegs, (500, 375), 10, "jpg")
    pattern = _shards(folder, Path(args.dir) / "shards", 500)
    out = {}
    for rnd in range(args.rounds):
        start = time.perf_counter()
        src = TarShards(pattern)
        order = src.stream_order(rnd, 0, 1000)
        index_s = time.perf_counter() - start
        for i in order:
            src.read(int(i))
        mine = len(order) / (time.perf_counter() - start)
        try:
            import webdataset as wds
        except ImportError:
            theirs = None
        else:
            from netdsl.runtime.data.sources import expand
            start = time.perf_counter()
            ds = wds.WebDataset(expand(pattern), shardshuffle=False, empty_check=False)
            n = sum(1 for s in ds.shuffle(1000).decode("pil") if s["jpg"].convert("RGB"))
            theirs = n / (time.perf_counter() - start)
        out["netdsl"] = max(out.get("netdsl", 0.0), mine)
        out["index_s"] = min(out.get("index_s", 1e9), index_s)
        if theirs is not None:
            out["webdataset"] = max(out.get("webdataset", 0.0), theirs)
        print(f"round {rnd}: netdsl {mine:.0f} records/s (index {index_s:.2f} s), "
              f"webdataset {theirs and round(theirs)} records/s", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts", nargs="*", default=["decode", "keeps-up", "big", "digits"])
    ap.add_argument("--dir", default="/tmp/netdsl-bench-data")
    ap.add_argument("--jpegs", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--workers", default="1,2", help="keeps-up: the --workers to run")
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--big-steps", type=int, default=200)
    args = ap.parse_args()
    if os.environ.get("OPENBLAS_CORETYPE") or os.environ.get("OPENBLAS_L2_SIZE"):
        print("warning: OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE are set; run under "
              "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE", file=sys.stderr)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    parts = {"decode": decode, "keeps-up": keeps_up, "big": big, "digits": digits,
             "shards": shards}
    for p in args.parts:
        result = parts[p](args)
        print(json.dumps({p: result}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
