"""GEMMs on the fused kernels' threads: one thread pool for the whole step.

With more than one thread, NumPy's OpenBLAS keeps its own pool of threads and Numba's
parallel loops another (libgomp's). Each pool's idle threads either spin, and take the
cores from the other pool's, or sleep, and pay a wake-up at every call: on two cores a
step on two threads is hardly faster than on one, and with one pool for both it is
markedly faster (bench/bench_step.py --threads 2; docs/benchmarks.md).
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
        try:
            name = lib.scipy_openblas_get_corename64_
            name.restype = ctypes.c_char_p
            self.corename = (name() or b"").decode()
        except AttributeError:
            self.corename = ""
        # only OpenBLAS's AVX-512 cores have its small-matrix kernels (its "direct" GEMM
        # for SkylakeX, Cooperlake, SapphireRapids): see product_blocks
        self.small_kernels = self.corename.lower() in _SMALL_KERNEL_CORES

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


_SMALL_KERNEL_CORES = ("skylakex", "cooperlake", "sapphirerapids")


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


@intrinsic
def _data_address(typingctx, arr):
    """The address of an array's first element, inside compiled code (what .ctypes.data
    gives outside it, which would keep Numba from caching the function)."""
    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.ptrtoint(ary.data, ir.IntType(64))

    return types.int64(arr), codegen


@numba.njit(cache=True, nogil=True)
def _add_to_rows(c, start, rows, ld, v):
    """c[start + r * ld:][:v.size] += v for r < rows: a block's rows of a matrix given flat,
    C-contiguous. Row slices of a flat array, because a parallel loop's slices of a 2-d
    array type as of any layout and their adds do not vectorise: a bias added so takes
    several times as long."""
    for r in range(rows):
        o = start + r * ld
        row = c[o:o + v.size]
        row += v


@numba.njit(cache=True, nogil=True)
def _add_block(c, start, rows, ld, cols, r):
    """c[start + q * ld:][:cols] += r[the same] for q < rows: a block of a matrix and of
    another of its shape, both given flat, C-contiguous (flat slices: see _add_to_rows)."""
    for q in range(rows):
        o = start + q * ld
        row = c[o:o + cols]
        row += r[o:o + cols]


@numba.njit(cache=True, nogil=True, parallel=True)
def gemm_tasks(fn, alpha, beta, size, batch, inner, m, n, k, a, ta, lda, b, tb, ldb, c, ldc,
               steps, parts_m, parts_n, bias, c2, res):
    """c[i] = a[i] @ b[i] (plus c[i] with beta = 1) for i < batch, each product cut into
    parts_m x parts_n blocks of rows and columns, every block one task for the threads.
    The batch has two levels, i = outer * inner + j (a rank-4 product's [N, heads]):
    a, b, c are addresses and steps[0], [1], [2] their bytes between outer and inner
    items (0: the same matrix for all); ta, tb CBLAS's transpose flags with the leading
    dimensions lda, ldb, ldc; size the item bytes. With a `bias` (size n; batch 1), each
    task then adds it to its block's rows of c2, c as a C-contiguous [m, n] array, while
    they are in its cache; with a residual `res` (c2's size: c as a C-contiguous [batch,
    m, n] array), each task then adds its block of res likewise (after the bias: the
    sums of a product, its bias add and a separate add)."""
    parts = parts_m * parts_n
    for t in numba.prange(batch * parts):
        i, r = t // parts, t % parts
        io, ii = i // inner, i % inner
        m0, m1 = (r // parts_n) * m // parts_m, (r // parts_n + 1) * m // parts_m
        n0, n1 = (r % parts_n) * n // parts_n, (r % parts_n + 1) * n // parts_n
        if m1 > m0 and n1 > n0:
            ao = a + io * steps[0, 0] + ii * steps[0, 1] \
                + (m0 * lda if ta == _NO_TRANS else m0) * size
            bo = b + io * steps[1, 0] + ii * steps[1, 1] \
                + (n0 if tb == _NO_TRANS else n0 * ldb) * size
            co = c + io * steps[2, 0] + ii * steps[2, 1] + (m0 * ldc + n0) * size
            _cblas_gemm(fn, ta, tb, m1 - m0, n1 - n0, k, alpha, ao, lda, bo, ldb, beta, co,
                        ldc)
            if bias.size:
                _add_to_rows(c2, m0 * n + n0, m1 - m0, n, bias[n0:n1])
            if res.size:
                _add_block(c2, i * m * n + m0 * n + n0, m1 - m0, n, n1 - n0, res)


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


@numba.njit(cache=True, nogil=True, inline="always")
def _pad_planes(image, ph, pw, wp, buf, shift=0):
    """An image's [C, H, W] planes into the rows of buf, each plane flattened into rows
    wp apart, from row ph and column pw, moved `shift` elements towards the start (what
    falls outside buf's rows is dropped; buf's other elements are left as they are: the
    padding, zero)."""
    h, w = image.shape[1], image.shape[2]
    n = buf.shape[1]
    for ch in range(image.shape[0]):
        for r in range(h):
            start = (r + ph) * wp + pw - shift
            # unshifted: whole rows, no bounds to clip (clipping every row measurably slows
            # the image tasks' forward and dx)
            c0, c1 = (0, w) if shift == 0 else (max(0, -start), min(w, n - start))
            if c1 > c0:
                dst = buf[ch, start + c0:start + c1]
                dst[:] = image[ch, r, c0:c1]


@numba.njit(cache=True, nogil=True, parallel=True)
def shifted_conv_tasks(fn, one, x, wt, kh, kw, ph, pw, dh, dw, y, threads):
    """y = conv2d(x, w), stride 1, by the flat shift with each image's whole convolution
    one task: its zero-padded, flattened planes copied into a buffer of the thread, the
    kh*kw offsets' GEMMs (wt[o] @ a shifted slice of the buffer, o = i*kw + j, summed
    inside the GEMM as shifted_gemm_tasks) into an accumulator of the thread, whose rows
    less their padding columns are then y's. Padding, products and cropping stay in the
    thread's cache, where the batch's padded copy and result each took a pass of their
    own. x [N, C, H, W], wt [kh*kw, O, C], y [N, O, Ho, Wo], all C-contiguous; `threads`
    tasks of consecutive images, each with its two buffers, [C, Hp*Wp + (kw-1)*dw] and
    [O, Ho*Wp], allocated here by each thread (NumPy arrays allocated by the caller and
    handed in made ResNet-164's 16-channel 3x3 slower). Numba allocates through CPython's
    allocator, so tracemalloc sees them; conv2d's workspace rule covers them (its flat
    shift reserves the whole batch's padded copy and result). The same products, summed
    in the same order, as shifted_gemm_tasks and the reference kernel's per-offset
    GEMMs."""
    n, c, h, w = x.shape
    o, ho, wo = y.shape[1], y.shape[2], y.shape[3]
    wp = w + 2 * pw
    length = ho * wp
    size = x.itemsize
    zero = one - one
    threads = min(threads, n)  # (numba.get_num_threads() here would stop the caching)
    for t in numba.prange(threads):
        buf = np.zeros((c, (h + 2 * ph) * wp + (kw - 1) * dw), x.dtype)  # its border stays 0
        acc = np.empty((o, length), x.dtype)
        for i in range(t * n // threads, (t + 1) * n // threads):
            _pad_planes(x[i], ph, pw, wp, buf)
            for a in range(kh):
                for b in range(kw):
                    off = a * dh * wp + b * dw
                    _cblas_gemm(fn, _NO_TRANS, _NO_TRANS, o, length, c, one,
                                _data_address(wt[a * kw + b]), c,
                                _data_address(buf) + off * size,
                                buf.shape[1], zero if a == 0 and b == 0 else one,
                                _data_address(acc), length)
            for oc in range(o):
                for r in range(ho):
                    dst = y[i, oc, r]
                    dst[:] = acc[oc, r * wp:r * wp + wo]


@numba.njit(cache=True, nogil=True, parallel=True)
def shifted_conv_grad_weight_tasks(fn, one, dy, x, kh, kw, ph, pw, dh, dw, prods, threads,
                                   by_rows, per):
    """prods[j] = cols(x[i]) @ dy[i]^T summed over the `per` images i of chunk j (images
    j*per on): a stride-1 convolution's weight gradient, transposed, [kh*kw*C, O]
    (offset-major), in `threads` tasks of consecutive chunks. cols(x[i]) [kh*kw*C, Ho*Wp]
    are the rows of x[i]'s zero-padded, flattened planes at each offset (contiguous
    copies, in the thread's cache); dy[i] is padded to the same Wp-wide rows with zeros,
    so the padding columns add nothing. A chunk's images side by side along K make one
    GEMM (K = per*Ho*Wp): where the per-offset products had [O, C] results of 16 by 16;
    transposed, because OpenBLAS ran [144, 1088] @ [1088, 16] at 98 GFLOP/s and [16, 1088]
    @ [1088, 144] at 62 (one thread). Chunks depend on the shapes alone, and the caller
    sums prods over them in order: the same sums on any number of threads.
    With `by_rows` (per = 1), the planes are copied kw times, once at each column offset,
    into [kw*C, Hp*Wp] rows, and each kernel row's offsets are one GEMM over a window of
    them (row a's start a*dh*Wp further on): a third of the copying, kh GEMMs of kw*C rows
    instead of one of kh*kw*C."""
    n, c, h, w = x.shape
    o, ho = dy.shape[1], dy.shape[2]
    wp, hp = w + 2 * pw, h + 2 * ph
    length = ho * wp
    k = kh * kw * c
    size = x.itemsize
    zero = one - one
    chunks = (n + per - 1) // per
    threads = min(threads, chunks)
    # by_rows: the planes at each column offset, no columns; else the padded planes (with
    # room for the last offset's slice) and the columns. Allocated unconditionally, with
    # sizes chosen here: allocating in the branches made each task allocate both sets.
    rows, extra = (kw * c, 0) if by_rows else (c, (kw - 1) * dw)
    ck, cl = (0, 0) if by_rows else (k, per * length)
    for t in numba.prange(threads):
        dyp = np.zeros((o, per * length), x.dtype)  # its padding columns stay 0
        buf = np.zeros((rows, hp * wp + extra), x.dtype)  # its border stays 0
        cols = np.empty((ck, cl), x.dtype)
        for j in range(t * chunks // threads, (t + 1) * chunks // threads):
            i0 = j * per
            m = min(n, i0 + per) - i0
            for q in range(m):
                _pad_planes(dy[i0 + q], 0, 0, wp, dyp[:, q * length:(q + 1) * length])
            if by_rows:
                for b in range(kw):
                    _pad_planes(x[i0], ph, pw, wp, buf[b * c:(b + 1) * c], b * dw)
                for a in range(kh):
                    _cblas_gemm(fn, _NO_TRANS, _TRANS, kw * c, o, length, one,
                                _data_address(buf) + a * dh * wp * size, hp * wp,
                                _data_address(dyp), length, zero,
                                _data_address(prods[j]) + a * kw * c * o * size, o)
                continue
            for q in range(m):
                _pad_planes(x[i0 + q], ph, pw, wp, buf)
                for a in range(kh):
                    for b in range(kw):
                        off = a * dh * wp + b * dw
                        for ch in range(c):
                            dst = cols[(a * kw + b) * c + ch, q * length:(q + 1) * length]
                            dst[:] = buf[ch, off:off + length]
            _cblas_gemm(fn, _NO_TRANS, _TRANS, k, o, m * length, one, _data_address(cols),
                        per * length, _data_address(dyp), per * length, zero,
                        _data_address(prods[j]), o)


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


def _broadcast(s, t):
    """NumPy's broadcast of two leading shapes of at most two axes, or None (other ranks,
    or sizes that do not broadcast). Tuples only: np.broadcast_shapes allocates 6 kB,
    which the workspace tests count."""
    if len(s) > 2 or len(t) > 2:
        return None
    s, t = (1,) * (len(t) - len(s)) + s, (1,) * (len(s) - len(t)) + t
    if any(d != e and 1 not in (d, e) for d, e in zip(s, t)):
        return None
    return tuple(max(d, e) for d, e in zip(s, t))


def _batch_steps(x, batch: tuple[int, int]) -> tuple[int, int] | None:
    """Bytes between the matrices of x along the product's two batch levels (`batch`, the
    broadcast leading shape padded to two with ones): 0 where x has no such axis or has it
    of size 1 (broadcast, as NumPy's matmul), None where its size differs or its step is
    negative."""
    lead, steps = x.shape[:-2], x.strides[:-2]
    lead, steps = (1,) * (2 - len(lead)) + lead, (0,) * (2 - len(steps)) + steps
    if any(d != 1 and (d != b or s < 0) for d, b, s in zip(lead, batch, steps)):
        return None
    return tuple(s if d > 1 else 0 for d, s in zip(lead, steps))


# Below this many multiply-adds a product is not worth a parallel region's start, its end
# and the call's 20 arguments: NumPy's matmul runs it on the calling thread. The threshold
# is the measured break-even (bench/bench_kernels.py --threads 2 --gemm).
_MIN_MACS = 1 << 21
# The image-task convolutions (PooledGemm.conv, conv_grad_weight) pay for their parallel
# region with more than a GEMM's work (padding, cropping, copies), so they start lower:
# digits-cnn's 16 -> 32 channel dW, 1.5M multiply-adds, is faster on two threads
# (bench_kernels.py --conv). Where between 2^18 and that they stop paying is not measured.
_MIN_CONV_MACS = 1 << 18

# Small images' weight gradients put several images side by side in one GEMM, so that K
# (the columns a product sums over) is at least this: digits-cnn's 8x8 images are 80
# columns each, and its batch of 32 takes 4 products of K = 640 and 3 adds instead of 32
# products and 31 adds, faster for both its convolutions on one thread and on two
# (bench_kernels.py --conv-only digits; of the K measured, this one among the best).
_MIN_GW_COLUMNS = 640


def _images_per_product(n: int, length: int, by_rows: bool) -> int:
    """Images per GEMM of a weight gradient whose images are `length` columns each: a
    function of the shapes alone, so a step's sums are the same on any number of threads."""
    if by_rows or length >= _MIN_GW_COLUMNS:
        return 1
    return min(n, -(-_MIN_GW_COLUMNS // length))


# OpenBLAS (NumPy's wheels are built with its SMALL_MATRIX_OPT) multiplies a product of at
# most 1e6 multiply-adds with its small-matrix kernels on its AVX-512 cores, which read the
# operands as they lie; larger ones are packed first. ResNet-164's 1x1 convolutions'
# products are [16, 64] @ [64, 1024] and the like, 2^20 multiply-adds each: just above it.
# Cut into blocks of columns (or rows) under it they run faster, the more so the smaller
# the product, and from 8M multiply-adds on the gain is gone (one thread, data in cache,
# SkylakeX's kernels on an AMD EPYC Zen 4; docs/benchmarks.md): up to 4M they are cut
# there (product_blocks). Each block
# is computed as a product of its own, so the split depends on the shape alone: the same
# blocks, and the same numbers, on any number of threads.
_SMALL_MACS = 1_000_000
_SPLIT_MAX_MACS = 1 << 22


def small_blocks(m: int, n: int, k: int) -> tuple[int, int]:
    """(row blocks, column blocks) that bring an [m, k] @ [k, n] product under OpenBLAS's
    small-matrix limit, along its larger side; (1, 1) where it is there already or too
    large for the split to pay."""
    macs = m * n * k
    if macs <= _SMALL_MACS or macs > _SPLIT_MAX_MACS:
        return 1, 1
    parts = -(-macs // _SMALL_MACS)
    return (1, min(parts, n)) if n >= m else (min(parts, m), 1)


def product_blocks(m: int, n: int, k: int, batch: int, small_kernels: bool) -> tuple[int, int]:
    """The blocks each of `batch` [m, k] @ [k, n] products is cut into, by the shapes alone
    (so that a step's numbers are the same on any number of threads: OpenBLAS's sums
    depend on the blocks). With OpenBLAS's small-matrix kernels, small_blocks. Without them
    (its AVX2 cores: Haswell, Zen) blocks under their limit are only more calls, slower
    than the whole product in halves and more so in small_blocks' (products of 2M-4M
    multiply-adds, one thread, an AMD EPYC Zen 2): products stay whole, but a single one of
    2M-4M, which goes in halves, so that two threads can share it (the pooled GEMMs cut it
    anyway) and one thread computes the same two blocks. Larger single products are cut
    for the threads (PooledGemm.__call__): on one thread they are NumPy's own call."""
    if small_kernels:
        return small_blocks(m, n, k)
    if batch == 1 and _MIN_MACS <= m * n * k <= _SPLIT_MAX_MACS:
        return (1, min(2, n)) if n >= m else (min(2, m), 1)
    return 1, 1


class PooledGemm:
    """a @ b for 2-d or 3-d float arrays, spread over `threads` Numba threads."""

    def __init__(self, cblas: NumpyCblas, threads: int):
        self.cblas = cblas
        self.threads = threads
        # gemm_tasks' arguments for "no bias" (or residual): an empty array, a stand-in for
        # the flat view of the result
        self._no_bias = {np.dtype(dt): (np.empty(0, dt), np.empty(1, dt))
                         for dt in (np.float32, np.float64)}

    def warm_up(self, dt) -> None:
        """Call each GEMM loop once for float dtype `dt` (FusedKernels.load)."""
        a = np.ones((2, 2), dt)
        c = np.empty_like(a)
        gemm_tasks(self.cblas.gemm[a.dtype], dt(1), dt(0), a.itemsize, 1, 1, 2, 2, 2,
                   a.ctypes.data, _NO_TRANS, 2, a.ctypes.data, _NO_TRANS, 2,
                   c.ctypes.data, 2, np.zeros((3, 2), np.int64), 1, 1, np.ones(2, dt),
                   c.reshape(-1), a.reshape(-1))
        shifted_conv_tasks(self.cblas.gemm[a.dtype], dt(1), a.reshape(1, 1, 2, 2),
                           a.reshape(1, 2, 2)[:, :1, :1].copy(), 1, 1, 0, 0, 1, 1,
                           np.empty((1, 1, 2, 2), dt), 1)
        shifted_conv_grad_weight_tasks(self.cblas.gemm[a.dtype], dt(1),
                                       a.reshape(1, 1, 2, 2), a.reshape(1, 1, 2, 2),
                                       1, 1, 0, 0, 1, 1, np.empty((1, 1, 1), dt), 1,
                                       False, 1)
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

    def conv(self, x, wt, kh, kw, ph, pw, dh, dw, out=None):
        """conv2d of x [N, C, H, W] with wt [kh*kw, O, C] (offsets row-major), stride 1,
        padding (ph, pw), dilation (dh, dw): shifted_conv_tasks, an image a task, into
        `out` (or a new [N, O, Ho, Wo] array); None where the loops do not take it (as
        __call__, or fewer images than threads: `shifted` splits their columns)."""
        n, c, h, w = x.shape
        noff, o, c2 = wt.shape
        ho, wo = h + 2 * ph - dh * (kh - 1), w + 2 * pw - dw * (kw - 1)
        if not self.cblas.held or x.dtype != wt.dtype or x.dtype not in self.cblas.gemm \
                or not (x.flags.c_contiguous and wt.flags.c_contiguous) or c != c2 \
                or noff != kh * kw or n < self.threads or ho < 1 or wo < 1 \
                or n * o * ho * (w + 2 * pw) * c * noff < _MIN_CONV_MACS:
            return None
        if out is None:
            out = np.empty((n, o, ho, wo), x.dtype)
        elif out.shape != (n, o, ho, wo) or out.dtype != x.dtype \
                or not out.flags.c_contiguous:
            return None
        shifted_conv_tasks(self.cblas.gemm[x.dtype], x.dtype.type(1), x, wt, kh, kw, ph, pw,
                           dh, dw, out, self.threads)
        return out

    def conv_grad_weight(self, dy, x, kh, kw, ph, pw, dh, dw, budget):
        """The weight gradient [O, C, kh, kw] of a stride-1 convolution of x [N, C, H, W]
        with padding (ph, pw), dilation (dh, dw), from dy [N, O, Ho, Wo]:
        shifted_conv_grad_weight_tasks, an image a task, the images' products summed in
        their order (so the same on one thread as on several). Its scratch, the images'
        products and each task's padded x, padded dy and shifted rows, stays within
        `budget` elements (the workspace the plan reserves): fewer tasks than threads
        where it must. None where the loops do not take it (outside a `cblas.limit(1)`
        block, other dtypes, operands not C-contiguous, too small, or no task fits)."""
        n, c, h, w = x.shape
        o, ho, wo = dy.shape[1], dy.shape[2], dy.shape[3]
        if not self.cblas.held or x.dtype != dy.dtype or x.dtype not in self.cblas.gemm \
                or not (x.flags.c_contiguous and dy.flags.c_contiguous) \
                or dy.shape[0] != n or ho != h + 2 * ph - dh * (kh - 1) \
                or wo != w + 2 * pw - dw * (kw - 1) \
                or n * o * ho * (w + 2 * pw) * c * kh * kw < _MIN_CONV_MACS:
            return None
        k, wp = kh * kw * c, w + 2 * pw
        # a GEMM a kernel row (by_rows) where it measured faster: 8-16 channels each way
        # (ResNet-164's first stage at 32x32, bench_kernels.py --conv-only "16 ch"), not
        # from 32 channels, nor for digits-cnn's 16 -> 32 at 8x8 or its 1 -> 16
        # (docs/benchmarks.md). Its scratch is less than the single GEMM's, which `task`
        # counts.
        by_rows = kw > 1 and 8 <= c <= 16 and o <= 16
        for per in (_images_per_product(n, ho * wp, by_rows), 1):
            chunks = -(-n // per)
            task = c * ((h + 2 * ph) * wp + (kw - 1) * dw) + (o + k) * per * ho * wp
            tasks = min(self.threads, chunks, (budget - chunks * k * o) // task)
            if tasks >= 1:
                break
        else:
            return None
        prods = np.empty((chunks, k, o), x.dtype)
        shifted_conv_grad_weight_tasks(self.cblas.gemm[x.dtype], x.dtype.type(1), dy, x, kh,
                                       kw, ph, pw, dh, dw, prods, tasks, by_rows, per)
        for j in range(1, chunks):  # in the chunks' order, in place: no scratch but prods
            prods[0] += prods[j]
        return prods[0].reshape(kh, kw, c, o).transpose(3, 2, 0, 1).copy()

    def __call__(self, a, b, out=None, accumulate=False, bias=None, blocked_only=False,
                 residual=None):
        """The product into `out` (or a new array; added to `out` with `accumulate`), plus
        `bias` along its rows if given (2-d products only), plus `residual` (an array of the
        result's shape) if given, or None where these loops do not take it: outside a
        `cblas.limit(1)` block (each task's call would start OpenBLAS's own threads), other
        dtypes, ranks above 4, operands or an `out` with no unit stride, a bias with a
        batched product, a bias or residual with an `out` (or a residual) not C-contiguous,
        a residual with `accumulate`, or a product too small to split, or with
        `blocked_only` one that product_blocks leaves whole. Leading dimensions broadcast
        as in NumPy's matmul."""
        if not self.cblas.held or a.dtype != b.dtype or a.dtype not in self.cblas.gemm or not (
                2 <= a.ndim <= 4 and 2 <= b.ndim <= 4):
            return None
        if bias is not None and (a.ndim != 2 or b.ndim != 2 or bias.dtype != a.dtype
                                 or bias.shape != (b.shape[1],)):
            return None
        if (bias is not None or residual is not None) and out is not None \
                and not out.flags.c_contiguous:
            return None
        if residual is not None and (accumulate or residual.dtype != a.dtype
                                     or not residual.flags.c_contiguous):
            return None
        m, k = a.shape[-2:]
        k2, n = b.shape[-2:]
        lead = _broadcast(a.shape[:-2], b.shape[:-2])
        if lead is None:
            return None
        outer, inner = (1,) * (2 - len(lead)) + lead
        batch = outer * inner
        if k != k2 or min(m, n, k) < 1 or batch * m * n * k < _MIN_MACS:
            return None
        fa, fb = _operand(a, m, k), _operand(b, k, n)
        sa, sb = _batch_steps(a, (outer, inner)), _batch_steps(b, (outer, inner))
        if fa is None or fb is None or sa is None or sb is None:
            return None
        shape = lead + (m, n)
        if residual is not None and residual.shape != shape:
            return None
        if out is None:
            if accumulate:
                return None
            out = np.empty(shape, a.dtype)
        elif out.shape != shape or out.dtype != a.dtype or out.strides[-1] != a.itemsize \
                or out.strides[-2] % a.itemsize or out.strides[-2] < n * a.itemsize:
            return None  # not rows of unit stride (Winograd's tile matrices are, apart)
        sc = _batch_steps(out, (outer, inner))
        if sc is None:
            return None
        # blocks by the shapes (product_blocks); then whole products (or those blocks)
        # where the batch gives every thread some, else blocks of one product along its
        # larger side, one a thread (more blocks pack the other operand more times, and
        # measured slower for a transformer's [1024, 64] @ [64, 256])
        parts_m, parts_n = product_blocks(m, n, k, batch, self.cblas.small_kernels)
        if blocked_only and parts_m * parts_n == 1:
            return None
        if batch * parts_m * parts_n < self.threads:
            split = -(-self.threads // batch)
            if m >= n:
                parts_m = max(parts_m, min(split, max(1, m // 8)))
            else:
                parts_n = max(parts_n, min(split, max(1, n // 8)))
        one = a.dtype.type(1)
        none, flat = self._no_bias[a.dtype]  # (an empty bias or residual; a stand-in c2)
        if bias is not None or residual is not None:
            flat = out.reshape(-1)
        steps = np.array([sa, sb, sc], np.int64)
        gemm_tasks(self.cblas.gemm[a.dtype], one, one if accumulate else one - one,
                   a.itemsize, batch, inner, m, n, k, a.ctypes.data, fa[0], fa[1],
                   b.ctypes.data, fb[0], fb[1], out.ctypes.data,
                   out.strides[-2] // a.itemsize, steps, parts_m, parts_n,
                   none if bias is None else np.ascontiguousarray(bias), flat,
                   none if residual is None else residual.reshape(-1))
        return out
