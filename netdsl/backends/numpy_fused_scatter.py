"""Scatter-adds and their gather for the NumPy backend's fused kernels (Numba, the `fast`
extra): the gradient of a row lookup (embedding, gather along the first axis), a strided
convolution's col2im (the adjoint of its windows), and im2col itself, the batch's windows
copied into [C*kh*kw, N*Ho*Wo] columns.

NumPy's `add.at` adds element by element through a generic inner loop; scatter_add_rows
adds whole rows in a compiled loop, in add.at's order (the same sums), an order of
magnitude faster on an embedding's gradient (bench/refs/netdsl_step.py --profile)."""
from __future__ import annotations

import numba

_JIT = {"cache": True, "nogil": True}  # sequential: two ids may name one row
_PAR = {**_JIT, "parallel": True}  # planes in parallel: each is independent


@numba.njit(**_JIT)
def scatter_add_rows(out2, ids, rows2):
    """out2[ids[i]] += rows2[i] for i in order (np.add.at's order, so the same sums);
    ids already checked to lie in [0, len(out2))."""
    d_ = out2.shape[1]
    for i in range(ids.shape[0]):
        r = ids[i]
        for j in range(d_):
            out2[r, j] += rows2[i, j]


@numba.njit(**_PAR)
def col2im_add(dxpad3, dcols5, sh, sw, dh, dw):
    """dxpad3[p] (a padded input-gradient plane) += dcols5[p, i, j] at each window offset
    (i, j), strided (sh, sw) and dilated (dh, dw): the offsets in NumPy's order, so each
    element's sum is the same to the bit; one pass per plane, which stays in cache."""
    planes, kh, kw, ho, wo = dcols5.shape
    for p in numba.prange(planes):
        for i in range(kh):
            for j in range(kw):
                r0, c0 = i * dh, j * dw
                for oy in range(ho):
                    r = r0 + oy * sh
                    for ox in range(wo):
                        dxpad3[p, r, c0 + ox * sw] += dcols5[p, i, j, oy, ox]


@numba.njit(**_PAR)
def im2col_rows(x, kh, kw, sh, sw, ph, pw, dh, dw, cols):
    """cols[(c*kh + a)*kw + b, (i*Ho + oy)*Wo + ox] = x[i, c, oy*sh + a*dh - ph,
    ox*sw + b*dw - pw], zero outside x (the padding, without a padded copy): the columns
    of a convolution with the batch folded into its GEMM, rows in parallel. A copy, so
    the same values as NumPy's copy of the strided windows."""
    n, nc, h, wd = x.shape
    rows, total = cols.shape
    p = total // n
    wo = (wd + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    ho = p // wo
    for r in numba.prange(rows):
        c, a, b = r // (kh * kw), (r // kw) % kh, r % kw
        off = b * dw - pw
        # the output columns whose input column lies inside x
        lo = 0 if off >= 0 else min(wo, (sw - 1 - off) // sw)
        hi = lo if wd - 1 - off < 0 else max(lo, min(wo, (wd - 1 - off) // sw + 1))
        for i in range(n):
            for oy in range(ho):
                iy = oy * sh + a * dh - ph
                base = (i * ho + oy) * wo
                if iy < 0 or iy >= h:
                    for ox in range(wo):
                        cols[r, base + ox] = 0
                    continue
                for ox in range(lo):
                    cols[r, base + ox] = 0
                for ox in range(lo, hi):
                    cols[r, base + ox] = x[i, c, iy, ox * sw + off]
                for ox in range(hi, wo):
                    cols[r, base + ox] = 0
