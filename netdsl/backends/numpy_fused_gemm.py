"""GEMMs on the fused kernels' threads: one thread pool for the whole step.

With more than one thread, NumPy's OpenBLAS keeps its own pool of threads and Numba's
parallel loops another (libgomp's). Each pool's idle threads either spin, and take the
cores from the other pool's, or sleep, and pay a wake-up at every call: on this 2-core
machine ResNet-164's step took 0.58 s with two threads against 0.61 s with one, the
batchnorm loops no faster with two, and 0.37 s with one pool (bench/bench_step.py
--threads 2; docs/benchmarks.md).
Most of a step's GEMMs are small (a convolution's per image or per kernel offset), too
small for OpenBLAS to split well. So, with two or more threads, a step holds NumPy's
OpenBLAS to one thread (`NumpyCblas.limit`) and a batch of GEMMs is spread over the
Numba threads, each calling that same OpenBLAS (NumPy's own library, found by its exported
symbols; `find_numpy_cblas`) on its share: whole products of the batch, or blocks of
rows or columns of one product. Each block is computed as the single-threaded library
computes it; the split only changes which thread does it.

Where NumPy's BLAS is not the scipy-openblas64 build that NumPy's wheels ship (MKL, Apple
Accelerate, a distribution's OpenBLAS), `find_numpy_cblas` finds nothing and NumPy's own
matmul runs, as with one thread.
"""
from __future__ import annotations

import ctypes
import glob
import os
from contextlib import contextmanager

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112  # CBLAS's enum values


class NumpyCblas:
    """NumPy's OpenBLAS (the scipy-openblas64 build of NumPy's wheels): the addresses of
    its 64-bit-integer cblas_sgemm and cblas_dgemm, and its thread count."""

    def __init__(self, lib: ctypes.CDLL):
        self.gemm = {np.dtype(np.float32): _address(lib.scipy_cblas_sgemm64_),
                     np.dtype(np.float64): _address(lib.scipy_cblas_dgemm64_)}
        self._get = lib.scipy_openblas_get_num_threads64_
        self._get.restype = ctypes.c_int
        self._set = lib.scipy_openblas_set_num_threads64_
        self._set.argtypes = [ctypes.c_int]
        self.held = 0  # how many blocks holding it to one thread are open

    @contextmanager
    def limit(self, threads: int):
        """OpenBLAS held to at most `threads` threads inside (with one, its threads
        neither spin nor wake)."""
        before = self._get()
        if before > threads:
            self._set(threads)
        one = min(before, threads) == 1
        self.held += one
        try:
            yield
        finally:
            self.held -= one
            if before > threads:
                self._set(before)


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def find_numpy_cblas() -> NumpyCblas | None:
    """NumPy's bundled OpenBLAS (already loaded by NumPy, so opening it again shares it),
    or None where NumPy links another BLAS."""
    libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libs, "libscipy_openblas64_*.so*"))):
        try:
            return NumpyCblas(ctypes.CDLL(path))
        except (OSError, AttributeError):
            continue
    return None


@intrinsic
def _cblas_gemm(typingctx, fn, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """cblas_?gemm(RowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) through the
    function at address `fn` (64-bit integers; a, b, c are addresses too). An intrinsic,
    not a ctypes call, so that the loop below keeps no process-specific pointer in its
    code and Numba can cache it."""
    sig = types.void(types.int64, types.int64, types.int64, types.int64, types.int64,
                     types.int64, alpha, types.int64, types.int64, types.int64,
                     types.int64, alpha, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        ptr = ir.IntType(8).as_pointer()
        real = context.get_value_type(alpha)
        fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, i64, i64, i64, real, ptr, i64,
                                               ptr, i64, real, ptr, i64])
        (f, ta_, tb_, m_, n_, k_, al, a_, lda_, b_, ldb_, be, c_, ldc_) = args
        call = builder.inttoptr(f, fnty.as_pointer())
        builder.call(call, [ir.Constant(i32, _ROW_MAJOR), builder.trunc(ta_, i32),
                            builder.trunc(tb_, i32), m_, n_, k_, al,
                            builder.inttoptr(a_, ptr), lda_, builder.inttoptr(b_, ptr), ldb_,
                            be, builder.inttoptr(c_, ptr), ldc_])
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(cache=True, nogil=True)
def _add_to_rows(c, start, rows, ld, v):
    """c[start + r * ld:][:v.size] += v for r < rows: a block's rows of a matrix given flat,
    C-contiguous. Row slices of a flat array, because a parallel loop's slices of a 2-d
    array type as of any layout and their adds do not vectorise: adding a [1024, 256]
    bias took 36 us on two threads so against 11 this way, and 18 on one thread."""
    for r in range(rows):
        o = start + r * ld
        row = c[o:o + v.size]
        row += v


@numba.njit(cache=True, nogil=True, parallel=True)
def gemm_tasks(fn, alpha, beta, size, batch, m, n, k, a, ta, lda, sa, b, tb, ldb, sb, c, ldc,
               sc, parts_m, parts_n, bias, c2):
    """c[i] = a[i] @ b[i] (plus c[i] with beta = 1) for i < batch, each product cut into
    parts_m x parts_n blocks of rows and columns, every block one task for the threads.
    a, b, c are addresses; sa, sb, sc the bytes between batch items (0: the same matrix
    for all); ta, tb CBLAS's transpose flags with the leading dimensions lda, ldb, ldc;
    size the item bytes. With a `bias` (size n; batch 1), each task then adds it to its
    block's rows of c2, c as a C-contiguous [m, n] array, while they are in its cache."""
    parts = parts_m * parts_n
    for t in numba.prange(batch * parts):
        i, r = t // parts, t % parts
        m0, m1 = (r // parts_n) * m // parts_m, (r // parts_n + 1) * m // parts_m
        n0, n1 = (r % parts_n) * n // parts_n, (r % parts_n + 1) * n // parts_n
        if m1 > m0 and n1 > n0:
            ao = a + i * sa + (m0 * lda if ta == _NO_TRANS else m0) * size
            bo = b + i * sb + (n0 if tb == _NO_TRANS else n0 * ldb) * size
            co = c + i * sc + (m0 * ldc + n0) * size
            _cblas_gemm(fn, ta, tb, m1 - m0, n1 - n0, k, alpha, ao, lda, bo, ldb, beta, co,
                        ldc)
            if bias.size:
                _add_to_rows(c2, m0 * n + n0, m1 - m0, n, bias[n0:n1])


@numba.njit(cache=True, nogil=True, parallel=True)
def shifted_gemm_tasks(fn, one, size, batch, m, n, k, a, lda, step_a, b, ldb, sb, offsets, c,
                       ldc, sc, parts_n):
    """c[i] = sum over o of a[o] @ b[i][:, offsets[o]:offsets[o] + n] for i < batch: a
    convolution's flat shift, every kernel offset's product added into the result inside
    the GEMM (beta = 1 after the first). One task per image, or per block of its columns
    (parts_n); each task sums its offsets in order. a: [offsets, m, k] with lda, step_a
    bytes between offsets; b, c: addresses with ldb, ldc and sb, sc bytes between images;
    offsets in elements."""
    zero = one - one
    for t in numba.prange(batch * parts_n):
        i, r = t // parts_n, t % parts_n
        n0, n1 = r * n // parts_n, (r + 1) * n // parts_n
        if n1 > n0:
            for o in range(offsets.size):
                _cblas_gemm(fn, _NO_TRANS, _NO_TRANS, m, n1 - n0, k, one, a + o * step_a, lda,
                            b + i * sb + (offsets[o] + n0) * size, ldb, zero if o == 0 else one,
                            c + i * sc + n0 * size, ldc)


def _operand(x, rows: int, cols: int):
    """(transpose flag, leading dimension) that let CBLAS read the 2-d matrices of x as
    they lie, or None (no unit stride along either axis: NumPy copies such operands)."""
    size = x.itemsize
    s0, s1 = x.strides[-2], x.strides[-1]
    if s0 % size or s1 % size or s0 < 0 or s1 < 0:
        return None
    s0, s1 = s0 // size, s1 // size
    if s1 == 1 or cols == 1:
        ld = s0 if rows > 1 else cols
        return (_NO_TRANS, ld) if ld >= cols else None
    if s0 == 1 or rows == 1:
        ld = s1 if cols > 1 else rows
        return (_TRANS, ld) if ld >= rows else None
    return None


def _batch_stride(x, batch: int) -> int | None:
    """Bytes between the matrices of x (0 for a 2-d x, shared by every product)."""
    if x.ndim == 2:
        return 0
    if x.shape[0] != batch or x.strides[0] < 0:
        return None
    return x.strides[0] if batch > 1 else 0


# Below this many multiply-adds a product is not worth a parallel region's start, its end
# and the call's 20 arguments (about 10 us in all): NumPy's matmul runs it on the calling
# thread. The break-even lies between 1M and 2M (bench/bench_kernels.py --threads 2
# --gemm; docs/benchmarks.md).
_MIN_MACS = 1 << 21


class PooledGemm:
    """a @ b for 2-d or 3-d float arrays, spread over `threads` Numba threads."""

    def __init__(self, cblas: NumpyCblas, threads: int):
        self.cblas = cblas
        self.threads = threads
        # gemm_tasks' arguments for "no bias": an empty bias, a stand-in for the [m, n] view
        self._no_bias = {np.dtype(dt): (np.empty(0, dt), np.empty(1, dt))
                         for dt in (np.float32, np.float64)}

    def warm_up(self) -> None:
        for dt in (np.float32, np.float64):
            a = np.ones((2, 2), dt)
            c = np.empty_like(a)
            gemm_tasks(self.cblas.gemm[a.dtype], dt(1), dt(0), a.itemsize, 1, 2, 2, 2,
                       a.ctypes.data, _NO_TRANS, 2, 0, a.ctypes.data, _NO_TRANS, 2, 0,
                       c.ctypes.data, 2, 0, 1, 1, np.ones(2, dt), c.reshape(-1))
            shifted_gemm_tasks(self.cblas.gemm[a.dtype], dt(1), a.itemsize, 1, 2, 2, 2,
                               a.ctypes.data, 2, 0, a.ctypes.data, 2, 0, np.zeros(1, np.int64),
                               np.empty_like(a).ctypes.data, 2, 0, 1)

    def shifted(self, a, b, offsets, n):
        """sum over o of a[o] @ b[:, :, offsets[o]:offsets[o] + n], [batch, m, n], for
        a [offsets, m, k] and b [batch, k, length] of one float dtype, C-contiguous (the
        flat shift of a convolution: one parallel call for all its offsets), or None
        where the loops do not take it (as __call__)."""
        if not self.cblas.held or a.dtype != b.dtype or a.dtype not in self.cblas.gemm \
                or not (a.flags.c_contiguous and b.flags.c_contiguous):
            return None
        noff, m, k = a.shape
        batch, k2, length = b.shape
        if k != k2 or noff != offsets.size or int(offsets.max()) + n > length \
                or batch * m * n * k * noff < _MIN_MACS:
            return None
        out = np.empty((batch, m, n), a.dtype)
        parts_n = min(-(-self.threads // batch), max(1, n // 64))
        size = a.itemsize
        shifted_gemm_tasks(self.cblas.gemm[a.dtype], a.dtype.type(1), size, batch, m, n, k,
                           a.ctypes.data, k, m * k * size, b.ctypes.data, length,
                           k * length * size, offsets, out.ctypes.data, n, m * n * size,
                           parts_n)
        return out

    def __call__(self, a, b, out=None, accumulate=False, bias=None):
        """The product into `out` (or a new array; added to `out` with `accumulate`), plus
        `bias` along its rows if given (2-d products only), or None where these loops do not
        take it: outside a `cblas.limit(1)` block (each task's call would start OpenBLAS's
        own threads), other dtypes or ranks, operands or an `out` with no unit stride, a
        bias with a 3-d product or an `out` not C-contiguous, or a product too small to
        split."""
        if not self.cblas.held or a.dtype != b.dtype or a.dtype not in self.cblas.gemm or not (
                2 <= a.ndim <= 3 and 2 <= b.ndim <= 3):
            return None
        if bias is not None and (a.ndim != 2 or b.ndim != 2 or bias.dtype != a.dtype
                                 or bias.shape != (b.shape[1],)
                                 or (out is not None and not out.flags.c_contiguous)):
            return None
        m, k = a.shape[-2:]
        k2, n = b.shape[-2:]
        batch = max(a.shape[0] if a.ndim == 3 else 1, b.shape[0] if b.ndim == 3 else 1)
        if k != k2 or min(m, n, k) < 1 or batch * m * n * k < _MIN_MACS:
            return None
        fa, fb = _operand(a, m, k), _operand(b, k, n)
        sa, sb = _batch_stride(a, batch), _batch_stride(b, batch)
        if fa is None or fb is None or sa is None or sb is None:
            return None
        shape = (batch, m, n) if max(a.ndim, b.ndim) == 3 else (m, n)
        if out is None:
            if accumulate:
                return None
            out = np.empty(shape, a.dtype)
        elif out.shape != shape or out.dtype != a.dtype or out.strides[-1] != a.itemsize \
                or out.strides[-2] % a.itemsize or out.strides[-2] < n * a.itemsize \
                or (out.ndim == 3 and out.strides[0] < 0):
            return None  # not rows of unit stride (Winograd's tile matrices are, apart)
        # whole products where the batch gives every thread some; else blocks of one
        # product along its larger side, one a thread (more blocks pack the other operand
        # more times, and measured slower for a transformer's [1024, 64] @ [64, 256])
        parts_m = parts_n = 1
        if batch < self.threads:
            split = -(-self.threads // batch)
            if m >= n:
                parts_m = min(split, max(1, m // 8))
            else:
                parts_n = min(split, max(1, n // 8))
        one = a.dtype.type(1)
        no_bias = self._no_bias[a.dtype]
        gemm_tasks(self.cblas.gemm[a.dtype], one, one if accumulate else one - one,
                   a.itemsize, batch, m, n, k,
                   a.ctypes.data, fa[0], fa[1], sa, b.ctypes.data, fb[0], fb[1], sb,
                   out.ctypes.data, out.strides[-2] // a.itemsize,
                   out.strides[0] if out.ndim == 3 else 0, parts_m, parts_n,
                   no_bias[0] if bias is None else np.ascontiguousarray(bias),
                   no_bias[1] if bias is None else out.reshape(-1))
        return out
