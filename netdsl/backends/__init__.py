"""Array backends: NumPy on the CPU, CuPy on a CUDA GPU (see `base.Backend`)."""
from __future__ import annotations

from netdsl.backends.base import Backend
from netdsl.errors import DeviceError

BACKENDS = ("numpy", "cupy")


def get_backend(name: str = "numpy", device: int = 0) -> Backend:
    """The backend called `name` on device `device`; raises DeviceError if it is unusable."""
    if name == "numpy":
        from netdsl.backends.numpy import NumpyBackend
        return NumpyBackend(device)
    if name == "cupy":
        from netdsl.backends.cupy import CupyBackend
        return CupyBackend(device)
    raise DeviceError(f"unknown backend `{name}`; choose one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Backend", "get_backend"]
