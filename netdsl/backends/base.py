"""The backend interface: an array module plus a handful of device operations.

A backend is small on purpose (tinygrad's `ops_npy.py` is a dozen lines): kernels get
`backend.xp` and do everything else with the NumPy-compatible API it offers. The storage
contract the memory plan relies on is as small: allocate a block of bytes, view a typed
array at an offset inside it, and copy values to and from (pinned) host memory.
"""
from __future__ import annotations

from typing import Any, Protocol


class RNG(Protocol):
    def random(self, shape: tuple[int, ...], dtype) -> Any:
        """Uniform samples in [0, 1) of `shape` and float `dtype`, on the device."""


class Backend(Protocol):
    name: str  # "numpy" | "cupy"
    xp: Any  # the array module kernels use
    device: int  # the device index (0 for the host)

    def check_precision(self, precision: str) -> None:
        """Raise NetdslError (DeviceError) if this backend cannot hold `precision`'s
        2-byte values ("bf16", "f16"), saying what to use instead."""

    def asarray(self, host_array, dtype=None) -> Any:
        """Copy a host (NumPy) array onto the device."""

    def to_host(self, arr) -> Any:
        """A NumPy copy of a device array."""

    def rng(self, key: int | tuple[int, ...]) -> RNG:
        """A random generator producing device arrays, seeded by an int or a tuple of ints
        (the executor keys each draw by (seed, step, node))."""

    def synchronize(self) -> None:
        """Wait for queued device work (for timing and memory measurements)."""

    def running(self) -> Any:
        """A context manager the executor holds around each run of a graph (the NumPy
        backend's thread set-up for its fused kernels; nothing on a GPU)."""

    def erf(self, x) -> Any:
        """The error function, element-wise (NumPy has none; gelu needs it)."""

    # fused kernels for hot element-wise chains (batchnorm + relu) or None: an object with
    # `accepts(*arrays)` and the loops of netdsl.backends.numpy_fused; kernels that find
    # None (CuPy, or NumPy without Numba) run their reference xp code
    fused: Any

    # -- storage ------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> Any:
        """A block of `nbytes` bytes of device memory (a uint8 array); freed when dropped."""

    def view(self, block, offset: int, shape: tuple[int, ...], dtype) -> Any:
        """A typed array of `shape` over `block` starting at byte `offset` (no copy)."""

    def copy_to_host(self, arr, out=None) -> Any:
        """A host copy of device array `arr` (into `out` if given; pinned memory on a GPU,
        a separate buffer on the CPU, so an offload really moves the bytes)."""

    def copy_to_device(self, host, out=None) -> Any:
        """A device copy of a host array made by `copy_to_host` (into `out` if given)."""

    # a GPU backend also has `pin_host(array) -> unpin` and `upload(host, out)` (the data
    # loader's batches on their way to the device while a step runs; netdsl.runtime.data)

    def memory_meter(self) -> Any:
        """A context manager measuring the peak bytes allocated while it is open
        (`.peak_bytes`, `.read()`), independently of the executor's count: tracemalloc on
        NumPy, the memory pool's high-water mark on CuPy."""
