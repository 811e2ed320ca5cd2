"""Random numbers from a counter, so that a step recorded as a CUDA graph draws new ones at
every replay: element i of a node's draw at step t is a fixed function of (seed, the node's
key, t, i) - three rounds of splitmix64's finaliser (Steele, Lea and Flood 2014) - with t
read from a device buffer when the kernel runs, not baked into the recording as a host
number would be. `uniform` is the function in NumPy, the reference; `KERNEL` is the same
function as one CUDA elementwise kernel, which the CuPy backend compiles (CuPy's
ElementwiseKernel: this module imports no GPU library)."""
from __future__ import annotations

import math

import numpy as np

_MASK = (1 << 64) - 1
_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
BITS = {"float64": 53, "float32": 24, "float16": 11}  # each an exact multiple of 2^-bits


def _mix_int(z: int) -> int:
    z = (z + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def base(seed: int, key: int) -> int:
    """A node's 64-bit stream: its run's seed and its key (crc32 of its rng_key)."""
    return _mix_int((int(seed) & 0xFFFFFFFF) << 32 | (int(key) & 0xFFFFFFFF))


def _mix(z: np.ndarray) -> np.ndarray:
    z = z + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


def uniform(stream: int, step: int, shape, dtype) -> np.ndarray:
    """The draw in [0, 1) of the node whose stream is `stream` (`base`) at `step`."""
    bits = BITS[np.dtype(dtype).name]
    i = np.arange(math.prod(shape), dtype=np.uint64)
    s = _mix(np.array([step], np.uint64))  # (step >= 0: the executor counts from 0)
    z = _mix(_mix(np.uint64(stream) ^ s) + i)
    u = (z >> np.uint64(64 - bits)).astype(np.float64) * 2.0 ** -bits
    return u.astype(dtype).reshape(tuple(shape))


# CuPy's ElementwiseKernel(in_params, out_params, operation, name, preamble=...): `step` a
# one-element int64 device array, `stream` the node's base, `scale` 2^-bits, `shift` 64-bits
KERNEL = dict(
    in_params="raw int64 step, uint64 stream, float64 scale, int32 shift",
    out_params="T u",
    operation=("unsigned long long s = netdsl_mix((unsigned long long)step[0]);\n"
               "unsigned long long z = netdsl_mix(netdsl_mix(stream ^ s)"
               " + (unsigned long long)i);\n"
               "u = (T)((double)(z >> shift) * scale);"),
    name="netdsl_counter_uniform",
    preamble=("__device__ inline unsigned long long netdsl_mix(unsigned long long z) {\n"
              f"  z += {_GOLDEN:#x}ULL;\n"
              f"  z = (z ^ (z >> 30)) * {_M1:#x}ULL;\n"
              f"  z = (z ^ (z >> 27)) * {_M2:#x}ULL;\n"
              "  return z ^ (z >> 31);\n}\n"))


class DeviceRNG:
    """A node's generator on an array module `xp` (CuPy, or NumPy in the tests) reading the
    step from the one-element int64 array `step`: `kernel(step, stream, scale, shift, out)`
    is KERNEL compiled (CuPy), or None for `uniform` on the host (NumPy)."""

    def __init__(self, xp, kernel, seed: int, key: int, step):
        self.xp, self.kernel, self.step = xp, kernel, step
        self.stream = base(seed, key)

    def random(self, shape, dtype):
        if self.kernel is None:
            return uniform(self.stream, int(self.step[0]), shape, dtype)
        bits = BITS[np.dtype(dtype).name]
        out = self.xp.empty(tuple(shape), dtype)
        return self.kernel(self.step, np.uint64(self.stream), 2.0 ** -bits,
                           np.int32(64 - bits), out)
