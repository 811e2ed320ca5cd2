"""Multi-head attention over packed q/k/v for the NumPy backend's fused kernels (Numba, the
`fast` extra): the attention_qkv ops' kernels (netdsl.ir.ops.attention_qkv), an (image,
head) pair a task.

qkv is one [N, T, 3D] array (a transformer's fused input projection: q, k, v side by side
on the last axis, each D = heads x hd wide). Head h of image i reads its q, k and v as
[T, hd] blocks of qkv with a leading dimension of 3D, so no head is ever copied out; the
forward writes its [T, hd] result straight into the merged [N, T, D] output (leading
dimension D), the backward its dq, dk, dv straight into the [N, T, 3D] gradient. The
probabilities are either kept ([N, heads, T, T], attention_probs_tasks, for the forward
and the backward to read) or, for long sequences, recomputed in a [T, T] buffer of the
thread, in cache (flash attention's choice: nothing [N, heads, T, T] kept or allocated);
dP always stays in such a buffer. Written out with slices, reshapes, permutes, a
transpose, two batched products, a scale and a softmax, the same attention is a pass over
memory per operator and copies of every head; one task a pair takes a markedly smaller
share of a transformer's step (docs/benchmarks.md).

The products are NumPy's own OpenBLAS, one thread per call (numpy_fused_gemm), so each
task's numbers are the same on any number of threads. The scale is the GEMM's alpha; the
softmax's exponential is the fused kernels' vectorised one in float32 (math.exp in
float64), its row sums in float64.
"""
from __future__ import annotations

import math

import numba
import numpy as np
from numba.extending import overload

from netdsl.backends.numpy_fused_activation import exp_of_nonpositive
from netdsl.backends.numpy_fused_activation import like as _like
from netdsl.backends.numpy_fused_gemm import _NO_TRANS, _TRANS, _cblas_gemm, _data_address
from netdsl.backends.numpy_fused_norm import row_max

_JIT = {"cache": True, "nogil": True, "error_model": "numpy"}
# the softmax's loops: reassociated sums and contractions, as the fused kernels' other
# vectorised loops (numpy_fused_activation._VEC); no "nnan"/"ninf"
_VEC = {**_JIT, "fastmath": {"nsz", "arcp", "contract", "afn", "reassoc"}}


def _exp(v):
    """e^v for v <= 0, in the array's precision."""


@overload(_exp, inline="always")
def _exp_impl(v):
    if v == numba.float32:
        return lambda v: exp_of_nonpositive(v)
    return lambda v: math.exp(v)


@numba.njit(**_VEC)
def _softmax_rows(s1, t, causal):
    """The [T, T] scores given flat (s1, C order) = softmax of each row, in place; with
    `causal`, row r over its first r + 1 entries and 0 after them (query r sees keys
    0..r). Each row a slice indexed from 0: with flat indices from r * T (which Numba
    checks for negative values) the loops did not vectorise."""
    for r in range(t):
        row = s1[r * t:(r + 1) * t]
        seen = r + 1 if causal else t
        m = row_max(row, seen)
        for j in range(seen):
            row[j] = _exp(row[j] - m)
        total = 0.0
        for j in range(seen):
            total += np.float64(row[j])
        inv = _like(s1, 1.0 / total)
        for j in range(seen):
            row[j] *= inv
        for j in range(seen, t):
            row[j] = _like(s1, 0.0)


@numba.njit(**_VEC)
def _softmax_grad_rows(p1, dp1, t):
    """dp = p * (dp - the row's sum of p * dp), in place, row by row of the flat [T, T]
    p1 and dp1 (softmax's gradient; the sums in float64)."""
    for r in range(t):
        pr, dr = p1[r * t:(r + 1) * t], dp1[r * t:(r + 1) * t]
        acc = 0.0
        for j in range(t):
            acc += np.float64(pr[j]) * np.float64(dr[j])
        st = _like(p1, acc)
        for j in range(t):
            dr[j] = pr[j] * (dr[j] - st)


@numba.njit(inline="always", **_JIT)
def _layout(qkv, heads):
    """(T, 3D, D, hd, item bytes, tasks) of qkv [N, T, 3D] in `heads` heads."""
    n, t, d3 = qkv.shape
    return t, d3, d3 // 3, d3 // 3 // heads, qkv.itemsize, n * heads


@numba.njit(inline="always", **_JIT)
def _scores(fn, scale, qkv, i, h, heads, causal, s):
    """s [T, T] (C-contiguous) = softmax(scale * q k^T) of image i, head h of qkv."""
    t, d3, _, hd, size, _ = _layout(qkv, heads)
    q = _data_address(qkv) + (i * t * d3 + h * hd) * size
    _cblas_gemm(fn, _NO_TRANS, _TRANS, t, t, hd, scale, q, d3, q + d3 // 3 * size, d3,
                scale - scale, _data_address(s), t)
    _softmax_rows(s.reshape(-1), t, causal)


@numba.njit(**_JIT, parallel=True)
def attention_probs_tasks(fn, scale, qkv, heads, causal, p, threads):
    """p [N, heads, T, T] = each head's softmax(scale * q k^T) of qkv [N, T, 3D] (both
    C-contiguous), an (image, head) task at a time, `threads` chunks of them."""
    tasks = qkv.shape[0] * heads
    threads = min(threads, tasks)
    for c in numba.prange(threads):
        for task in range(c * tasks // threads, (c + 1) * tasks // threads):
            i, h = task // heads, task % heads
            _scores(fn, scale, qkv, i, h, heads, causal, p[i, h])


@numba.njit(**_JIT, parallel=True)
def attention_tasks(fn, one, scale, qkv, heads, causal, p, y, threads):
    """y [N, T, D] = attention of qkv [N, T, 3D] (all C-contiguous): per (image, head)
    task, the probabilities (p's [T, T] block where p is given, [N, heads, T, T]; else
    recomputed into the thread's buffer: _scores), times v, into the head's columns of y.
    `threads` chunks of consecutive tasks."""
    t, d3, d, hd, size, tasks = _layout(qkv, heads)
    zero = one - one
    threads = min(threads, tasks)
    base, out = _data_address(qkv), _data_address(y)
    kept = p.size > 0
    for c in numba.prange(threads):
        s = np.empty((0 if kept else t, t), qkv.dtype)
        for task in range(c * tasks // threads, (c + 1) * tasks // threads):
            i, h = task // heads, task % heads
            if kept:
                sa = _data_address(p[i, h])
            else:
                _scores(fn, scale, qkv, i, h, heads, causal, s)
                sa = _data_address(s)
            v = base + (i * t * d3 + 2 * d + h * hd) * size
            _cblas_gemm(fn, _NO_TRANS, _NO_TRANS, t, hd, t, one, sa, t, v, d3, zero,
                        out + (i * t * d + h * hd) * size, d)


@numba.njit(**_JIT, parallel=True)
def attention_grad_tasks(fn, one, scale, gy, qkv, heads, causal, p, dqkv, threads):
    """dqkv [N, T, 3D] = the gradient of attention_tasks' y given gy [N, T, D] (all
    C-contiguous). Per (image, head) task, in [T, T] buffers of the thread: the
    probabilities (p's block if given, else recomputed: _scores); dp = gy_h v^T;
    dv = p^T gy_h; ds = p * (dp - the row sums of p * dp) (softmax's gradient; the sums in
    float64); dq = scale * ds k; dk = scale * ds^T q; each written into its columns of
    dqkv."""
    t, d3, d, hd, size, tasks = _layout(qkv, heads)
    zero = one - one
    threads = min(threads, tasks)
    base, gbase, dbase = _data_address(qkv), _data_address(gy), _data_address(dqkv)
    kept = p.size > 0
    for c in numba.prange(threads):
        s = np.empty((0 if kept else t, t), qkv.dtype)
        dp = np.empty((t, t), qkv.dtype)
        dpa = _data_address(dp)
        for task in range(c * tasks // threads, (c + 1) * tasks // threads):
            i, h = task // heads, task % heads
            if kept:
                pr = p[i, h]
            else:
                _scores(fn, scale, qkv, i, h, heads, causal, s)
                pr = s
            pa = _data_address(pr)
            off = (i * t * d3 + h * hd) * size
            q, k, v = base + off, base + off + d * size, base + off + 2 * d * size
            dq, dk, dv = dbase + off, dbase + off + d * size, dbase + off + 2 * d * size
            g = gbase + (i * t * d + h * hd) * size
            _cblas_gemm(fn, _NO_TRANS, _TRANS, t, t, hd, one, g, d, v, d3, zero, dpa, t)
            _cblas_gemm(fn, _TRANS, _NO_TRANS, t, hd, t, one, pa, t, g, d, zero, dv, d3)
            _softmax_grad_rows(pr.reshape(-1), dp.reshape(-1), t)
            _cblas_gemm(fn, _NO_TRANS, _NO_TRANS, t, hd, t, scale, dpa, t, k, d3, zero, dq,
                        d3)
            _cblas_gemm(fn, _TRANS, _NO_TRANS, t, hd, t, scale, dpa, t, q, d3, zero, dk, d3)
