"""The NumPy backend keeps freed host memory in the process (netdsl.backends.host_memory)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")

# Allocate and free a 256 MB array, then report whether the tuning ran and how much of the
# array stayed resident (glibc unmaps such a block on free unless told otherwise).
_PROBE = """
import numpy as np
from netdsl.backends import get_backend
be = get_backend("numpy")
from netdsl.backends.host_memory import keep_freed_memory
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
before = rss()
a = np.ones(64 << 20, dtype=np.float32)
del a
print(keep_freed_memory(), (rss() - before) >> 20)
"""


def _probe(**env) -> tuple[bool, int]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k != "NETDSL_KEEP_MEMORY"}
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**clean, **env},
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0] == "True", int(out[1])


def test_freed_large_arrays_stay_in_the_process():
    tuned, kept_mb = _probe()
    assert tuned and kept_mb >= 200


def test_switched_off_or_user_tuning_leaves_malloc_alone():
    for env in ({"NETDSL_KEEP_MEMORY": "0"}, {"MALLOC_TRIM_THRESHOLD_": "131072"}):
        tuned, kept_mb = _probe(**env)
        assert not tuned and kept_mb < 50
