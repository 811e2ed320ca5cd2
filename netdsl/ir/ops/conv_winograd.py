"""3x3 stride-1 convolutions by Winograd's minimal filtering F(2x2, 3x3) (Lavin and Gray,
"Fast Algorithms for Convolutional Neural Networks", 2016), on the NumPy backend where its
fused kernels (Numba) are loaded.

Every 2x2 block of output is Y = A^T [ (G g G^T) (*) (B^T d B) ] A, summed over input
channels, with d the 4x4 input tile under it, g a 3x3 filter and (*) the element-wise
product: 16 multiplications per block and channel pair instead of 36. Over a batch the
products are 16 GEMMs, one per tile element: M[k] = U[k] @ V[k] with U [16, O, C] the
transformed filters and V [16, C, P] the transformed tiles (P tiles). The transforms
(netdsl.backends.numpy_winograd) are additions only; the constants are 0, +-1 and +-1/2,
so the result is the direct convolution's up to float rounding (float32: about 1e-6
relative; tests/test_conv_winograd.py).

The weight gradient is the adjoint of the same formula: dU[k] = dM[k] @ V[k]^T with
dM = A dY A^T per tile, then dg = G^T dU G; one GEMM per tile element over every tile
(K = P), so the sum over the batch costs nothing extra. The input gradient of a stride-1
convolution is itself a convolution (dy with the flipped kernel), so it comes through the
forward path.

The batch is processed in chunks of whole images, as many as make _ENOUGH_TILES tiles
(`chunk`); the memory plan's workspace rule (conv._scratch_elems) reads the same
function.
"""
from __future__ import annotations

import numpy as np

from netdsl.ir.ops._util import matmul

_G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])
# G (x) G [16, 9]: element (4*i + j, 3*a + b) is G[i, a] * G[j, b], so G g G^T of every
# filter at once is one GEMM, (G (x) G) @ w.reshape(O*C, 9)^T = U as [16, O, C], and the
# weight gradient's G^T dU G is dU.reshape(16, O*C)^T @ (G (x) G). Exact in either dtype
# (products of 0, +-1/2 and 1). Broadcast matmuls of the 4x3 G over every filter take
# far longer on many channels (VGG-16's 512-channel 14x14 forward; bench_kernels.py
# --conv).
_KRON = {np.dtype(t): np.kron(_G, _G).astype(t) for t in (np.float32, np.float64)}


def applies(geom, groups: int, n: int, c: int, o: int, ho: int, wo: int) -> bool:
    """Where this kernel runs: 3x3, stride 1, undilated, ungrouped, at least 32 channels
    each way, and at least 96 tiles in the batch, below which its 16 small GEMMs lose to
    the flat shift's 9 larger ones or to the folded im2col GEMM (16 channels at 32x32, or
    64 tiles of 64 channels, on two threads). Small images are no exception: with the
    filter transforms one GEMM and the GEMMs on the loops' threads, ResNet-50's
    512-channel 7x7 layers and ResNet-164's 64-channel 8x8 ones run faster so
    (bench/bench_kernels.py --conv)."""
    kh, kw, sh, sw, _ph, _pw, dh, dw = geom
    if (kh, kw, sh, sw, dh, dw, groups) != (3, 3, 1, 1, 1, 1, 1) or min(c, o) < 32:
        return False
    th, tw = tiles(ho, wo)
    return n * th * tw >= 96


def tiles(ho: int, wo: int) -> tuple[int, int]:
    return (ho + 1) // 2, (wo + 1) // 2


# A chunk needs no more tiles than this for its GEMMs to run at full speed: VGG-16's
# 224x224 images (12,544 tiles each) go one at a time, beside the step's largest
# activations, with a third of the tile buffers of three at once and no slower
# (bench/bench_kernels.py --conv). Below it, fewer chunks are faster still: each is three
# parallel passes and 16 GEMMs, and a weight gradient's GEMMs get a longer K. Chunks are
# not held to the flat shift's scratch: that made them slower than the whole batch at
# once (bench/bench_winograd_chunks.py), and no network's planned peak moved without
# that bound (docs/benchmarks.md, "Winograd's chunks").
_ENOUGH_TILES = 4096


def chunk(n: int, c: int, o: int, ho: int, wo: int) -> tuple[int, int]:
    """(images per chunk, scratch elements) for a batch of n: as many images as give
    _ENOUGH_TILES tiles (at least one), plus the [16, O, C] filters and their product
    buffer."""
    th, tw = tiles(ho, wo)
    per_image = 16 * th * tw * (c + o)
    per = max(1, min(n, -(-_ENOUGH_TILES // (th * tw))))
    # beside the tile buffers: U, [16, O, C] (one GEMM makes it from w), or dU and,
    # without the fused kernels' GEMMs, the temporary product added into it per chunk
    # (measured: tests/test_plan.py)
    return per, per * per_image + 32 * (_SKEW + o * c)


# The 16 tile matrices of a chunk lie _SKEW elements further apart than their size: rows
# a power-of-two multiple of 4 KiB apart map to the same cache sets, and the transforms,
# which write (or read) all 16 at once, would take longer than their GEMMs so.
_SKEW = 16


def _tile_matrices(buf, rows: int, p: int):
    """[16, rows, p] views into `buf` for a chunk of p tiles (matrix k at k * (rows * p +
    _SKEW)); each matrix is C-contiguous, so the GEMMs take them as they are."""
    size = rows * p
    return buf[:16 * (size + _SKEW)].reshape(16, size + _SKEW)[:, :size].reshape(16, rows, p)


def _buffer(rows: int, per: int, th: int, tw: int, dtype):
    return np.empty(16 * (rows * per * th * tw + _SKEW), dtype)


def conv(fast, x, w, ph: int, pw: int, out=None):
    """y = conv2d(x, w) with 3x3 w, stride 1, padding (ph, pw); into `out` if given."""
    n, c, h, wd = x.shape
    o = w.shape[0]
    ho, wo = h + 2 * ph - 2, wd + 2 * pw - 2
    th, tw = tiles(ho, wo)
    u = matmul(np, _KRON[x.dtype], w.astype(x.dtype, copy=False).reshape(o * c, 9).T,
               fast=fast).reshape(16, o, c)  # G g G^T per filter, as [16, O, C]
    y = out if out is not None else np.empty((n, o, ho, wo), x.dtype)
    per = chunk(n, c, o, ho, wo)[0]
    v, m = _buffer(c, per, th, tw, x.dtype), _buffer(o, per, th, tw, x.dtype)
    for n0 in range(0, n, per):
        n1 = min(n, n0 + per)
        p = (n1 - n0) * th * tw
        vv, mm = _tile_matrices(v, c, p), _tile_matrices(m, o, p)
        fast.winograd.input_tiles(x, ph, pw, n0, n1, th, tw, vv)
        matmul(np, u, vv, mm, fast)
        fast.winograd.output_tiles(mm, n0, n1, th, tw, y)
    return y


def grad_weight(fast, dy, x, ph: int, pw: int):
    """dW [O, C, 3, 3] of y = conv2d(x, w) (3x3, stride 1, padding (ph, pw))."""
    n, c = x.shape[:2]
    o, ho, wo = dy.shape[1:]
    th, tw = tiles(ho, wo)
    per = chunk(n, c, o, ho, wo)[0]
    v, dm = _buffer(c, per, th, tw, x.dtype), _buffer(o, per, th, tw, x.dtype)
    du = np.zeros((16, o, c), x.dtype)
    for n0 in range(0, n, per):
        n1 = min(n, n0 + per)
        p = (n1 - n0) * th * tw
        vv, mm = _tile_matrices(v, c, p), _tile_matrices(dm, o, p)
        fast.winograd.input_tiles(x, ph, pw, n0, n1, th, tw, vv)
        fast.winograd.output_tiles_adjoint(dy, n0, n1, th, tw, mm)
        matmul(np, mm, vv.transpose(0, 2, 1), du, fast, accumulate=True)
    del v, dm
    # G^T dU G per filter
    return matmul(np, du.reshape(16, o * c).T, _KRON[x.dtype], fast=fast).reshape(o, c, 3, 3)
