"""The GPU backend: CuPy on one CUDA device. CuPy is imported only when this backend is made,
so the rest of netdsl runs (and imports) without it."""
from __future__ import annotations

import numpy as np

from netdsl.errors import DeviceError

_HELP = ("Install CuPy for your CUDA version (e.g. `pip install cupy-cuda12x`, or "
         "`pip install netdsl[gpu]`) on a machine with an NVIDIA GPU and driver, or run on "
         "the CPU with the numpy backend.")


def _import_cupy():
    try:
        import cupy
    except ImportError as e:
        raise DeviceError(f"the cupy backend needs CuPy, which is not installed ({e}). "
                          + _HELP) from e
    return cupy


class CupyRNG:
    def __init__(self, cupy, key):
        self._cupy = cupy
        # RandomState takes one integer: fold a (seed, step, node) key into one
        seed = int(np.random.SeedSequence(key).generate_state(1)[0])
        self._state = cupy.random.RandomState(seed)

    def random(self, shape, dtype):
        return self._state.random_sample(tuple(shape), dtype=np.dtype(dtype))


class CupyBackend:
    name = "cupy"

    def __init__(self, device: int = 0):
        cupy = _import_cupy()
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # no driver, no GPU, or a broken CUDA install
            raise DeviceError(f"the cupy backend found no usable CUDA device ({e}). "
                              + _HELP) from e
        if not 0 <= device < count:
            raise DeviceError(f"the cupy backend was asked for GPU {device}, but this machine "
                              f"has {count} CUDA device(s), numbered from 0. Choose one of "
                              f"them, or run on the CPU with the numpy backend.")
        self.device = device
        self.xp = cupy
        self._dev = cupy.cuda.Device(device)
        self._dev.use()
        from cupyx.scipy.special import erf
        self._erf = erf

    def asarray(self, host_array, dtype=None):
        with self._dev:
            return self.xp.array(host_array, dtype=dtype)

    def to_host(self, arr):
        return self.xp.asnumpy(arr)

    def rng(self, key) -> CupyRNG:
        with self._dev:
            return CupyRNG(self.xp, key)

    def synchronize(self) -> None:
        self._dev.synchronize()

    def erf(self, x):
        return self._erf(x)

    def __repr__(self) -> str:
        return f"CupyBackend(device={self.device})"
