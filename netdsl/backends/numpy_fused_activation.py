"""Activations for the NumPy backend's fused kernels (Numba, the `fast` extra): GELU in
float32, and relu's one-pass forms: relu(a + b) and relu's gradient with a gradient sum's
other term folded in (the fuse passes' add_relu and relu_grad with `acc`); relu6's and
clip's gradients in one pass; and a plain a + b, which, unlike NumPy's, runs on the loops'
threads. The add and relu loops take bf16 too (numpy_fused_bf16: `ld`, `stored`)."""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from netdsl.backends.numpy_fused_bf16 import ld, stored

# erf(z) on [-4, 4] as the rational function z * P(z^2) / Q(z^2) that Eigen and XLA use for
# float32 (outside it erf is +-1 in float32), with no exp and no branch, so LLVM vectorises
# the loop (far faster than SciPy's erf: bench_kernels.py).
# Within 1e-6 of the exact GELU over [-6, 6] (1.8e-7 relative to |x|; PyTorch's float32
# kernel is within 1.1e-6). The backward's density term needs exp, which Numba compiles to a
# scalar libm call per element: `exp_of_nonpositive` below is Cephes' expf (a polynomial
# after Cody-Waite range reduction, 2^n made from its bits), which LLVM vectorises, so the
# gradient is one pass too. The rational function's own derivative would need no exp but
# is 2e-6 off near the ends. float64 keeps SciPy's erf.
# error_model="numpy": a division may not raise, which is what lets the loops vectorise;
# no "nnan"/"ninf", so NaN and inf behave as in the reference.
_VEC = {"cache": True, "nogil": True, "error_model": "numpy",
        "fastmath": {"nsz", "arcp", "contract", "afn", "reassoc"}}
_ERF_P = tuple(np.float32(v) for v in (
    -2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
    -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
    -1.60960333262415e-02))  # z^13 ... z^1
_ERF_Q = tuple(np.float32(v) for v in (
    -1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
    -7.37332916720468e-03, -1.42647390514189e-02))  # z^8 ... z^0
_P13, _P11, _P9, _P7, _P5, _P3, _P1 = _ERF_P
_Q8, _Q6, _Q4, _Q2, _Q0 = _ERF_Q
_F32 = np.float32

# Blocks of _BLOCK elements in parallel (each block one task for the threads), each block
# a sequential loop over its slices, which LLVM vectorises (a loop over the block's index
# range inside the parallel loop did not: relu_grad took twice as long on one thread).
# Element by element, so the results are the same on any number of threads.
_SEQ = {"cache": True, "nogil": True, "error_model": "numpy"}
_PAR = {**_SEQ, "parallel": True}


def like(a, v):
    """v (a float64) rounded to array a's dtype: a Numba cast that keeps a float32 loop in
    float32. A float64 constant in one (`0.0 if v < 0 else v`) promotes the element to
    float64 and back, which slows such a loop markedly for the same numbers."""


@overload(like, inline="always")
def _like_impl(a, v):
    if a.dtype == numba.float32 or a.dtype == numba.uint16:  # (bf16 bits: computed in f32)
        return lambda a, v: np.float32(v)
    return lambda a, v: np.float64(v)
_BLOCK = 1 << 14


@numba.njit(inline="always", **_VEC)
def _half_erf_plus_half(v):
    """Phi(v) = (1 + erf(v / sqrt 2)) / 2 in float32, kept in [0, 1] (the rational erf
    overshoots +-1 by about 1e-7 near the ends, which would give gelu(x) the wrong sign)."""
    z = min(max(v * _F32(0.7071067811865476), _F32(-4.0)), _F32(4.0))
    z2 = z * z
    p = ((((((_P13 * z2 + _P11) * z2 + _P9) * z2 + _P7) * z2 + _P5) * z2 + _P3) * z2
         + _P1) * z
    q = (((_Q8 * z2 + _Q6) * z2 + _Q4) * z2 + _Q2) * z2 + _Q0
    return min(max(_F32(0.5) + _F32(0.5) * (p / q), _F32(0.0)), _F32(1.0))


@intrinsic
def _f32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the int32 `bits` (an LLVM bitcast: it vectorises)."""
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def _i32_from_f32(typingctx, x):
    """The float32 `x` truncated to an int32 (LLVM's fptosi). Numba's int(x) goes through
    int64, which AVX2 has no vector conversion for: a loop around it would run two lanes
    at a time (exp_of_nonpositive_in_place's)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.fptosi(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


_LOG2E, _LN2_HI, _LN2_LO = _F32(1.44269504088896341), _F32(0.693359375), _F32(-2.12194440e-4)
_E5, _E4, _E3, _E2, _E1, _E0 = (_F32(v) for v in (
    1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
    5.0000001201e-1))


@numba.njit(inline="always", **_VEC)
def exp_of_nonpositive(t):
    """e^t in float32 for t <= 0 (Cephes' expf), in a form LLVM vectorises: t = n ln 2 + r,
    |r| <= ln 2 / 2, e^r by its polynomial, times 2^n built from its exponent bits; within
    an ulp of the exact value (tests/test_fuse.py). 0 below -87, where e^t is denormal or
    0 in float32 (so -inf gives 0); NaN stays NaN."""
    u = max(t, _F32(-87.0))
    n = np.floor(u * _LOG2E + _F32(0.5))
    r = u - n * _LN2_HI - n * _LN2_LO
    p = (((((_E5 * r + _E4) * r + _E3) * r + _E2) * r + _E1) * r + _E0) * r * r + r + _F32(1.0)
    e = p * _f32_from_bits(np.int32((_i32_from_f32(n) + np.int32(127)) << np.int32(23)))
    return _F32(0.0) if t < _F32(-87.0) else e


@numba.njit(**_VEC)
def exp_of_nonpositive_in_place(y):
    """y = e^y over a 1-d float32 array of numbers <= 0 (a softmax's shifted scores)."""
    for i in range(y.size):
        y[i] = exp_of_nonpositive(y[i])


@numba.njit(**_VEC)
def _gelu(x, y):
    for i in range(x.size):
        v = x[i]
        y[i] = v * _half_erf_plus_half(v)


@numba.njit(**_VEC)
def _gelu_grad(dy, x, dx):
    for i in range(x.size):
        v = x[i]
        pdf = _F32(0.3989422804014327) * exp_of_nonpositive(_F32(-0.5) * v * v)
        dx[i] = dy[i] * (_half_erf_plus_half(v) + v * pdf)


@numba.njit(**_VEC, parallel=True)
def gelu_f32(x, y):
    """y = x * Phi(x) over 1-d float32 arrays, in blocks on the loops' threads (below)."""
    n = x.size
    for t in numba.prange((n + _BLOCK - 1) // _BLOCK):
        s, e = t * _BLOCK, min(n, (t + 1) * _BLOCK)
        _gelu(x[s:e], y[s:e])


@numba.njit(**_VEC, parallel=True)
def gelu_grad_f32(dy, x, dx):
    """dx = dy * (Phi(x) + x * phi(x)) over 1-d float32 arrays, in blocks."""
    n = x.size
    for t in numba.prange((n + _BLOCK - 1) // _BLOCK):
        s, e = t * _BLOCK, min(n, (t + 1) * _BLOCK)
        _gelu_grad(dy[s:e], x[s:e], dx[s:e])


def gelu_grad(dy, x):
    """GELU's dx for float32 arrays of any shape (C-contiguous)."""
    dx = np.empty_like(x)
    gelu_grad_f32(dy.reshape(-1), x.reshape(-1), dx.reshape(-1))
    return dx


@numba.njit(**_SEQ)
def _add(a, b, y):
    for i in range(y.size):
        y[i] = stored(y, ld(a[i]) + ld(b[i]))


@numba.njit(**_SEQ)
def _add_relu(a, b, y):
    zero = like(y, 0.0)
    for i in range(y.size):
        v = ld(a[i]) + ld(b[i])
        y[i] = stored(y, zero if v < zero else v)


@numba.njit(**_SEQ)
def _relu_grad(dy, y, acc, with_acc, dx):
    one, zero = like(dx, 1.0), like(dx, 0.0)
    for i in range(dx.size):
        s = ld(dy[i]) + ld(acc[i]) if with_acc else ld(dy[i])
        dx[i] = stored(dx, s * (one if ld(y[i]) > zero else zero))


@numba.njit(**_PAR)
def add(a, b, relu, y):
    """y = a + b over 1-d arrays (the same sums as np.add), or with `relu` max(a + b, 0),
    as np.maximum(a + b, 0): NaN and -0.0 pass."""
    n = y.size
    for t in numba.prange((n + _BLOCK - 1) // _BLOCK):
        s, e = t * _BLOCK, min(n, (t + 1) * _BLOCK)
        if relu:
            _add_relu(a[s:e], b[s:e], y[s:e])
        else:
            _add(a[s:e], b[s:e], y[s:e])


@numba.njit(**_SEQ)
def _window_grad(dy, x, lo, hi, one, closed, dx):
    zero = one - one
    for i in range(dx.size):
        v = x[i]
        inside = (lo <= v and v <= hi) if closed else (lo < v and v < hi)
        dx[i] = dy[i] * (one if inside else zero)


@numba.njit(**_PAR)
def window_grad(dy, x, lo, hi, one, closed, dx):
    """dx = dy * (lo < x < hi), or lo <= x <= hi with `closed` (relu6's and clip's
    gradients) over 1-d arrays in one pass: a product with the 0/1 mask, as NumPy's; lo,
    hi and one in the data's dtype, so the comparisons are NumPy's too."""
    n = dx.size
    for t in numba.prange((n + _BLOCK - 1) // _BLOCK):
        s, e = t * _BLOCK, min(n, (t + 1) * _BLOCK)
        _window_grad(dy[s:e], x[s:e], lo, hi, one, closed, dx[s:e])


@numba.njit(**_PAR)
def relu_grad(dy, y, acc, with_acc, dx):
    """dx = (dy + acc) * (y > 0) over 1-d arrays (acc only if with_acc): a product with
    the 0/1 mask as NumPy's, so NaN, inf and -0.0 come out as they do there."""
    n = dx.size
    for t in numba.prange((n + _BLOCK - 1) // _BLOCK):
        s, e = t * _BLOCK, min(n, (t + 1) * _BLOCK)
        _relu_grad(dy[s:e], y[s:e], acc[s:e], with_acc, dx[s:e])
