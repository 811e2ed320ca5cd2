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
