"""Where samples come from, one at a time: an image folder, memory-mapped `.npy` arrays,
WebDataset-layout tar shards. A source knows its length, each sample's label without
reading the sample, and how to read sample i (`read(i)`: a Pillow image or an array);
what it reads is made into the network's input by a pipeline (`transforms`).

Sources are pickled to the worker processes: they hold names and offsets in compact
arrays, never an open file or a memory map (each process opens its own, on first use).
Every problem found while reading is a `BadSample` naming the file and the sample.
"""
from __future__ import annotations

import os
import re
import tarfile
from pathlib import Path

import numpy as np

from netdsl.errors import NetdslError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")


class BadSample(Exception):
    """A sample that cannot be read: `where` names its file (and record), `why` the
    reason."""

    def __init__(self, where: str, why: str):
        super().__init__(f"{where}: {why}")
        self.where, self.why = where, why


class Names:
    """Many strings in one bytes blob and an offset array: pickled in one copy, where a
    list of a million paths is a million objects."""

    def __init__(self, names: list[str]):
        data = [n.encode("utf-8", "surrogateescape") for n in names]
        self.blob = b"".join(data)
        self.offsets = np.zeros(len(data) + 1, dtype=np.int64)
        np.cumsum([len(d) for d in data], out=self.offsets[1:])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        return self.blob[self.offsets[i]:self.offsets[i + 1]].decode("utf-8", "surrogateescape")


def pillow():
    """Pillow's Image module, or the error naming the extra that installs it."""
    try:
        from PIL import Image
    except ImportError:
        raise NetdslError("reading images needs Pillow: pip install 'netdsl[images]' (or "
                          "pillow)") from None
    return Image


def decode(Image, source, where: str, mode: str):
    """Open and decode an image (a path or a file of bytes) fully, so that a truncated
    file fails here, not later, in `mode` ("RGB" or "L")."""
    try:
        with Image.open(source) as im:
            im.load()
            return im.convert(mode) if im.mode != mode else im.copy()
    except FileNotFoundError:
        raise BadSample(where, "the file is gone") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        why = str(e) or type(e).__name__
        raise BadSample(where, f"not a readable image ({why})") from None


class Source:
    """The interface: `name`, `classes` (names by label, or None), `labels` (an int64
    array, or None), `__len__`, `read(i)`, `where(i)`."""

    name = ""
    classes: list[str] | None = None
    labels: np.ndarray | None = None
    mode = "RGB"  # what images are decoded to: "RGB", or "L" for a network of 1 channel

    def __len__(self) -> int:
        raise NotImplementedError

    def read(self, i: int):
        raise NotImplementedError

    def where(self, i: int) -> str:
        return f"{self.name} sample {i}"


class ImageFolder(Source):
    """torchvision's ImageFolder layout: `root/CLASS/FILE`, the class names sorted into
    labels 0, 1, ...; the files of a class sorted by name."""

    def __init__(self, root: str):
        self.root = Path(root)
        self.name = str(root)
        if not self.root.is_dir():
            what = "is not a folder" if self.root.exists() else "does not exist"
            raise NetdslError(f"image folder {root} {what}; images() takes a folder with one "
                              "sub-folder of images per class")
        self.classes = sorted(d.name for d in self.root.iterdir() if d.is_dir())
        if not self.classes:
            raise NetdslError(f"image folder {root} has no class folders: images() takes a "
                              "folder with one sub-folder of images per class "
                              "(root/cat/1.jpg, root/dog/2.jpg)")
        files, labels = [], []
        for k, c in enumerate(self.classes):
            mine = sorted(f"{c}/{f.name}" for f in (self.root / c).iterdir()
                          if f.suffix.lower() in IMAGE_EXTENSIONS and f.is_file())
            if not mine:
                raise NetdslError(f"class folder {self.root / c} has no images (JPEG, PNG or "
                                  "WebP); remove it or add its images")
            files += mine
            labels += [k] * len(mine)
        self.files = Names(files)
        self.labels = np.asarray(labels, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.files)

    def where(self, i: int) -> str:
        return f"{self.root / self.files[i]} (sample {i})"

    def read(self, i: int):
        return decode(pillow(), self.root / self.files[i], self.where(i), self.mode)


class ArrayFiles(Source):
    """`.npy` files opened memory-mapped: x's samples are read when a batch takes them
    (the page cache holds them, not the process); y, one integer a sample, is read
    whole."""

    def __init__(self, x: str, y: str | None):
        self.x_path, self.y_path = x, y
        self.name = str(x)
        xs = self._open(x)
        self.shape, self.dtype, self.count = xs.shape[1:], xs.dtype, len(xs)
        self._x = None
        if y is not None:
            ys = self._open(y)
            if len(ys) != len(xs):
                raise NetdslError(f"x {x} has {len(xs):,} samples but y {y} has {len(ys):,}; "
                                  "they must have one label a sample")
            if ys.ndim != 1 or not np.issubdtype(ys.dtype, np.integer):
                raise NetdslError(f"y {y} must be one integer label a sample, not {ys.dtype} "
                                  f"shaped {list(ys.shape)}")
            self.labels = np.asarray(ys, dtype=np.int64)

    @staticmethod
    def _open(path: str) -> np.ndarray:
        try:
            a = np.load(path, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            raise NetdslError(f"data file {path} does not exist") from None
        except (OSError, ValueError) as e:
            raise NetdslError(f"cannot read {path} as a .npy array: {e}") from None
        if not isinstance(a, np.ndarray) or a.ndim < 1:
            raise NetdslError(f"{path} holds no array of samples (a .npy with a leading "
                              "sample dimension)")
        return a

    def __getstate__(self):
        return {**self.__dict__, "_x": None}  # (each process maps the file itself)

    def __len__(self) -> int:
        return self.count

    def where(self, i: int) -> str:
        return f"{self.x_path} (sample {i})"

    def read(self, i: int):
        if self._x is None:
            self._x = np.load(self.x_path, mmap_mode="r", allow_pickle=False)
        try:
            return np.array(self._x[i])
        except OSError as e:  # (a file truncated since it was opened: SIGBUS is not this)
            raise BadSample(self.where(i), str(e)) from None

    def gather(self, idx: np.ndarray) -> np.ndarray:
        """Samples `idx` at once, read in file order (one pass over the pages)."""
        if self._x is None:
            self._x = np.load(self.x_path, mmap_mode="r", allow_pickle=False)
        order = np.argsort(idx, kind="stable")
        out = np.empty((len(idx),) + self.shape, dtype=self.dtype)
        out[order] = self._x[idx[order]]
        return out


_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")


def expand(pattern: str) -> list[str]:
    """`train-{0000..0127}.tar` -> the 128 names (the width of the first bound kept);
    a pattern without a range names one file."""
    m = _RANGE.search(pattern)
    if not m:
        return [pattern]
    lo, hi = int(m.group(1)), int(m.group(2))
    if hi < lo:
        raise NetdslError(f"shards {pattern}: the range {m.group(0)} is empty")
    width = len(m.group(1))
    return [n for k in range(lo, hi + 1)
            for n in expand(pattern[:m.start()] + str(k).zfill(width) + pattern[m.end():])]


class TarShards(Source):
    """WebDataset's layout: each record is the files of one key (`KEY.jpg`, `KEY.cls`)
    next to each other in a tar file. The shards' headers are read once, at the start
    (the data itself is not), so that every record has an offset: a record is then read
    with one `pread`, from any process, in any order."""

    def __init__(self, pattern: str):
        self.paths = expand(pattern)
        self.name = pattern
        shard, offset, size, labels, keys = [], [], [], [], []
        for k, path in enumerate(self.paths):
            for key, off, n, label in _records(path):
                shard.append(k)
                offset.append(off)
                size.append(n)
                labels.append(label)
                keys.append(key)
        if not keys:
            raise NetdslError(f"shards {pattern} hold no records (KEY.jpg + KEY.cls)")
        self.shard = np.asarray(shard, dtype=np.int32)
        self.offset = np.asarray(offset, dtype=np.int64)
        self.size = np.asarray(size, dtype=np.int64)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.keys = Names(keys)
        self._fds: dict[int, int] = {}

    def __getstate__(self):
        return {**self.__dict__, "_fds": {}}

    def __len__(self) -> int:
        return len(self.keys)

    def where(self, i: int) -> str:
        return f"{self.paths[self.shard[i]]}, record {self.keys[i]} (sample {i})"

    def read(self, i: int):
        Image = pillow()
        k = int(self.shard[i])
        if k not in self._fds:
            self._fds[k] = os.open(self.paths[k], os.O_RDONLY)
        data = os.pread(self._fds[k], int(self.size[i]), int(self.offset[i]))
        if len(data) != self.size[i]:
            raise BadSample(self.where(i), "the shard is shorter than when it was indexed")
        import io
        return decode(Image, io.BytesIO(data), self.where(i), self.mode)

    def stream_order(self, seed: int, epoch: int, buffer: int) -> np.ndarray:
        """An epoch's order: the shards in an order drawn from (seed, epoch), their
        records one after the other through a shuffle buffer of `buffer` records (each new
        record takes the place of one drawn at random from the buffer, which is emitted),
        as WebDataset streams them."""
        rng = np.random.default_rng((seed, epoch, 7))
        starts = np.searchsorted(self.shard, np.arange(len(self.paths) + 1))
        stream = np.concatenate([np.arange(starts[s], starts[s + 1])
                                 for s in rng.permutation(len(self.paths))])
        out = np.empty_like(stream)
        held = list(stream[:buffer])
        picks = rng.integers(0, 1 << 62, size=len(stream))
        k = 0
        for j, rec in enumerate(stream[buffer:].tolist()):
            at = int(picks[j] % len(held))
            out[k], held[at] = held[at], rec
            k += 1
        rest = rng.permutation(len(held))
        out[k:] = np.asarray(held, dtype=stream.dtype)[rest] if held else out[k:]
        return out


_IMAGE_EXT = {"jpg", "jpeg", "png", "webp"}


def _records(path: str):
    """(key, offset of its image's data, its size, its class) for each record of shard
    `path`, from the tar headers alone; a shard that ends mid-record, or a record without
    an image or a class, is an error naming the shard and the key."""
    if not os.path.isfile(path):
        raise NetdslError(f"shard {path} does not exist")
    files: dict[str, dict] = {}
    order: list[str] = []
    last = None
    try:
        with tarfile.open(path, "r:") as tar:
            for m in tar:
                if not m.isfile():
                    continue
                base = m.name.rsplit("/", 1)[-1]
                if "." not in base:
                    continue
                dot = m.name.rindex("/") + 1 + base.index(".") if "/" in m.name \
                    else base.index(".")
                key, ext = m.name[:dot], m.name[dot + 1:].lower()
                if key not in files:
                    files[key] = {}
                    order.append(key)
                last = key
                if ext == "cls":
                    f = tar.extractfile(m)
                    files[key]["cls"] = f.read().decode("utf-8", "replace").strip()
                elif ext in _IMAGE_EXT:
                    if m.offset_data + m.size > os.path.getsize(path):
                        raise tarfile.ReadError("unexpected end of data")
                    files[key]["img"] = (m.offset_data, m.size)
            _whole_to_the_end(path, tar.offset)
    except (tarfile.TarError, OSError, EOFError) as e:
        after = f" after record {last}" if last else ""
        raise NetdslError(f"shard {path} ends mid-record{after} ({e}): the file is truncated "
                          "or not a tar file") from None
    for key in order:
        rec = files[key]
        if "img" not in rec or "cls" not in rec:
            missing = "an image (.jpg, .png, .webp)" if "img" not in rec else "a class (.cls)"
            raise NetdslError(f"shard {path}: record {key} has no {missing}")
        try:
            label = int(rec["cls"])
        except ValueError:
            raise NetdslError(f"shard {path}: record {key}'s class is {rec['cls']!r}, not an "
                              "integer") from None
        yield key, rec["img"][0], rec["img"][1], label


def _whole_to_the_end(path: str, end: int) -> None:
    """tarfile stops quietly at a header cut short (it reads it as the end of the
    archive): what follows the last whole member must be the end's zero blocks."""
    with open(path, "rb") as f:
        f.seek(end)
        while chunk := f.read(1 << 16):
            if chunk.count(0) != len(chunk):
                raise tarfile.ReadError("a header is cut short")
