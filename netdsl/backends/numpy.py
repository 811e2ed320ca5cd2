"""The CPU backend: plain NumPy."""
from __future__ import annotations

import math
import tracemalloc
from contextlib import nullcontext

import numpy as np

from netdsl.backends.erf import erf as erf_arrays
from netdsl.backends.host_memory import keep_freed_memory
from netdsl.config import FUSED_ENV, env_switch
from netdsl.ir.types import numpy_dtype


def load_fused():
    """The fused CPU kernels (netdsl.backends.numpy_fused) if Numba is installed and they
    are not switched off, else None. Imported here, on first use, and nowhere else."""
    if not env_switch(FUSED_ENV, True):
        return None
    try:
        from netdsl.backends.numpy_fused import FusedKernels
    except ImportError:  # Numba is optional (the `fast` extra)
        return None
    return FusedKernels()


class TracemallocMeter:
    """Peak bytes allocated while it runs, measured by tracemalloc (NumPy reports its array
    buffers to it), independently of the executor's own count. `peak_bytes` is the high
    water above what was allocated when the meter started."""

    def __init__(self):
        self._owner = False
        self._base = 0
        self.peak_bytes = 0

    def __enter__(self):
        if not tracemalloc.is_tracing():
            tracemalloc.start()
            self._owner = True
        self._base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        return self

    def read(self) -> int:
        """The peak so far (the meter keeps running)."""
        self.peak_bytes = max(self.peak_bytes, tracemalloc.get_traced_memory()[1] - self._base)
        return self.peak_bytes

    def __exit__(self, *exc):
        self.read()
        if self._owner:
            tracemalloc.stop()
        return False


class NumpyRNG:
    def __init__(self, key):
        self._gen = np.random.default_rng(key)

    def random(self, shape, dtype):
        return self._gen.random(tuple(shape), dtype=np.dtype(dtype))


_UNSET = object()


class NumpyBackend:
    name = "numpy"
    xp = np
    device = 0

    def __init__(self, device: int = 0):
        self.device = device  # there is one host; the index only labels memory accounting
        keep_freed_memory()
        try:
            from scipy.special import erf
        except ImportError:  # SciPy is optional: a vectorised series / continued fraction
            erf = None
        self._erf = erf
        self._fused = _UNSET

    @property
    def fused(self):
        """Fused kernels for hot element-wise chains (see netdsl.backends.numpy_fused), or
        None; kernels fall back to their NumPy reference code without them."""
        if self._fused is _UNSET:
            self._fused = load_fused()
        return self._fused

    def check_precision(self, precision: str) -> None:
        """NumPy holds f16 itself and bf16 through ml_dtypes (a NetdslError without it)."""
        numpy_dtype(precision)

    def asarray(self, host_array, dtype=None):
        return np.array(host_array, dtype=dtype, copy=True)

    def to_host(self, arr):
        return np.array(arr, copy=True)

    def rng(self, key) -> NumpyRNG:
        return NumpyRNG(key)

    def synchronize(self) -> None:
        pass

    def running(self):
        """Held around each run of a graph, and by the Trainer around its whole loop: the
        fused kernels' thread set-up (NumPy's BLAS at one thread while GEMMs share their
        threads); loads them, so that a loop's first step is held too."""
        f = self.fused
        return nullcontext() if f is None else f.running()

    def erf(self, x):
        if self._erf is not None:
            return self._erf(x)
        return erf_arrays(np, x)

    # -- storage: host and device are the same memory here, but the copies are real ----------
    def alloc(self, nbytes: int):
        return np.empty(nbytes, dtype=np.uint8)

    def view(self, block, offset: int, shape, dtype):
        dtype = np.dtype(dtype)
        count = math.prod(shape)
        return block[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)

    def copy_to_host(self, arr, out=None):
        if out is None:
            return np.array(arr, copy=True)
        np.copyto(out, arr)
        return out

    def copy_to_device(self, host, out=None):
        return self.copy_to_host(host, out)

    def memory_meter(self) -> TracemallocMeter:
        return TracemallocMeter()

    def __repr__(self) -> str:
        return "NumpyBackend()"
