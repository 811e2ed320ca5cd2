"""2-d max pooling's backward for the NumPy backend's fused kernels (Numba, the `fast`
extra): one pass over x instead of five NumPy passes per kernel offset."""
from __future__ import annotations

import numba
import numpy as np

_PAR = {"cache": True, "nogil": True, "parallel": True}  # planes in parallel


@numba.njit(**_PAR)
def maxpool2d_grad(dy, x, kh, kw, sh, sw, ph, pw, dx):
    """dx (zeroed, x's shape) += dy at the first maximum of each window in row-major order
    (positions in the padding count as -inf; a NaN is the maximum), planes in parallel:
    the NumPy kernel's rule (netdsl.ir.ops.pool._maxpool_grad) in one pass over x."""
    n, nc, h, w = x.shape
    oh, ow = dy.shape[2], dy.shape[3]
    for plane in numba.prange(n * nc):
        i = plane // nc
        c = plane - i * nc
        xf = x[i, c].reshape(h * w)  # C-contiguous (FusedKernels.accepts)
        dxf = dx[i, c].reshape(h * w)
        for oy in range(oh):
            r0 = oy * sh - ph
            ky0, ky1 = max(0, -r0), min(kh, h - r0)
            for ox in range(ow):
                q0 = ox * sw - pw
                kx0, kx1 = max(0, -q0), min(kw, w - q0)
                at = (r0 + ky0) * w + q0 + kx0  # the first element inside, flat
                best = xf[at]
                for ky in range(ky0, ky1):
                    row = (r0 + ky) * w + q0
                    for kx in range(kx0, kx1):
                        v = xf[row + kx]
                        # branch-free (selects): the argmax is data-dependent
                        take = (v > best) | ((v != v) & (best == best))
                        best = v if take else best
                        at = row + kx if take else at
                # a window of -inf whose padding comes first: the padding is its maximum
                if not (best == -np.inf and (ky0 > 0 or kx0 > 0)):
                    dxf[at] += dy[i, c, oy, ox]


def maxpool2x2_grad(dy, x, dx):
    """maxpool2d_grad for 2x2 windows at stride 2 without padding (VGG's, digits-cnn's),
    every window inside x: the same rule, written into dx (each element of x is in at most
    one window; x's rows and columns past the last window keep what dx held, zeros by the
    caller). The gradient moves as the integer bits of dy (int32 or int64 views of the
    same memory), masked by the winner's compare: no float selects, which LLVM lowered to
    branches on AVX2 (the argmax's unpredictable jumps)."""
    bits = np.int32 if x.dtype.itemsize == 4 else np.int64
    _maxpool2x2_grad_bits(dy.view(bits), x, dx.view(bits))


@numba.njit(**_PAR)
def _maxpool2x2_grad_bits(dyi, x, dxi):
    """The window's maximum first, as maxpool2x2 takes it (a NaN if any), then the first
    tap equal to it in row-major order (the first NaN where it is one): the tap the
    compare chain a, b, c, d of the NumPy kernel's rule picks (a later tap replaces the
    running maximum only when strictly greater, or a NaN over a number; -0.0 and 0.0 are
    equal). dy's bits go there, 0 (+0.0) to the other three: the same bits as the chain
    with float selects, by integer masks, which vectorise on AVX2 where the selects do not
    (bench/bench_kernels.py)."""
    n, nc, h, w = x.shape
    oh, ow = dyi.shape[2], dyi.shape[3]
    xf = x.reshape(x.size)  # C-contiguous (FusedKernels.accepts)
    dxf = dxi.reshape(dxi.size)
    dyf = dyi.reshape(dyi.size)
    for plane in numba.prange(n * nc):
        base = plane * h * w
        for oy in range(oh):
            r0 = base + 2 * oy * w
            r1 = r0 + w
            o0 = (plane * oh + oy) * ow
            for ox in range(ow):
                a, b = xf[r0 + 2 * ox], xf[r0 + 2 * ox + 1]
                c, d = xf[r1 + 2 * ox], xf[r1 + 2 * ox + 1]
                m0 = a if (a > c) | (a != a) else c
                m1 = b if (b > d) | (b != b) else d
                m = m0 if (m0 > m1) | (m0 != m0) else m1
                ta = np.int32((a == m) | (a != a))
                tb = np.int32((b == m) | (b != b)) & (1 - ta)
                tc = np.int32((c == m) | (c != c)) & (1 - ta) & (1 - tb)
                td = 1 - (ta | tb | tc)
                g = dyf[o0 + ox]
                dxf[r0 + 2 * ox] = g & -ta
                dxf[r0 + 2 * ox + 1] = g & -tb
                dxf[r1 + 2 * ox] = g & -tc
                dxf[r1 + 2 * ox + 1] = g & -td


@numba.njit(cache=True, nogil=True)
def maxpool2x2(x, y):
    """y = the maximum of each 2x2 window at stride 2 (no padding, every window inside x;
    a NaN wins): the values the NumPy kernel's np.maximum passes give, a window at a time
    on one thread, as NumPy's passes run (Numba's parallel loop made digits-cnn's small
    pool slower and VGG-16's no faster): one pass over x instead of NumPy's several
    (bench/bench_kernels.py)."""
    n, nc, h, w = x.shape
    oh, ow = y.shape[2], y.shape[3]
    xf = x.reshape(x.size)  # C-contiguous (FusedKernels.accepts)
    yf = y.reshape(y.size)
    for p in range(n * nc * oh):
        plane = p // oh
        r0 = plane * h * w + 2 * (p - plane * oh) * w
        r1 = r0 + w
        for ox in range(ow):
            a, b = xf[r0 + 2 * ox], xf[r0 + 2 * ox + 1]
            c, d = xf[r1 + 2 * ox], xf[r1 + 2 * ox + 1]
            m0 = a if (a > c) | (a != a) else c
            m1 = b if (b > d) | (b != b) else d
            yf[p * ow + ox] = m0 if (m0 > m1) | (m0 != m0) else m1
