"""bfloat16 in the fused kernels (mixed precision, netdsl.passes.precision).

Numba has no bfloat16 (nor float16): a bf16 array (ml_dtypes' bfloat16) is passed to a
loop as its uint16 view (`bits`), each element read through `ld` (its 16 bits shifted
into the top of a float32: exact) and written through `stored` (the float32 rounded to the
nearest bf16, ties to even, as ml_dtypes and PyTorch round; a NaN stays a NaN). The loops
compute in float32 (`like` gives a uint16 array float32 scalars), so a kernel that takes
bf16 reads 2 bytes and writes 2 bytes an element, with no f32 copy of its data: the
batchnorm family and relu's gradient and relu(a + b) (the ops that declare
`OpDef.reads_reduced` "numba"). For float32 and float64 arrays `ld` and `stored` are the
identity, so the same loops serve every dtype.
"""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
from numba import types
from numba.extending import overload

BF16 = np.dtype(ml_dtypes.bfloat16)


def ld(v):
    """An element as the loops compute with it (float32 for bf16 bits)."""


@overload(ld, inline="always")
def _ld(v):
    if v == types.uint16:
        return lambda v: np.uint32(np.uint32(v) << np.uint32(16)).view(np.float32)
    return lambda v: v


def stored(a, v):
    """v as array `a` stores it (bf16 bits for a uint16 view)."""


@overload(stored, inline="always")
def _stored(a, v):
    if a.dtype == types.uint16:
        def impl(a, v):
            f = np.float32(v)
            if f != f:
                return np.uint16(0x7FC0)
            b = f.view(np.uint32)
            b = b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))
            return np.uint16(b >> np.uint32(16))
        return impl
    return lambda a, v: v


def bits(a):
    """A bf16 array's uint16 view (other arrays and values as they are)."""
    return a.view(np.uint16) if isinstance(a, np.ndarray) and a.dtype == BF16 else a


def with_bits(fn):
    """`fn` (a Numba loop) called with every bf16 array argument as its uint16 view."""
    @functools.wraps(fn)
    def call(*args):
        return fn(*(bits(a) for a in args))
    call.py_func = getattr(fn, "py_func", fn)
    return call
