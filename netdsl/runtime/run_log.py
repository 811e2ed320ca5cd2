"""A run's log: one JSON line per step (`run --log`)."""
from __future__ import annotations

import json
import os
from pathlib import Path


def open_log(path: str | Path, resume: bool, step: int):
    """The log to append to. On resume it goes on from the checkpoint's `step`: lines of
    later steps (written by the run after its last checkpoint, then lost with it) and a
    line torn by a kill are dropped first, so each step is in it once (TensorBoard's
    purge_step); the file is rewritten atomically."""
    path = Path(path)
    if resume and path.exists():
        kept = []
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) \
                    and rec["step"] <= step:
                kept.append(line + "\n")
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
    return open(path, "a" if resume else "w", encoding="utf-8")
