"""What a training run asks of its data, beside the step: the loader that feeds it
(`open_loader`: in the background for data read from disk), the rows of each batch this
process reads (`rows_read`), and the class names written next to its checkpoints."""
from __future__ import annotations

import json
import os
from pathlib import Path

from netdsl.ir.graph import Graph
from netdsl.runtime.data.background import BackgroundLoader, default_workers
from netdsl.runtime.data.sampler import Loader
from netdsl.runtime.data.samples import SampleSplit

CLASSES_FILE = "classes.json"


def open_loader(split, batch: int, seed: int, workers: int | None, ranks_here: int = 1,
                cpu_step: bool = False):
    """The training split's loader: `workers` processes in the background for a split read
    from disk (None: `default_workers`, or one where the step itself runs on the CPU's
    cores; 0: in this process), else the plain loader."""
    if isinstance(split, SampleSplit):
        if workers is None:
            workers = 1 if cpu_step else default_workers(ranks_here)
        k = workers
        if k > 0:
            return BackgroundLoader(split, batch, seed, k)
    return Loader(split, batch, seed)


def rows_read(graph: Graph, name: str, batch: int) -> tuple[int, int]:
    """The rows [lo, hi) of input `name` that this process's step reads: a data split's
    copies over MPI read their replica's rows (node meta `rows`), a whole step all."""
    spans = [n.meta.get("rows") or (0, batch) for n in graph.nodes
             if n.op == "input" and n.meta.get("feed_of", n.name) == name]
    if not spans:
        return 0, 0
    return min(lo for lo, _ in spans), max(hi for _, hi in spans)


def write_classes(folder: str, classes: list[str]) -> None:
    """`classes.json` in the checkpoint folder: the class names by label (written whole,
    then renamed over the old one)."""
    path = Path(folder) / CLASSES_FILE
    tmp = path.with_name(f".{CLASSES_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps(classes, indent=0, ensure_ascii=False) + "\n",
                   encoding="utf-8")
    os.replace(tmp, path)
