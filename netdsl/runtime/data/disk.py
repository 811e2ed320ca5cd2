"""Data sets read from disk sample by sample: `images(dir)`, `arrays(x, y)`,
`shards(pattern)`, `hf(dir)`, each a `SampleSplit` per split, checked against the network's inputs
before any step (labels in range, sample shapes after the transforms)."""
from __future__ import annotations

import numpy as np

from netdsl.config import HF, Arrays, Images, Shards, TrainConfig
from netdsl.errors import NetdslError
from netdsl.ir.graph import Graph
from netdsl.ir.types import NUMPY_DTYPE
from netdsl.runtime.data.arrow import ArrowDataset
from netdsl.runtime.data.samples import InputSpec, SampleSplit
from netdsl.runtime.data.sources import ArrayFiles, ImageFolder, Source, TarShards
from netdsl.runtime.data.transforms import Pipeline
from netdsl.step.graphs import loss_labels

KINDS = ("images", "arrays", "shards", "hf")


def open_source(cfg) -> Source:
    if isinstance(cfg, Images):
        return ImageFolder(cfg.path)
    if isinstance(cfg, Arrays):
        return ArrayFiles(cfg.x, cfg.y)
    if isinstance(cfg, HF):
        return ArrowDataset(cfg.path, cfg.split, cfg.image, cfg.label)
    return TarShards(cfg.path)


def input_specs(g: Graph, inputs, source: Source, name: str) -> list[InputSpec]:
    """What each network input is fed: the first the samples, the labels the source's
    labels (checked to be integers of one a sample, in range of the loss's classes)."""
    found = loss_labels(g)
    label_name = found[1] if found else (inputs[1].name if len(inputs) > 1 else None)
    specs = []
    for k, n in enumerate(inputs):
        is_label = n.name == label_name and k > 0
        if k > 1 or (k == 1 and not is_label):
            raise NetdslError(f"network `{g.name}` has inputs {', '.join(m.name for m in inputs)}"
                              f"; the data {name} feeds two: the samples, then the labels")
        if is_label:
            if source.labels is None:
                raise NetdslError(f"network `{g.name}` takes labels `{n.name}` but the data "
                                  f"{name} has none (give arrays(x=..., y=...))")
            if n.type.is_float or n.type.rank != 1:
                raise NetdslError(f"input `{n.name}` is {n.type}; the data {name} feeds it one "
                                  "integer class a sample ([N] integers)")
        specs.append(InputSpec(n.name, tuple(n.type.shape[1:]),
                               np.dtype(NUMPY_DTYPE[n.type.dtype]), is_label))
    if not specs[0].labels and len(specs[0].shape) == 3 and specs[0].shape[0] == 1:
        source.mode = "L"  # (a network of one channel takes images in grey)
    return specs


def check_labels(g: Graph, source: Source, specs: list[InputSpec]) -> None:
    """A label below 0 or at or past the loss's class count, named with its sample."""
    if source.labels is None or not any(s.labels for s in specs):
        return
    found = loss_labels(g)
    if not found:
        return
    logits, _, axis = found
    classes = g[logits].type.shape[axis]
    bad = np.flatnonzero((source.labels < 0) | (source.labels >= classes))
    if len(bad):
        i = int(bad[0])
        what = (f"{len(source.classes)} classes" if source.classes else "labels")
        raise NetdslError(f"label out of range: {source.where(i)} has label "
                          f"{int(source.labels[i])}, but network `{g.name}` has {classes} "
                          f"classes (the data has {what}; {len(bad):,} samples are out of "
                          "range)")


def _fixed_split(n: int, fraction: float) -> tuple[np.ndarray, np.ndarray | None]:
    """(train, test) indices: a fixed held-out part (seed 0, as digits')."""
    if not fraction:
        return np.arange(n, dtype=np.int64), None
    perm = np.random.default_rng(0).permutation(n)
    k = int(round(n * fraction))
    return np.sort(perm[k:]), np.sort(perm[:k])


def make(g: Graph, inputs, cfg, seed: int, train_cfg: TrainConfig | None, bad: str):
    """(train split, test split or None, the source) of a disk data set."""
    source = open_source(cfg)
    name = getattr(cfg, "path", None) or cfg.x
    specs = input_specs(g, inputs, source, name)
    check_labels(g, source, specs)
    tr = train_cfg.train_transforms if train_cfg else ()
    ev = train_cfg.eval_transforms if train_cfg else ()
    train_idx, test_idx = _fixed_split(len(source), getattr(cfg, "test_fraction", 0.0))
    order = None
    if isinstance(cfg, Shards):
        def order(s, e, source=source, buffer=cfg.shuffle_buffer):
            return source.stream_order(s, e, buffer)
    train = SampleSplit(source, train_idx, Pipeline(tr, seed), specs, bad, order)
    test = (SampleSplit(source, test_idx, Pipeline(ev, seed), specs, bad)
            if test_idx is not None else None)
    _check_shape(train)
    return train, test, source


def _check_shape(split: SampleSplit) -> None:
    """Sample 0 through the pipeline now, so a shape that cannot feed the network is said
    before the step is built (a bad first sample is left to the run's policy)."""
    from netdsl.runtime.data.sources import BadSample
    try:
        img = split.source.read(int(split.indices[0]))
    except BadSample:
        return
    for s in split.specs:
        if not s.labels:
            split._write(img, np.empty(s.shape, dtype=s.dtype), 0, int(split.indices[0]), s)
