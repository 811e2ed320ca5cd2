"""Checkpoints: one `.npz` (no pickle) with the training state and a JSON header.

Written to a temporary file in the same folder, flushed to disk and renamed over the old
one, so a kill at any moment leaves either the old or the new checkpoint, never half of
one. Loading checks the header (format, network, every array's name, shape and dtype)
and refuses anything that does not match, naming what differs.
"""
from __future__ import annotations

import json
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from netdsl.errors import CheckpointError

FORMAT = "netdsl-checkpoint/1"
FILE = "checkpoint.npz"


def path_in(directory: str | Path) -> Path:
    return Path(directory) / FILE


def save(directory: str | Path, arrays: dict[str, np.ndarray], header: dict) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    header = {**header, "format": FORMAT,
              "arrays": {k: [list(v.shape), str(v.dtype)] for k, v in arrays.items()}}
    blob = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    payload = {"__header__": blob, **{"state/" + k: v for k, v in arrays.items()}}
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".npz.tmp", dir=d)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path_in(d))
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)  # make the rename itself durable
        finally:
            os.close(dfd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path_in(d)


def load(directory: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    p = Path(directory)
    p = path_in(p) if p.is_dir() else p
    if not p.exists():
        raise CheckpointError(f"no checkpoint to resume from: {p} does not exist")
    try:
        with np.load(p, allow_pickle=False) as f:
            header = json.loads(bytes(f["__header__"]).decode())
            arrays = {k[len("state/"):]: f[k] for k in f.files if k.startswith("state/")}
    except (zipfile.BadZipFile, OSError, ValueError, KeyError, EOFError,
            UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {p} is corrupt or truncated ({e}); it cannot be "
                              "used. Delete it or point --checkpoint elsewhere.") from None
    if header.get("format") != FORMAT:
        raise CheckpointError(f"{p} is not a netdsl checkpoint (format "
                              f"{header.get('format')!r})")
    for k, (shape, dtype) in header["arrays"].items():
        a = arrays.get(k)
        if a is None or list(a.shape) != shape or str(a.dtype) != dtype:
            raise CheckpointError(f"checkpoint {p} is corrupt: array {k} is missing or does "
                                  "not match its header")
    return arrays, header


def check_compatible(p: str, header: dict, network: str, expected: dict[str, tuple]) -> None:
    """Refuse a checkpoint of another network or with other shapes, saying what differs."""
    if header.get("network") != network:
        raise CheckpointError(f"checkpoint {p} belongs to network `{header.get('network')}`, "
                              f"not `{network}`")
    have = {k: (tuple(s), d) for k, (s, d) in header["arrays"].items()}
    missing = sorted(set(expected) - set(have))
    extra = sorted(set(have) - set(expected))
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
