"""Host memory: what is free (`available_bytes`), and keeping freed memory in the process
(glibc malloc tuning) for the NumPy backend.

A training step allocates and frees the same large arrays every step. glibc serves any
request above its mmap threshold (at most 32 MB) with a fresh mmap and unmaps it on free,
so every large activation, gradient or im2col buffer is page-faulted in again, step after
step, a sizeable share of a big network's step on a CPU (docs/benchmarks.md). With mmap
off and trimming raised, freed blocks stay in the heap and the next step reuses them; the
peak is unchanged because the executor frees what it no longer needs either way.
Process-wide, so it is done once, and left alone where the user tuned malloc through its
own environment variables or set NETDSL_KEEP_MEMORY=0.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from pathlib import Path

from netdsl.config import env_switch

SWITCH_ENV = "NETDSL_KEEP_MEMORY"
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's <malloc.h>
_USER_TUNING = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                "MALLOC_TOP_PAD_")
_done: bool | None = None


def keep_freed_memory() -> bool:
    """Turn glibc's mmap for large blocks off and its heap trimming (almost) off, once per
    process; True if malloc is now tuned so. A no-op off glibc."""
    global _done
    if _done is None:
        _done = _tune()
    return _done


def _tune() -> bool:
    if not env_switch(SWITCH_ENV, True):
        return False
    if any(v in os.environ for v in _USER_TUNING) or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # mallopt takes an int: trimming starts only above 2 GiB of free memory at the heap top
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def available_bytes() -> int | None:
    """The host memory free to this process: MemAvailable, less where its cgroup (a
    container's limit) leaves less; None where neither can be read."""
    free = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    known = [v for v in (free, _cgroup_room()) if v is not None]
    return min(known) if known else None


def _cgroup_room() -> int | None:
    """What a cgroup v2 memory limit leaves (memory.max - memory.current), or None."""
    try:
        root = Path("/sys/fs/cgroup")
        cap = (root / "memory.max").read_text().strip()
        if not cap.isdigit():  # "max": no limit
            return None
        return max(int(cap) - int((root / "memory.current").read_text()), 0)
    except (OSError, ValueError):
        return None
