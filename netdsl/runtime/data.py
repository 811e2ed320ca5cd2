"""Datasets and the epoch-based, seeded loader that feeds a network's inputs.

A dataset is a pair of arrays per split: `x` for the network's first input and `y` for its
second (the labels); a network with one input gets `x` only. Synthetic data is seeded and
shaped from the network's input types; integer inputs are drawn below the size their
consumer needs (class count of the loss, rows of an embedding table).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from netdsl.config import Digits, Npz, Synthetic
from netdsl.errors import NetdslError
from netdsl.ir.graph import Graph
from netdsl.ir.types import NUMPY_DTYPE


@dataclass
class Split:
    arrays: list[np.ndarray]  # one per network input, leading dim = samples

    def __len__(self) -> int:
        return len(self.arrays[0]) if self.arrays else 0


@dataclass
class Dataset:
    name: str
    train: Split
    test: Split | None
    input_names: list[str]


def _int_range(g: Graph, name: str) -> int | None:
    """How large integer values fed to input `name` may be, from what consumes it."""
    for n in g.nodes:
        if name in n.inputs:
            if n.op == "embedding":
                return n.attrs["num"]
            if n.op == "softmax_cross_entropy" and n.inputs[1] == name:
                return g[n.inputs[0]].type.shape[-1]
    return None


def _inputs(g: Graph):
    return [n for n in g.nodes if n.op == "input" and n.attrs.get("role") != "lr"]


def synthetic(g: Graph, cfg: Synthetic, seed: int) -> Dataset:
    """Seeded random data of the network's input shapes; labels are a fixed function of x
    (the class of a random linear projection) so that a network can learn something."""
    rng = np.random.default_rng(seed)
    ins = _inputs(g)
    splits = []
    for count in (cfg.samples, cfg.test_samples):
        arrays = []
        for n in ins:
            shape = (count,) + tuple(n.type.shape[1:])
            if n.type.is_float:
                arrays.append(rng.standard_normal(shape).astype(NUMPY_DTYPE[n.type.dtype]))
            else:
                hi = cfg.classes if (cfg.classes and _is_label(g, n.name)) else None
                hi = hi or _int_range(g, n.name) or cfg.classes or 2
                arrays.append(rng.integers(0, hi, size=shape).astype(NUMPY_DTYPE[n.type.dtype]))
        splits.append(arrays)
    labelled = len(ins) >= 2 and _is_label(g, ins[1].name)
    x_t, y_t = (ins[0].type, ins[1].type) if labelled else (None, None)
    # next-token prediction ([N, T] tokens, [N, T] labels): sequences that follow a fixed
    # random successor table, the labels being the tokens shifted by one; a causal model
    # learns the table
    if labelled and not x_t.is_float and x_t.rank == 2 and y_t.shape == x_t.shape:
        vocab = min(_int_range(g, ins[0].name) or 2, _int_range(g, ins[1].name) or 2)
        succ = np.random.default_rng(seed + 1).permutation(vocab)
        for arrays in splits:
            if len(arrays[0]):
                seq = np.empty((len(arrays[0]), x_t.shape[1] + 1), dtype=np.int64)
                seq[:, 0] = rng.integers(0, vocab, len(arrays[0]))
                for t in range(x_t.shape[1]):
                    seq[:, t + 1] = succ[seq[:, t]]
                arrays[0] = seq[:, :-1].astype(arrays[0].dtype)
                arrays[1] = seq[:, 1:].astype(arrays[1].dtype)
    # dense labels ([N, C, *S] images, [N, *S] labels: segmentation): the label of each
    # position is the argmax of a fixed random projection of the channels there
    elif labelled and x_t.is_float and x_t.rank >= 3 and y_t.shape[1:] == x_t.shape[2:]:
        classes = _int_range(g, ins[1].name) or cfg.classes or 2
        proj = np.random.default_rng(seed + 1).standard_normal((x_t.shape[1], classes))
        for arrays in splits:
            if len(arrays[0]):
                scores = np.moveaxis(arrays[0].astype(np.float64), 1, -1) @ proj
                arrays[1] = scores.argmax(-1).astype(arrays[1].dtype)
    # make labels learnable: argmax of a fixed random projection of the first input
    elif len(ins) >= 2 and _is_label(g, ins[1].name) and ins[0].type.is_float:
        classes = _int_range(g, ins[1].name) or cfg.classes or 2
        feat = int(np.prod(ins[0].type.shape[1:]))
        proj = np.random.default_rng(seed + 1).standard_normal((feat, classes))
        for arrays in splits:
            if len(arrays[0]):
                scores = arrays[0].reshape(len(arrays[0]), -1).astype(np.float64) @ proj
                arrays[1] = scores.argmax(1).astype(arrays[1].dtype).reshape(arrays[1].shape)
    # integer tokens ([N, T] into an embedding): the label is a fixed linear function of
    # the bag of tokens, which an embedding + pooling network can learn
    elif len(ins) >= 2 and _is_label(g, ins[1].name) and not ins[0].type.is_float:
        classes = _int_range(g, ins[1].name) or cfg.classes or 2
        vocab = _int_range(g, ins[0].name) or 2
        proj = np.random.default_rng(seed + 1).standard_normal((vocab, classes))
        for arrays in splits:
            if len(arrays[0]):
                tok = arrays[0].reshape(len(arrays[0]), -1)
                scores = proj[tok].sum(1)
                arrays[1] = scores.argmax(1).astype(arrays[1].dtype).reshape(arrays[1].shape)
    test = Split(splits[1]) if cfg.test_samples else None
    return Dataset("synthetic", Split(splits[0]), test, [n.name for n in ins])


def loss_labels(g: Graph) -> tuple[str, str] | None:
    """(logits, labels) when the loss is a softmax cross-entropy: the labels input is
    what synthetic data makes learnable and what accuracy is measured against."""
    for name in g.outputs.get("loss", []):
        n = g[name]
        if n.op == "softmax_cross_entropy":
            return n.inputs[0], n.inputs[1]
    return None


def _is_label(g: Graph, name: str) -> bool:
    found = loss_labels(g)
    return found is not None and found[1] == name


def _split(x, y, test_fraction: float, seed: int):
    perm = np.random.default_rng(seed).permutation(len(x))
    k = int(round(len(x) * test_fraction))
    te, tr = perm[:k], perm[k:]
    return (x[tr], y[tr]), (x[te], y[te])


def digits(g: Graph, cfg: Digits, seed: int) -> Dataset:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise NetdslError("the digits data set needs scikit-learn: pip install "
                          "'netdsl[digits]' (or scikit-learn)") from None
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    if cfg.image:
        x = x.reshape(-1, 1, 8, 8)
    y = d.target.astype(np.int64)
    # a fixed split (seed 0) so every run evaluates on the same held-out images
    (xtr, ytr), (xte, yte) = _split(x, y, cfg.test_fraction, 0)
    return _fit("digits", g, [xtr, ytr], [xte, yte])


def npz(g: Graph, cfg: Npz, seed: int) -> Dataset:
    try:
        with np.load(cfg.path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except FileNotFoundError:
        raise NetdslError(f"data file {cfg.path} does not exist") from None
    except (OSError, ValueError) as e:
        raise NetdslError(f"cannot read data file {cfg.path} as .npz: {e}") from None
    if "x" not in arrays:
        raise NetdslError(f"{cfg.path} has no array `x` (it has {', '.join(arrays) or 'none'})")
    x, y = arrays["x"], arrays.get("y")
    if y is not None and len(y) != len(x):
        raise NetdslError(f"{cfg.path}: x has {len(x)} samples but y has {len(y)}")
    if "x_test" in arrays:
        test = [arrays["x_test"]] + ([arrays["y_test"]] if "y_test" in arrays else [])
        train = [x] + ([y] if y is not None else [])
    elif cfg.test_fraction and y is not None:
        (xtr, ytr), (xte, yte) = _split(x, y, cfg.test_fraction, 0)
        train, test = [xtr, ytr], [xte, yte]
    else:
        train, test = [x] + ([y] if y is not None else []), None
    return _fit(cfg.path, g, train, test)


def _fit(name: str, g: Graph, train: list, test: list | None) -> Dataset:
    """Check the arrays against the network's inputs and cast them to its dtypes."""
    ins = _inputs(g)
    if len(train) < len(ins):
        raise NetdslError(f"network `{g.name}` has {len(ins)} inputs "
                          f"({', '.join(n.name for n in ins)}) but the data {name} gives "
                          f"{len(train)} arrays")
    out = []
    for arrays in (train, test):
        if arrays is None:
            out.append(None)
            continue
        cast = []
        for n, a in zip(ins, arrays):
            want = tuple(n.type.shape[1:])
            if tuple(a.shape[1:]) != want:
                raise NetdslError(
                    f"input `{n.name}` of network `{g.name}` is {n.type} but the data {name} "
                    f"has samples shaped {list(a.shape[1:])}"
                    + (" (for an MLP use digits(image=false))" if name == "digits" else ""))
            if n.type.is_float != np.issubdtype(a.dtype, np.floating):
                raise NetdslError(f"input `{n.name}` is {n.type} but the data {name} gives "
                                  f"{a.dtype} values")
            cast.append(np.ascontiguousarray(a, dtype=NUMPY_DTYPE[n.type.dtype]))
        out.append(Split(cast))
    return Dataset(name, out[0], out[1], [n.name for n in ins])


def make_dataset(g: Graph, cfg, seed: int) -> Dataset:
    kinds = {"synthetic": synthetic, "digits": digits, "npz": npz}
    return kinds[cfg.kind](g, cfg, seed)


class Loader:
    """Shuffled mini-batches, reshuffled every epoch from (seed, epoch): the state is just
    (epoch, position), so a checkpoint can restore it exactly. The last partial batch of
    an epoch is dropped (the graph has a fixed batch size)."""

    def __init__(self, split: Split, batch: int, seed: int, shuffle: bool = True):
        if len(split) < batch:
            raise NetdslError(f"the data has {len(split)} training samples, fewer than one "
                              f"batch of {batch}; lower --batch")
        self.split, self.batch, self.seed, self.shuffle = split, batch, seed, shuffle
        self.epoch, self.pos = 0, 0
        self._perm = self._permutation()

    @property
    def batches_per_epoch(self) -> int:
        return len(self.split) // self.batch

    def _permutation(self):
        n = len(self.split)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng((self.seed, self.epoch)).permutation(n)

    def next(self) -> list[np.ndarray]:
        if self.pos + self.batch > len(self.split):
            self.epoch, self.pos = self.epoch + 1, 0
            self._perm = self._permutation()
        idx = self._perm[self.pos:self.pos + self.batch]
        self.pos += self.batch
        return [a[idx] for a in self.split.arrays]

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def restore(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._perm = self._permutation()


def batches(split: Split, batch: int):
    """The whole split in order, in batches; the last one may be smaller (evaluation)."""
    for i in range(0, len(split), batch):
        yield [a[i:i + batch] for a in split.arrays]
