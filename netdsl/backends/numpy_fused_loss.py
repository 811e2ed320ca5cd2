"""Softmax cross-entropy over rows, forward and gradient, for the NumPy backend's fused
kernels (Numba, the `fast` extra): the plain case (no class weights, no smoothing, a mean
or a sum) in one pass over the scores instead of a dozen small NumPy calls, which cost
more than the arithmetic on a classifier's [batch, classes] scores
(bench/refs/netdsl_step.py --profile shows the pair's share of a small step). A row with
the ignored label, or a label out of range, is left to the caller (netdsl.ir.ops.loss),
which takes its general path or raises."""
from __future__ import annotations

import math

import numba

_JIT = {"cache": True, "nogil": True}

OK, IGNORED, OUT_OF_RANGE = 0, 1, 2  # what a kernel found in the labels


@numba.njit(**_JIT)
def _labels(t, k, ignore_index):
    for i in range(t.shape[0]):
        if t[i] == ignore_index:
            return IGNORED
        if t[i] < 0 or t[i] >= k:
            return OUT_OF_RANGE
    return OK


@numba.njit(inline="always")
def _row_max(z, i):
    mx = z[i, 0]
    for c in range(1, z.shape[1]):
        mx = max(mx, z[i, c])
    return mx


@numba.njit(**_JIT)
def sce_forward(z, t, ignore_index):
    """(sum over rows of logsumexp(z[i]) - z[i, t[i]], status): the (M, K) scores z and
    the M int64 labels t; each row's sum of exponentials and the total in float64."""
    status = _labels(t, z.shape[1], ignore_index)
    if status != OK:
        return 0.0, status
    total = 0.0
    for i in range(z.shape[0]):
        mx = _row_max(z, i)
        s = 0.0
        for c in range(z.shape[1]):
            s += math.exp(z[i, c] - mx)
        total += math.log(s) + mx - z[i, t[i]]
    return total, OK


@numba.njit(**_JIT)
def sce_grad(z, t, ignore_index, scale, out):
    """out = (softmax(z) - one_hot(t)) * scale, row by row (the sum in float64); the
    labels' status, out untouched unless OK."""
    status = _labels(t, z.shape[1], ignore_index)
    if status != OK:
        return status
    for i in range(z.shape[0]):
        mx = _row_max(z, i)
        s = 0.0
        for c in range(z.shape[1]):
            e = math.exp(z[i, c] - mx)
            out[i, c] = e
            s += e
        f = scale / s
        for c in range(z.shape[1]):
            out[i, c] *= f
        out[i, t[i]] -= scale
    return OK
