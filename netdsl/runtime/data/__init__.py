"""Datasets and the epoch-based, seeded loaders that feed a network's inputs.

A dataset is a pair of arrays per split: `x` for the network's first input and `y` for its
second (the labels); a network with one input gets `x` only. Synthetic data is seeded and
shaped from the network's input types; integer inputs are drawn below the size their
consumer needs (class count of the loss, rows of an embedding table).

This module holds the data sets held in memory (synthetic, digits, npz) and the split
types; data read from disk sample by sample lives beside it, one module a job:
`sources` (image folders, memory-mapped arrays, tar shards), `transforms` (the
augmentation pipelines), `samples` (a split of a source through a pipeline), `sampler`
(which samples make each batch: `Loader`), `workers` and `background` (the worker processes
that decode into shared memory, and the loader that drives them), `inspect` (`netdsl
data`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from netdsl.config import Digits, Npz, Synthetic, TrainConfig
from netdsl.errors import NetdslError
from netdsl.ir.graph import Graph
from netdsl.ir.types import NUMPY_DTYPE
from netdsl.runtime.data.sampler import Loader  # noqa: F401  (its home: sampler)
from netdsl.step.graphs import class_axis, loss_labels, source_input


@dataclass
class Split:
    arrays: list[np.ndarray]  # one per network input, leading dim = samples

    def __len__(self) -> int:
        return len(self.arrays[0]) if self.arrays else 0

    def take(self, idx, wanted: list[bool] | None = None, epoch: int = 0,
             rows=None) -> list[np.ndarray | None]:
        """The samples at `idx` (an index array or a slice), one array per input (None for
        an input `wanted` leaves out: one an MPI rank's part of the step does not read);
        held or drawn data gives every row whatever `rows` says, and whatever the epoch."""
        if wanted is None:
            return [a[idx] for a in self.arrays]
        return [a[idx] if w else None for a, w in zip(self.arrays, wanted, strict=True)]


    def head(self, n: int) -> Split:
        """The first n samples (views)."""
        return Split([a[:n] for a in self.arrays])


class DrawnSplit:
    """Samples drawn when a batch asks for them and not kept: synthetic data too large to
    hold (ImageNet-sized images: 1,280 of them are 770 MB). `draw(indices)` gives the
    arrays of those samples, each a fixed function of its index."""

    def __init__(self, count: int, draw):
        self.count, self.draw = count, draw

    def __len__(self) -> int:
        return self.count

    def take(self, idx, wanted: list[bool] | None = None, epoch: int = 0,
             rows=None) -> list[np.ndarray | None]:
        if isinstance(idx, slice):
            idx = np.arange(self.count)[idx]
        arrays = self.draw(np.asarray(idx, dtype=np.int64))  # (labels may need every input)
        if wanted is None:
            return arrays
        return [a if w else None for a, w in zip(arrays, wanted, strict=True)]

    def head(self, n: int) -> DrawnSplit:
        return DrawnSplit(min(n, self.count), self.draw)


@dataclass
class Dataset:
    name: str
    train: Split
    test: Split | None
    input_names: list[str]
    classes: list[str] | None = None  # the class names by label (an image folder's)


def _int_range(g: Graph, name: str) -> int | None:
    """How large integer values fed to input `name` may be, from what consumes it."""
    for n in g.nodes:
        if name in n.inputs:
            if n.op == "embedding":
                return n.attrs["num"]
            if n.op == "softmax_cross_entropy" and source_input(g, n.inputs[1]) == name:
                return g[n.inputs[0]].type.shape[class_axis(g, n)]
    return None


def _inputs(g: Graph):
    return [n for n in g.nodes if n.op == "input" and n.attrs.get("role") != "lr"]


# a synthetic split up to this size is drawn once and held; a larger one is drawn batch by
# batch (the same values either way: each sample comes from its own random stream)
HELD_SYNTHETIC_BYTES = 64 << 20


def synthetic(g: Graph, cfg: Synthetic, seed: int) -> Dataset:
    """Seeded random data of the network's input shapes; labels are a fixed function of x
    (the class of a random linear projection) so that a network can learn something.
    Labels may have any rank: one per sample, per pixel ([N, H, W] for [N, C, H, W]
    images), or per token: [N, T] labels of [N, T] token ids make a next-token task.

    Sample i of a split is drawn from its own counter-based stream (Philox keyed by the
    seed and the split, its counter starting at i), so it depends on (seed, split, i) only:
    a split is held when it is small (HELD_SYNTHETIC_BYTES) and drawn per batch when it is
    not, with the same values."""
    ins = _inputs(g)
    specs = []  # (shape of a sample, dtype, None for floats or the ints' upper bound)
    for n in ins:
        dtype = np.dtype(NUMPY_DTYPE[n.type.dtype])
        hi = None
        if not n.type.is_float:
            hi = cfg.classes if (cfg.classes and _is_label(g, n.name)) else None
            hi = hi or _int_range(g, n.name) or cfg.classes or 2
        specs.append((tuple(n.type.shape[1:]), dtype, hi))
    labels = _label_rule(g, ins, specs, cfg, seed)
    sample_bytes = sum(int(np.prod(sh)) * dt.itemsize for sh, dt, _ in specs)
    splits = []
    for part, count in enumerate((cfg.samples, cfg.test_samples)):
        def draw(idx, part=part):
            return labels(_draw(specs, seed, part, idx))
        held = count * sample_bytes <= HELD_SYNTHETIC_BYTES
        splits.append(Split(draw(np.arange(count))) if held else DrawnSplit(count, draw))
    test = splits[1] if cfg.test_samples else None
    return Dataset("synthetic", splits[0], test, [n.name for n in ins])


def _draw(specs, seed: int, part: int, idx: np.ndarray) -> list[np.ndarray]:
    """The inputs of samples `idx`: standard normal floats (drawn in their own dtype: no
    float64 copy first) and uniform integers below their bound."""
    out = [np.empty((len(idx),) + sh, dtype=dt) for sh, dt, _ in specs]
    bits = np.random.Philox(key=[seed, part])
    rng, state = np.random.Generator(bits), bits.state
    for k, i in enumerate(idx):
        # sample i's stream: Philox(key=[seed, part], counter=[0, i, 0, 0]), its buffer
        # empty; set in place, which costs less than making a generator per sample
        state["state"]["counter"] = np.array([0, int(i), 0, 0], dtype=np.uint64)
        state.update(buffer_pos=4, has_uint32=0, uinteger=0)
        bits.state = state
        for a, (sh, dt, hi) in zip(out, specs):
            if hi is None:
                gen = dt if dt in (np.float32, np.float64) else np.float32
                a[k] = rng.standard_normal(sh, dtype=gen)
            else:
                a[k] = rng.integers(0, hi, size=sh)
    return out


def _label_rule(g: Graph, ins, specs, cfg: Synthetic, seed: int):
    """What makes a batch's labels learnable: arrays -> arrays (unchanged without a
    softmax cross-entropy over an input's labels)."""
    found = loss_labels(g)
    if not (len(ins) >= 2 and found is not None and found[1] != ins[0].name):
        return lambda arrays: arrays
    at = [n.name for n in ins].index(found[1])
    classes = _int_range(g, found[1]) or cfg.classes or 2
    x_t, y_t = ins[0].type, ins[at].type
    vocab = specs[0][2]  # the token ids' bound (None for float inputs)

    def rule(arrays):
        if not len(arrays[0]):
            return arrays
        if not x_t.is_float and x_t.rank == 2 and y_t.shape == x_t.shape:
            arrays[0], arrays[at] = _next_token(arrays[0], arrays[at], classes, vocab, seed)
        else:
            arrays[at] = _learnable_labels(ins[0], arrays[0], arrays[at], classes, vocab,
                                           seed).astype(arrays[at].dtype)
        return arrays
    return rule


# features are pooled to at most this many before the label projection: a full [C*H*W,
# classes] projection of ImageNet-sized inputs takes gigabytes and seconds a batch
_FEATURES = 256


def _pooled(x: np.ndarray, k: int) -> np.ndarray:
    """[n, F] -> [n, min(F, k)]: means of k contiguous chunks (F itself when F <= k)."""
    f = x.shape[1]
    if f <= k:
        return x.astype(np.float64)
    edges = np.linspace(0, f, k + 1).astype(np.int64)
    sums = np.add.reduceat(x.astype(np.float32, copy=False), edges[:-1], axis=1)
    return sums / np.diff(edges).astype(np.float32)


def _next_token(x: np.ndarray, y: np.ndarray, classes: int, vocab: int,
                seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Next-token prediction for [N, T] tokens and [N, T] labels: sequences that follow a
    fixed random successor table from each sample's own random first token, the labels
    being the tokens shifted by one, so a causal model can learn the table (it must look
    at the previous token)."""
    vocab = min(vocab, classes)
    succ = np.random.default_rng(seed + 1).permutation(vocab)
    seq = np.empty((len(x), x.shape[1] + 1), dtype=np.int64)
    seq[:, 0] = x[:, 0] % vocab
    for t in range(x.shape[1]):
        seq[:, t + 1] = succ[seq[:, t]]
    return seq[:, :-1].astype(x.dtype), seq[:, 1:].astype(y.dtype)


def _learnable_labels(x_node, x: np.ndarray, labels: np.ndarray, classes: int,
                      vocab: int | None, seed: int) -> np.ndarray:
    n, lshape = len(x), labels.shape[1:]
    proj_rng = np.random.default_rng(seed + 1)
    if not x_node.type.is_float:  # token ids: a fixed class per token (per position)
        table = proj_rng.standard_normal((vocab, classes))
        if x.shape == labels.shape:  # one label per token: a language model's targets
            return table[x].argmax(-1)
        scores = table[x.reshape(n, -1)].sum(1)  # one per sequence: a bag of tokens
        if lshape:
            return np.broadcast_to(scores.argmax(1).reshape((n,) + (1,) * len(lshape)),
                                   labels.shape)
        return scores.argmax(1)
    if lshape and x.ndim >= 3 and tuple(x.shape[2:]) == lshape:
        # per pixel: classes from the channels at each position, [N, C, H, W] -> [N, H, W]
        proj = proj_rng.standard_normal((x.shape[1], classes)).astype(np.float32)
        return np.moveaxis(np.tensordot(x, proj, axes=([1], [0])), -1, 1).argmax(1)
    feats = _pooled(x.reshape(n, -1), _FEATURES)
    proj = proj_rng.standard_normal((feats.shape[1], classes))
    base = (feats @ proj).argmax(1)
    if not lshape:
        return base
    # other label shapes: the sample's class, shifted by a fixed amount per position
    shift = np.arange(int(np.prod(lshape))).reshape(lshape)
    return (base.reshape((n,) + (1,) * len(lshape)) + shift) % classes


def accuracy(logits: np.ndarray, axis: int, labels: np.ndarray) -> tuple[int, int]:
    """(correct, positions): the argmax along the class axis against the labels, over
    every position (the logits may be the labels' layout reshaped, e.g. [N*T, C])."""
    pred = logits.argmax(axis).reshape(-1)
    want = labels.reshape(-1)
    if pred.size != want.size:
        return 0, 0
    return int((pred == want).sum()), int(want.size)


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


def make_dataset(g: Graph, cfg, seed: int, train_cfg: TrainConfig | None = None,
                 bad: str = "stop") -> Dataset:
    """The data set `cfg` describes for network `g`; a data set read from disk takes its
    transforms from `train_cfg` and the bad-sample policy `bad` (stop or skip)."""
    from netdsl.runtime.data import disk
    if cfg.kind in disk.KINDS:
        train, test, source = disk.make(g, _inputs(g), cfg, seed, train_cfg, bad)
        return Dataset(source.name, train, test, [n.name for n in _inputs(g)],
                       source.classes)
    kinds = {"synthetic": synthetic, "digits": digits, "npz": npz}
    return kinds[cfg.kind](g, cfg, seed)


def batches(split: Split | DrawnSplit, batch: int):
    """The whole split in order, in batches; the last one may be smaller (evaluation)."""
    for i in range(0, len(split), batch):
        yield split.take(slice(i, i + batch))


def load_dataset(forward: Graph, cfg: TrainConfig, bad: str = "stop") -> Dataset:
    """The train section's data set for `forward`, its held-out samples `val`'s where the
    section gives one; running out of memory said in words."""
    try:
        data = make_dataset(forward, cfg.data, cfg.seed, cfg, bad)
        if cfg.val is not None:
            val = make_dataset(forward, cfg.val, cfg.seed,
                               cfg.model_copy(update={"train_transforms": cfg.eval_transforms}),
                               bad)
            data.test = val.train
        return data
    except MemoryError:
        raise NetdslError(f"out of memory making the {cfg.data.kind} data set for network "
                          f"`{forward.name}`; its inputs or classes are too large for this "
                          "machine (use fewer samples or a smaller network)") from None
