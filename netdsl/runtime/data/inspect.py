"""`netdsl data FILE`: what the train section's data is, and how fast this machine loads
it: counts, classes, a batch's shapes and dtypes, a few samples as a picture, and the
loader's images/s with the run's workers."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np

from netdsl.config import TrainConfig
from netdsl.ir.graph import Graph
from netdsl.runtime.data import load_dataset
from netdsl.runtime.data.feed import open_loader


@dataclass
class DataReport:
    network: str
    data: str  # the data set's kind
    name: str
    train_samples: int
    test_samples: int
    classes: list[str] | None
    batch: int
    workers: int  # 0: loaded in this process
    inputs: list[dict] = field(default_factory=list)  # name, shape, dtype, min, max
    batches_timed: int = 0
    seconds: float = 0.0
    images_per_s: float = 0.0
    skipped_samples: int = 0
    png: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


def describe(forward: Graph, cfg: TrainConfig, workers: int | None, batches: int = 8,
             bad: str = "stop", png: str | None = None, progress=None) -> DataReport:
    """Load `batches` batches of the training data as a run would (its transforms, its
    workers) and say what they are; `png`: the first batch's first 16 samples as a grid;
    `progress(done, total)` is told after each batch."""
    data = load_dataset(forward, cfg, bad)
    batch = min(cfg.batch, len(data.train))
    loader = open_loader(data.train, batch, cfg.seed, workers)
    workers_used = getattr(loader, "workers", 0)
    try:
        first = [None if a is None else np.array(a) for a in loader.next()]
        start = time.perf_counter()
        for k in range(batches):
            if progress is not None:
                progress(k, batches)
            loader.next()
        seconds = time.perf_counter() - start
    finally:
        loader.close()
    report = DataReport(forward.name, cfg.data.kind, data.name, len(data.train),
                        len(data.test) if data.test is not None else 0, data.classes,
                        batch, workers_used, batches_timed=batches, seconds=seconds,
                        images_per_s=batches * batch / seconds if seconds > 0 else 0.0,
                        skipped_samples=len(loader.skipped))
    for name, a in zip(data.input_names, first):
        report.inputs.append({"name": name, "shape": list(a.shape), "dtype": str(a.dtype),
                              "min": float(a.min()), "max": float(a.max())})
    if png is not None:
        grid(first[0], getattr(data.train, "pipeline", None), png)
        report.png = png
    return report


def grid(x: np.ndarray, pipeline, path: str, count: int = 16) -> None:
    """Samples [n, C, H, W] as one PNG, 4 a row, normalization undone."""
    from netdsl.runtime.data.sources import pillow
    x = x[:count].astype(np.float64)
    if pipeline is not None:
        x = pipeline.unnormalize(x)
    elif x.max() > 1.0:  # (raw 8-bit values)
        x = x / 255.0
    n, c, h, w = x.shape
    cols = min(4, n)
    rows = -(-n // cols)
    canvas = np.zeros((rows * (h + 2), cols * (w + 2), c), dtype=np.uint8)
    for k in range(n):
        r, q = divmod(k, cols)
        tile = np.clip(x[k].transpose(1, 2, 0) * 255 + 0.5, 0, 255).astype(np.uint8)
        canvas[r * (h + 2) + 1:r * (h + 2) + 1 + h, q * (w + 2) + 1:q * (w + 2) + 1 + w] = tile
    pillow().fromarray(canvas[..., 0] if c == 1 else canvas).save(path)


def save_images(forward: Graph, cfg: TrainConfig, folder: str, progress=None) -> int:
    """Write the training and held-out samples of the data as an image folder (`folder/
    LABEL/NNNNN.png`, 8-bit, values in [0, 1] scaled by 255): what `images(folder)` reads.
    Returns the count written; a folder that holds anything already is refused."""
    from pathlib import Path

    from netdsl.errors import NetdslError
    from netdsl.runtime.data import batches
    from netdsl.runtime.data.sources import pillow
    Image = pillow()
    out = Path(folder)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise NetdslError(f"--save-images {folder} is not an empty folder; give a new one")
    data = load_dataset(forward, cfg)
    if len(data.input_names) < 2:
        raise NetdslError(f"network `{forward.name}` takes no labels: an image folder needs "
                          "one class a sample")
    parts = [data.train] + ([data.test] if data.test is not None else [])
    total, done = sum(len(p) for p in parts), 0
    for part in parts:
        for x, y in (b[:2] for b in batches(part, 256)):
            if x.ndim != 4 or x.shape[1] not in (1, 3) or y.ndim != 1:
                raise NetdslError(f"the data of `{forward.name}` is not images with one "
                                  f"class each (samples shaped {list(x.shape[1:])})")
            pixels = np.clip(np.asarray(x, np.float64) * 255 + 0.5, 0, 255).astype(np.uint8)
            for img, label in zip(pixels, y):
                (out / str(int(label))).mkdir(parents=True, exist_ok=True)
                Image.fromarray(img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0)).save(
                    out / str(int(label)) / f"{done:05d}.png")
                done += 1
            if progress is not None:
                progress(done, total)
    return done
