"""Winograd F(2x2, 3x3) tile transforms for the NumPy backend, compiled by Numba (the `fast`
extra); the GEMMs between them and the weight transforms are NumPy, in
netdsl.ir.ops.conv_winograd, which explains the algorithm.

Each loop reads its input from memory once and writes its output once, which whole-array
NumPy cannot do: the transforms are 8 to 24 additions per tile over strided views, and
as separate ufuncs they cost more than the multiplications Winograd saves. Channels run
in parallel (prange). Images n0 .. n1-1 of the batch form one chunk; tile (i, j) of image
n is column p = ((n - n0) * th + i) * tw + j of the [16, channels, P] tile matrices, row
4 * r + s holding element (r, s) of the 4x4 transformed tile.
"""
from __future__ import annotations

import numba

_PAR = {"cache": True, "nogil": True, "parallel": True, "error_model": "numpy"}


@numba.njit(inline="always")
def _bt(a0, a1, a2, a3):
    """B^T a for a column a of a 4x4 input tile."""
    return a0 - a2, a1 + a2, a2 - a1, a1 - a3


@numba.njit(inline="always")
def _at(a0, a1, a2, a3):
    """A^T a: two outputs from a column of a 4x4 product tile."""
    return a0 + a1 + a2, a1 - a2 - a3


@numba.njit(inline="always")
def _a(b0, b1):
    """A b: the adjoint of _at (a 2-vector of output gradients to 4 tile elements)."""
    return b0, b0 + b1, b0 - b1, -b1


@numba.njit(inline="always")
def _load(x, n, c, r, s):
    if 0 <= r < x.shape[2] and 0 <= s < x.shape[3]:
        return x[n, c, r, s]
    return x.dtype.type(0)


@numba.njit(**_PAR)
def input_tiles(x, ph, pw, n0, n1, th, tw, v):
    """v[16, C, P] = B^T d B for each 4x4 tile d of x [N, C, H, W] zero-padded by (ph, pw):
    tile (i, j) starts at row 2i - ph, column 2j - pw."""
    nc = x.shape[1]
    for c in numba.prange(nc):
        p = 0
        for n in range(n0, n1):
            for i in range(th):
                r = 2 * i - ph
                for j in range(tw):
                    s = 2 * j - pw
                    # rows of d, each transformed along its columns (d B)
                    e0 = _bt(_load(x, n, c, r, s), _load(x, n, c, r, s + 1),
                             _load(x, n, c, r, s + 2), _load(x, n, c, r, s + 3))
                    e1 = _bt(_load(x, n, c, r + 1, s), _load(x, n, c, r + 1, s + 1),
                             _load(x, n, c, r + 1, s + 2), _load(x, n, c, r + 1, s + 3))
                    e2 = _bt(_load(x, n, c, r + 2, s), _load(x, n, c, r + 2, s + 1),
                             _load(x, n, c, r + 2, s + 2), _load(x, n, c, r + 2, s + 3))
                    e3 = _bt(_load(x, n, c, r + 3, s), _load(x, n, c, r + 3, s + 1),
                             _load(x, n, c, r + 3, s + 2), _load(x, n, c, r + 3, s + 3))
                    for k in range(4):  # then B^T down each column
                        t = _bt(e0[k], e1[k], e2[k], e3[k])
                        v[k, c, p] = t[0]
                        v[4 + k, c, p] = t[1]
                        v[8 + k, c, p] = t[2]
                        v[12 + k, c, p] = t[3]
                    p += 1


@numba.njit(**_PAR)
def output_tiles(m, n0, n1, th, tw, y):
    """y[n, o, 2i:2i+2, 2j:2j+2] = A^T M A for each tile of m[16, O, P] (cropped at y's
    bottom and right edges)."""
    no, ho, wo = y.shape[1], y.shape[2], y.shape[3]
    for o in numba.prange(no):
        p = 0
        for n in range(n0, n1):
            for i in range(th):
                for j in range(tw):
                    f0 = _at(m[0, o, p], m[1, o, p], m[2, o, p], m[3, o, p])
                    f1 = _at(m[4, o, p], m[5, o, p], m[6, o, p], m[7, o, p])
                    f2 = _at(m[8, o, p], m[9, o, p], m[10, o, p], m[11, o, p])
                    f3 = _at(m[12, o, p], m[13, o, p], m[14, o, p], m[15, o, p])
                    for b in range(2):
                        t = _at(f0[b], f1[b], f2[b], f3[b])
                        s = 2 * j + b
                        if s < wo:
                            y[n, o, 2 * i, s] = t[0]
                            if 2 * i + 1 < ho:
                                y[n, o, 2 * i + 1, s] = t[1]
                    p += 1


@numba.njit(**_PAR)
def output_tiles_adjoint(dy, n0, n1, th, tw, dm):
    """dm[16, O, P] = A dY A^T for each 2x2 tile dY of dy [N, O, Ho, Wo] (zero beyond its
    edges): the adjoint of output_tiles, for the weight gradient."""
    no = dy.shape[1]
    for o in numba.prange(no):
        p = 0
        for n in range(n0, n1):
            for i in range(th):
                for j in range(tw):
                    r0 = _a(_load(dy, n, o, 2 * i, 2 * j), _load(dy, n, o, 2 * i, 2 * j + 1))
                    r1 = _a(_load(dy, n, o, 2 * i + 1, 2 * j),
                            _load(dy, n, o, 2 * i + 1, 2 * j + 1))
                    for k in range(4):
                        t = _a(r0[k], r1[k])
                        dm[k, o, p] = t[0]
                        dm[4 + k, o, p] = t[1]
                        dm[8 + k, o, p] = t[2]
                        dm[12 + k, o, p] = t[3]
                    p += 1
