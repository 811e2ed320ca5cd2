"""Checkpoints: one `.npz` (no pickle) with the training state and a JSON header.

Written to a temporary file in the same folder, flushed to disk and renamed over the old
one, so a kill at any moment leaves either the old or the new checkpoint, never half of
one. Saving takes the arrays one at a time and reading gives them one at a time (the
header is checked when the file is opened, each array's shape and dtype when it is read),
so neither holds a second copy of the whole state: resnet2504's is several GB. Loading
refuses anything that does not match, naming what differs.
"""
from __future__ import annotations

import json
import os
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

from netdsl.errors import CheckpointError

FORMAT = "netdsl-checkpoint/1"
FILE = "checkpoint.npz"
HEADER = "__header__"
PREFIX = "state/"
# what a damaged file raises in zipfile, NumPy's .npy reader or json
DAMAGED = (zipfile.BadZipFile, OSError, ValueError, KeyError, EOFError, UnicodeDecodeError,
           json.JSONDecodeError)


def path_in(directory: str | Path) -> Path:
    return Path(directory) / FILE


def file_of(p: str | Path) -> Path:
    """The checkpoint file `p` names: a folder's checkpoint.npz, or `p` itself."""
    p = Path(p)
    return path_in(p) if p.is_dir() else p


def _write(zf: zipfile.ZipFile, name: str, value: np.ndarray) -> None:
    # as np.savez writes each entry (zip64 always: numpy gh-10776)
    with zf.open(name + ".npy", "w", force_zip64=True) as fh:
        np.lib.format.write_array(fh, np.asanyarray(value), allow_pickle=False)


def save(directory: str | Path,
         arrays: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
         header: dict) -> Path:
    """Write `arrays` (a mapping, or (name, array) pairs taken one at a time) and `header`
    as the checkpoint in `directory`. A write that fails (a full disk) raises a
    CheckpointError and leaves the checkpoint that was there as it was."""
    d = Path(directory)
    items = arrays.items() if isinstance(arrays, Mapping) else arrays
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".npz.tmp", dir=d)
    except OSError as e:
        raise CheckpointError(f"cannot write a checkpoint in {d}: {e}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            specs = {}
            with zipfile.ZipFile(fh, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
                for k, v in items:
                    v = np.asanyarray(v)
                    _write(zf, PREFIX + k, v)
                    specs[k] = [list(v.shape), str(v.dtype)]
                full = {**header, "format": FORMAT, "arrays": specs}
                _write(zf, HEADER, np.frombuffer(json.dumps(full).encode(), np.uint8))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path_in(d))
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)  # make the rename itself durable
        finally:
            os.close(dfd)
    except OSError as e:
        _remove(tmp)
        raise CheckpointError(f"could not write the checkpoint {path_in(d)}: {e}; the "
                              "checkpoint there before this save (if any) is unchanged"
                              ) from None
    except BaseException:
        _remove(tmp)
        raise
    return path_in(d)


def _remove(tmp: str) -> None:
    if os.path.exists(tmp):
        os.unlink(tmp)


class Arrays(Mapping):
    """A checkpoint's arrays by name, each read from the file when asked for (and checked
    against the header then): a caller that needs a part of the state reads that part."""

    def __init__(self, path: Path, npz, specs: dict):
        self.path, self._npz, self._specs = path, npz, specs

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self._specs:
            raise KeyError(key)
        try:
            a = self._npz[PREFIX + key]
        except DAMAGED as e:
            raise _corrupt(self.path, e) from None
        shape, dtype = self._specs[key]
        if list(a.shape) != shape or str(a.dtype) != dtype:
            raise CheckpointError(f"checkpoint {self.path} is corrupt: array {key} does not "
                                  "match its header")
        return a

    def __contains__(self, key) -> bool:  # (Mapping's would read the array to find out)
        return key in self._specs

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


def _corrupt(p: Path, e: BaseException) -> CheckpointError:
    return CheckpointError(f"checkpoint {p} is corrupt or truncated ({e}); it cannot be used. "
                           "Delete it or point --checkpoint elsewhere.")


def load(directory: str | Path) -> tuple[Arrays, dict]:
    """The checkpoint's arrays (read lazily, see Arrays) and its header."""
    p = file_of(directory)
    if not p.exists():
        raise CheckpointError(f"no checkpoint at {p}: it does not exist")
    try:
        npz = np.load(p, allow_pickle=False)
    except DAMAGED as e:
        raise _corrupt(p, e) from None
    try:
        header = json.loads(bytes(npz[HEADER]).decode())
    except DAMAGED as e:
        npz.close()
        raise _corrupt(p, e) from None
    if header.get("format") != FORMAT:
        npz.close()
        raise CheckpointError(f"{p} is not a netdsl checkpoint (format "
                              f"{header.get('format')!r})")
    specs = header.get("arrays", {})
    missing = [k for k in specs if PREFIX + k not in npz.files]
    if missing:
        npz.close()
        raise CheckpointError(f"checkpoint {p} is corrupt: array {missing[0]} is missing")
    return Arrays(p, npz, specs), header


def check_holds(p: str, header: dict, network: str, shapes: dict[str, tuple]) -> None:
    """Refuse a checkpoint of another network, or one that lacks an entry of `shapes` or
    holds it in another shape; any dtype (the reader casts) and other entries (a run's
    optimizer state) are fine: what evaluating or exporting a network reads."""
    file = header.get("arrays", {})
    check_compatible(p, header, network, {k: (tuple(s), file.get(k, [None, None])[1])
                                          for k, s in shapes.items()}, extra_ok=True)


def check_compatible(p: str, header: dict, network: str, expected: dict[str, tuple],
                     extra_ok: bool = False) -> None:
    """Refuse a checkpoint of another network or with other shapes, saying what differs.
    `extra_ok`: entries besides `expected` are fine (evaluation reads the parameters and
    buffers of a run's checkpoint, not its optimizer state)."""
    if header.get("network") != network:
        raise CheckpointError(f"checkpoint {p} belongs to network `{header.get('network')}`, "
                              f"not `{network}`")
    have = {k: (tuple(s), d) for k, (s, d) in header["arrays"].items()}
    missing = sorted(set(expected) - set(have))
    extra = [] if extra_ok else sorted(set(have) - set(expected))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"it lacks {len(missing)} tensors (e.g. {missing[0]})")
        if extra:
            parts.append(f"it has {len(extra)} the network does not (e.g. {extra[0]})")
        raise CheckpointError(f"checkpoint {p} does not match network `{network}`: "
                              + "; ".join(parts) + " - was the network or optimizer changed?")
    for k, want in expected.items():
        if have[k] != want:
            raise CheckpointError(f"checkpoint {p} does not match network `{network}`: "
                                  f"{k} is {list(have[k][0])} {have[k][1]} in the checkpoint "
                                  f"but {list(want[0])} {want[1]} in the network")
