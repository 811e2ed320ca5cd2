"""Normalisation loops for the NumPy backend's fused kernels (Numba, the `fast` extra):
batchnorm (+ relu) forward and backward, layernorm and softmax over rows.

NumPy runs one pass over memory per ufunc, so batchnorm + relu forward and backward make
18 or more passes over tensors of the activation's size. These loops take a (N, C, P)
view of NCHW data (P = the spatial size), a run of channels a thread, and walk it in
memory order: the statistics' pass and then the output's (the second one from the cache
where the tensor fits there), dx's one pass.

Numerics (the same definitions as the NumPy reference kernels in netdsl.ir.ops.norm and
norm_fused, which the tests compare these against):
- the batch mean and biased variance are computed in one pass over data shifted by the
  channel's first element (so the variance does not cancel: the shift is a sample, within
  a few standard deviations of the mean); every sum is taken in the data's dtype over
  blocks of at most _BLOCK contiguous elements and in float64 across the blocks;
- the affine step is z = (x - mean) * (inv * w) + b with mean, inv = 1/sqrt(var + eps),
  w and b first rounded to the data's dtype, computed in the data's dtype - the forward and
  both backward kernels compute z identically, so the relu mask the backward recomputes
  is the forward's exactly;
- the backward's per-channel sums are taken the same way;
- bf16 data (mixed precision) comes as its uint16 bits, read and written through
  numpy_fused_bf16's `ld` and `stored` and computed in float32, by the same loops.

Compiled with `cache=True`: the machine code is kept in `__pycache__` next to this file,
so only the first process after an install pays the compile. `reassoc` lets the
reductions use SIMD lanes (a different summation order, not a less exact one).
Layernorm and softmax go row by row (rows in parallel); layernorm's moments are summed
as batchnorm's, softmax's sums in float64.
"""
from __future__ import annotations

import math

import numba
import numpy as np

from netdsl.backends.numpy_fused_activation import exp_of_nonpositive_in_place
from netdsl.backends.numpy_fused_activation import like as _like
from netdsl.backends.numpy_fused_bf16 import ld, stored

_JIT = {"cache": True, "nogil": True, "fastmath": {"reassoc"}}
_PAR = {**_JIT, "parallel": True}  # channels in parallel: each is independent of the others


# A channel's sums go block by block: each block of at most _BLOCK contiguous elements (a
# row of P, or part of one) is summed in the data's dtype, in SIMD lanes, and the block's
# sum joins a float64 total. Accumulating every element in float64 would halve the lanes
# and cost a conversion per element, for an accuracy the float32 result's own rounding
# (a relative 2e-7) throws away.
_BLOCK = 1024


@numba.njit(inline="always")
def _moments(x3, c0, c1, moments):
    """moments[0, c] and [1, c] = the float64 mean and biased variance of x3[:, c, :] for
    c0 <= c < c1: one pass over data shifted by each channel's first element, in memory
    order (image by image, the channels' rows in turn), each row's block sums added in the
    images' order."""
    n, _, p = x3.shape
    for c in range(c0, c1):
        moments[0, c] = 0.0
        moments[1, c] = 0.0
    for i in range(n):
        for c in range(c0, c1):
            k = ld(x3[0, c, 0])
            for j0 in range(0, p, _BLOCK):
                b1, b2 = _shifted_sums(x3[i, c, j0:j0 + _BLOCK], k)
                moments[0, c] += np.float64(b1)
                moments[1, c] += np.float64(b2)
    for c in range(c0, c1):
        _mean_and_variance(x3, c, moments[0, c], moments[1, c], moments)


@numba.njit(inline="always")
def _mean_and_variance(x3, c, s1, s2, moments):
    """moments[:, c] from channel c's sums of x - x3[0, c, 0] and of its square."""
    m = x3.shape[0] * x3.shape[2]
    mu = s1 / m
    moments[0, c] = np.float64(ld(x3[0, c, 0])) + mu
    moments[1, c] = max(s2 / m - mu * mu, 0.0)


@numba.njit(inline="always")
def _shifted_sums(r, k):
    """sum(r - k) and sum((r - k)^2) of a 1-d block, in its dtype."""
    s1 = _like(r, 0.0)
    s2 = _like(r, 0.0)
    for j in range(r.shape[0]):
        d = ld(r[j]) - k
        s1 += d
        s2 += d * d
    return s1, s2


@numba.njit(inline="always")
def _masked_sums(dy, x, mt, scale, shift, zero, relu, cap, capped):
    """sum(g) and sum(g * (x - mean)) of a 1-d block, in its dtype; g is dy, times the
    relu mask with `relu` (_passes; z computed as the forward does)."""
    sg = zero
    sgd = zero
    for j in range(x.shape[0]):
        d = ld(x[j]) - mt
        g = ld(dy[j])
        if relu and not _passes(d * scale + shift, zero, cap, capped):
            g = zero
        sg += g
        sgd += g * d
    return sg, sgd


@numba.njit(inline="always")
def _consts(x3, mean, inv, w, b):
    """mean, inv, scale = inv * w, shift = b and 0 in the data's dtype."""
    it = _like(x3, inv)
    return _like(x3, mean), it, it * _like(x3, ld(w)), _like(x3, ld(b)), _like(x3, 0.0)


# The backward batchnorm kernels below split the channels into `tasks` runs, one a
# thread, and each walks its run in memory order: image by image, the run's rows of P
# elements in turn (the forward splits the data itself: bn_forward). Channel by channel
# (N separate chunks of P, C*P elements apart) the hardware prefetchers lose the stream
# at every chunk, which from a cold cache takes markedly longer for the same bits.
@numba.njit(inline="always")
def _runs(tasks, nc, t):
    return t * nc // tasks, (t + 1) * nc // tasks


@numba.njit(inline="always")
def _passes(z, zero, cap, capped):
    """The relu's mask, z > 0, and z < cap where capped (relu6's: open at both ends)."""
    return z > zero and (not capped or z < cap)


@numba.njit(inline="always")
def _block_sums(x3, parts, r0, r1):
    """parts[0 and 1, i, c, q]: the sums of x - x3[0, c, 0] and of its square over block q
    of row (i, c), for the (image, channel) rows r0 <= r < r1 in memory order."""
    nc = x3.shape[1]
    for r in range(r0, r1):
        i, c = r // nc, r % nc
        k = ld(x3[0, c, 0])
        for q in range(parts.shape[3]):
            b1, b2 = _shifted_sums(x3[i, c, q * _BLOCK:(q + 1) * _BLOCK], k)
            parts[0, i, c, q] = np.float64(b1)
            parts[1, i, c, q] = np.float64(b2)


@numba.njit(inline="always")
def _moments_of(x3, parts, moments):
    """moments[:, c] from _block_sums' parts, added in _moments' order."""
    n, nc = x3.shape[0], x3.shape[1]
    for c in range(nc):
        s1 = 0.0
        s2 = 0.0
        for i in range(n):
            for q in range(parts.shape[3]):
                s1 += parts[0, i, c, q]
                s2 += parts[1, i, c, q]
        _mean_and_variance(x3, c, s1, s2, moments)


@numba.njit(inline="always")
def _block_parts(x3):
    return np.empty((2, x3.shape[0], x3.shape[1], (x3.shape[2] + _BLOCK - 1) // _BLOCK))


@numba.njit(inline="always")
def _normalise_rows(x3, moments, w, b, eps, relu, cap, y3, r0, r1):
    """y3's rows r0 <= r < r1 (as _block_sums'): (x - mean) * (inv * w) + b, with the
    relu (capped at `cap` unless it is inf) where `relu`."""
    nc, p = x3.shape[1], x3.shape[2]
    capped, top = cap < np.inf, _like(x3, cap)  # (top: the cap in the data's dtype)
    for r in range(r0, r1):
        i, c = r // nc, r % nc
        mt, _it, scale, shift, zero = _consts(
            x3, moments[0, c], 1.0 / math.sqrt(moments[1, c] + eps), w[c], b[c])
        for j in range(p):
            z = (ld(x3[i, c, j]) - mt) * scale + shift
            if relu and not z > zero:  # NaN stays NaN; z > 0 is the backward's mask
                z = zero if z == z else z
            if relu and capped and z > top:
                z = top
            y3[i, c, j] = stored(y3, z)


@numba.njit(**_PAR)
def bn_forward(x3, w, b, eps, relu, cap, y3, moments, tasks):
    """Training-mode batchnorm (+ relu, capped at `cap` unless it is inf: relu6 for 6) of
    x3 (N, C, P) into y3; moments[0] and [1] get each channel's mean and biased variance
    (float64) for the running statistics. The threads take contiguous runs of the data
    (of images, where there are as many as threads), as the convolutions before and
    after split it (an image a task): each reads what it wrote and writes what it will
    read, where a split by channels would read half its data from the other core's cache.
    The block sums are kept by row and added in _moments' order: the
    same bits on any number of threads."""
    parts = _block_parts(x3)
    rows = x3.shape[0] * x3.shape[1]  # the (image, channel) rows, a contiguous run a task
    for t in numba.prange(tasks):
        _block_sums(x3, parts, t * rows // tasks, (t + 1) * rows // tasks)
    _moments_of(x3, parts, moments)
    for t in numba.prange(tasks):
        _normalise_rows(x3, moments, w, b, eps, relu, cap, y3, t * rows // tasks,
                        (t + 1) * rows // tasks)


@numba.njit(**_PAR)
def bn_moments(x3, moments, tasks):
    """bn_forward's statistics alone (a synchronised batchnorm's local moments, which it
    combines over the devices before it normalises: bn_normalise)."""
    parts = _block_parts(x3)
    rows = x3.shape[0] * x3.shape[1]
    for t in numba.prange(tasks):
        _block_sums(x3, parts, t * rows // tasks, (t + 1) * rows // tasks)
    _moments_of(x3, parts, moments)


@numba.njit(**_PAR)
def bn_normalise(x3, moments, w, b, eps, relu, cap, y3, tasks):
    """bn_forward's output pass with the given float64 moments (mean, biased variance)."""
    rows = x3.shape[0] * x3.shape[1]
    for t in numba.prange(tasks):
        _normalise_rows(x3, moments, w, b, eps, relu, cap, y3, t * rows // tasks,
                        (t + 1) * rows // tasks)


@numba.njit(inline="always")
def _grad_sums(dy3, x3, moments, w, b, eps, relu, cap, c0, c1, out):
    """out[0, c] = sum(g * x_hat) and out[1, c] = sum(g) for c0 <= c < c1, g = dy (times
    the relu mask with `relu`: _passes), x_hat from the float64 moments (mean, biased
    variance); summed in memory order, a block at a time."""
    n, nc, p = x3.shape
    capped, top = cap < np.inf, _like(x3, cap)  # (top: the cap in the data's dtype)
    sums = np.zeros((2, nc))  # (its run's columns only)
    for i in range(n):
        for c in range(c0, c1):
            mt, _it, scale, shift, zero = _consts(
                x3, moments[0, c], 1.0 / math.sqrt(moments[1, c] + eps), w[c], b[c])
            for j0 in range(0, p, _BLOCK):
                j1 = j0 + _BLOCK
                b1, b2 = _masked_sums(dy3[i, c, j0:j1], x3[i, c, j0:j1], mt, scale,
                                      shift, zero, relu, top, capped)
                sums[0, c] += np.float64(b1)
                sums[1, c] += np.float64(b2)
    for c in range(c0, c1):
        it = _like(x3, 1.0 / math.sqrt(moments[1, c] + eps))
        out[0, c] = sums[1, c] * np.float64(it)
        out[1, c] = sums[0, c]


@numba.njit(**_PAR)
def bn_grad_stats(dy3, x3, w, b, eps, relu, cap, out, tasks):
    """Batchnorm's backward statistics into out (4, C): sum(g * x_hat), sum(g), the batch
    mean and 1/std, where g is dy (times the relu mask with `relu`: _passes)."""
    nc = x3.shape[1]
    for t in numba.prange(tasks):
        c0, c1 = _runs(tasks, nc, t)
        moments = np.empty((2, nc))  # (its run's columns only)
        _moments(x3, c0, c1, moments)
        _grad_sums(dy3, x3, moments, w, b, eps, relu, cap, c0, c1, out)
        for c in range(c0, c1):
            out[2, c] = _like(x3, moments[0, c])
            out[3, c] = _like(x3, 1.0 / math.sqrt(moments[1, c] + eps))


@numba.njit(**_PAR)
def bn_grad_sums(dy3, x3, moments, w, b, eps, relu, cap, out, tasks):
    """bn_grad_stats' first two rows with the given float64 moments (a synchronised
    batchnorm's local sums, which it adds over the devices: bn_grad_input's `count`)."""
    nc = x3.shape[1]
    for t in numba.prange(tasks):
        c0, c1 = _runs(tasks, nc, t)
        _grad_sums(dy3, x3, moments, w, b, eps, relu, cap, c0, c1, out)


@numba.njit(**_PAR)
def bn_grad_input(dy3, x3, st, w, b, relu, cap, acc3, accumulate, dx3, tasks, count=0):
    """dx of batchnorm (+ relu) from bn_grad_stats' rows into dx3:
    w * inv * (g - sum(g) / M - (x - mean) * inv * sum(g * x_hat) / M), plus acc3 with
    `accumulate` (acc3 may be dx3 itself otherwise: it is not read then). M is `count`, or
    where that is 0 the values a channel of x3 (a synchronised batchnorm's sums count every
    device's). Element by element: the threads take contiguous runs of rows, as
    bn_forward's."""
    n, nc, p = x3.shape
    m = count if count > 0 else n * p
    capped, top = cap < np.inf, _like(x3, cap)  # (top: the cap in the data's dtype)
    rows = n * nc
    for t in numba.prange(tasks):
        for r in range(t * rows // tasks, (t + 1) * rows // tasks):
            i, c = r // nc, r % nc
            gw, sg = np.float64(st[0, c]), np.float64(st[1, c])
            mt, it, scale, shift, zero = _consts(x3, st[2, c], st[3, c], w[c], b[c])
            k_dev, k_sum, _s, _b, _z = _consts(x3, -np.float64(it) * gw / m, -sg / m,
                                               0.0, 0.0)
            # two loops, not one with `if accumulate` inside: with acc3 the same array as
            # dx3 that loop does not vectorise
            if accumulate:
                for j in range(p):
                    d = ld(x3[i, c, j]) - mt
                    g = ld(dy3[i, c, j])
                    if relu and not _passes(d * scale + shift, zero, top, capped):
                        g = zero
                    dx3[i, c, j] = stored(dx3, (d * k_dev + k_sum + g) * scale + ld(acc3[i, c, j]))
            else:
                for j in range(p):
                    d = ld(x3[i, c, j]) - mt
                    g = ld(dy3[i, c, j])
                    if relu and not _passes(d * scale + shift, zero, top, capped):
                        g = zero
                    dx3[i, c, j] = stored(dx3, (d * k_dev + k_sum + g) * scale)


@numba.njit(**_JIT)
def bn_combine(parts, counts, out):
    """The mean and biased variance (out's rows) of a batch whose parts' moments are
    parts' row pairs (mean, biased variance; part k counts[k] values a channel): Chan's
    combination in float64, as ir.ops.norm_sync's NumPy kernel (a synchronised
    batchnorm's: one call instead of a dozen ufuncs on a few hundred numbers)."""
    total = 0.0
    for k in range(counts.shape[0]):
        total += counts[k]
    for c in range(parts.shape[1]):
        s = 0.0
        for k in range(counts.shape[0]):
            s += counts[k] * np.float64(parts[2 * k, c])
        mean = s / total
        v = 0.0
        for k in range(counts.shape[0]):
            d = np.float64(parts[2 * k, c]) - mean
            v += counts[k] * (np.float64(parts[2 * k + 1, c]) + d * d)
        out[0, c] = mean
        out[1, c] = v / total


# -- layernorm over rows -----------------------------------------------------------------------
# x2 is (R, D): R rows each normalised over its D elements. The statistics are summed as
# batchnorm's, over data shifted by the row's first element (as batchnorm's, above), rows in
# parallel; w and b are (D,) (ones and zeros without affine).
@numba.njit(inline="always")
def _row_moments(x2, r):
    d_ = x2.shape[1]
    k = x2[r, 0]
    s1 = 0.0
    s2 = 0.0
    for j0 in range(0, d_, _BLOCK):
        b1, b2 = _shifted_sums(x2[r, j0:j0 + _BLOCK], k)
        s1 += np.float64(b1)
        s2 += np.float64(b2)
    mu = s1 / d_
    return np.float64(k) + mu, max(s2 / d_ - mu * mu, 0.0)


@numba.njit(**_PAR)
def ln_forward(x2, w, b, eps, y2):
    """y = (x - mean) * inv * w + b per row, in the data's dtype."""
    for r in numba.prange(x2.shape[0]):
        mean, var = _row_moments(x2, r)
        mt, it, _s, _b, _z = _consts(x2, mean, 1.0 / math.sqrt(var + eps), 1.0, 0.0)
        for j in range(x2.shape[1]):
            y2[r, j] = (x2[r, j] - mt) * it * w[j] + b[j]


@numba.njit(**_PAR)
def ln_grad_input(dy2, x2, w, eps, dx2):
    """dx = inv * (g - mean(g) - x_hat * mean(g * x_hat)) per row, g = dy * w."""
    d_ = x2.shape[1]
    for r in numba.prange(x2.shape[0]):
        mean, var = _row_moments(x2, r)
        mt, it, _s, _b, _z = _consts(x2, mean, 1.0 / math.sqrt(var + eps), 1.0, 0.0)
        sg = 0.0
        sgx = 0.0
        for j in range(d_):
            g = np.float64(dy2[r, j] * w[j])
            sg += g
            sgx += g * np.float64((x2[r, j] - mt) * it)
        k_sum, k_hat, _s, _b, _z = _consts(x2, sg / d_, sgx / d_, 0.0, 0.0)
        for j in range(d_):
            xh = (x2[r, j] - mt) * it
            dx2[r, j] = it * (dy2[r, j] * w[j] - k_sum - xh * k_hat)


# layernorm's weight gradient: rows in blocks of this many, in parallel, each block's
# column sums in the data's dtype (SIMD lanes across the columns), the blocks' sums then
# added into the float64 result in order. The blocks are fixed by the shape, so the sums
# are the same on any number of threads. One row at a time in float64 is a scalar loop
# on one thread, a visible share of a small transformer's step.
_LN_ROWS = 32


@numba.njit(**_PAR)
def ln_grad_weight(dy2, x2, eps, acc):
    """acc[j] += sum over rows of dy * x_hat (acc float64)."""
    r_, d_ = x2.shape
    blocks = (r_ + _LN_ROWS - 1) // _LN_ROWS
    part = np.zeros((blocks, d_), x2.dtype)
    for bk in numba.prange(blocks):
        out = part[bk]
        for r in range(bk * _LN_ROWS, min(r_, (bk + 1) * _LN_ROWS)):
            mean, var = _row_moments(x2, r)
            mt, it, _s, _b, _z = _consts(x2, mean, 1.0 / math.sqrt(var + eps), 1.0, 0.0)
            xr, dr = x2[r], dy2[r]
            for j in range(d_):
                out[j] += dr[j] * ((xr[j] - mt) * it)
    for bk in range(blocks):
        for j in range(d_):
            acc[j] += np.float64(part[bk, j])


# -- softmax over rows ---------------------------------------------------------------------------
def softmax_rows(x2, y2):
    """y = exp(x - max) / sum per row of the (R, D) x2; the sum in float64. The exp is
    NumPy's (SIMD; Numba's math.exp is a scalar call per element, slower even in one
    loop with the rest: bench/refs/netdsl_step.py --profile). In float32 it is the fused
    kernels' own vectorised exp of non-positive numbers over the whole array
    (x - max <= 0), faster still with the maximum below (bench/bench_kernels.py)."""
    _shift_by_row_max(x2, y2)
    if y2.dtype == np.float32:
        exp_of_nonpositive_in_place(y2.reshape(-1))
    else:
        np.exp(y2, out=y2)
    _divide_by_row_sum(y2)


@numba.njit(inline="always")
def row_max(row, seen):
    """max of row[:seen] (1-d) in four interleaved chains of compares: rows of a few dozen
    leave one chain's latency most of the pass (the attention kernels' rows too)."""
    m0 = row[0]
    m1, m2, m3 = m0, m0, m0
    j = 1
    while j + 4 <= seen:
        v0, v1, v2, v3 = row[j], row[j + 1], row[j + 2], row[j + 3]
        m0 = v0 if v0 > m0 else m0
        m1 = v1 if v1 > m1 else m1
        m2 = v2 if v2 > m2 else m2
        m3 = v3 if v3 > m3 else m3
        j += 4
    while j < seen:
        v0 = row[j]
        m0 = v0 if v0 > m0 else m0
        j += 1
    m0 = m1 if m1 > m0 else m0
    m2 = m3 if m3 > m2 else m2
    return m2 if m2 > m0 else m0


@numba.njit(**_PAR)
def _shift_by_row_max(x2, y2):
    """y = x - max per row (row_max). A NaN after a row's first element is no chain's
    maximum, but x - max is NaN at it and the row's sum then makes the whole row NaN, as
    NumPy's max does (tests/test_fuse.py)."""
    d_ = x2.shape[1]
    for r in numba.prange(x2.shape[0]):
        m = row_max(x2[r], d_)
        for j in range(d_):
            y2[r, j] = x2[r, j] - m


@numba.njit(**_PAR)
def _divide_by_row_sum(y2):
    d_ = y2.shape[1]
    for r in numba.prange(y2.shape[0]):
        s = 0.0
        for j in range(d_):
            s += np.float64(y2[r, j])
        inv = _like(y2, 1.0 / s)
        for j in range(d_):
            y2[r, j] = y2[r, j] * inv


@numba.njit(**_PAR)
def softmax_grad_rows(dy2, y2, dx2):
    """dx = y * (dy - sum(dy * y)) per row; the sum in float64."""
    d_ = y2.shape[1]
    for r in numba.prange(y2.shape[0]):
        s = 0.0
        for j in range(d_):
            s += np.float64(dy2[r, j]) * np.float64(y2[r, j])
        st = _like(y2, s)
        for j in range(d_):
            dx2[r, j] = y2[r, j] * (dy2[r, j] - st)
