"""Fused CPU kernels for the NumPy backend, compiled by Numba (the optional `fast` extra).

NumPy runs one pass over memory per ufunc, so batchnorm + relu forward and backward make
18 or more passes over tensors of the activation's size. These loops go channel by
channel over a (N, C, P) view of NCHW data (P = the spatial size): one channel's slice
(N chunks of P contiguous elements) stays in the cache between the passes over it, so a
kernel reads each input from memory about once and writes its output once.

Numerics (the same definitions as the NumPy reference kernels in netdsl.ir.ops.norm and
norm_fused, which the tests compare these against):
- the batch mean and biased variance are accumulated in float64 whatever the data's
  dtype, in one pass over data shifted by the channel's first element (so the variance
  does not cancel: the shift is a sample, within a few standard deviations of the mean);
- the affine step is z = (x - mean) * (inv * w) + b with mean, inv = 1/sqrt(var + eps),
  w and b first rounded to the data's dtype, computed in the data's dtype - the forward and
  both backward kernels compute z identically, so the relu mask the backward recomputes
  is the forward's exactly;
- the backward's per-channel sums are accumulated in float64.

Compiled with `cache=True`: the machine code is kept in `__pycache__` next to this file,
so only the first process after an install pays the compile. `reassoc` lets the
reductions use SIMD lanes (a different summation order, not a less exact one).
Numba and this module are imported lazily by `NumpyBackend.fused`, nowhere else.
"""
from __future__ import annotations

import math
import os

import numba
import numpy as np

from netdsl.backends import numpy_winograd

_JIT = {"cache": True, "nogil": True, "fastmath": {"reassoc"}}
_PAR = {**_JIT, "parallel": True}  # channels in parallel: each is independent of the others


@numba.njit(**_JIT)
def _channel_moments(x3, c):
    """float64 mean and biased variance of x3[:, c, :] (one pass, shifted data)."""
    n, _, p = x3.shape
    k = np.float64(x3[0, c, 0])
    s1 = 0.0
    s2 = 0.0
    for i in range(n):
        for j in range(p):
            d = np.float64(x3[i, c, j]) - k
            s1 += d
            s2 += d * d
    m = n * p
    mu = s1 / m
    return k + mu, max(s2 / m - mu * mu, 0.0)


@numba.njit(**_JIT)
def _consts(x3, mean, inv, w, b):
    """mean, inv, scale = inv * w, shift = b and 0 in the data's dtype (a setitem casts;
    arithmetic with a float64 would promote the whole loop to float64)."""
    t = np.empty(5, x3.dtype)
    t[0] = mean
    t[1] = inv
    t[2] = w
    t[3] = b
    t[4] = 0
    return t[0], t[1], t[1] * t[2], t[3], t[4]


@numba.njit(**_PAR)
def bn_forward(x3, w, b, eps, relu, y3, moments):
    """Training-mode batchnorm (+ relu) of x3 (N, C, P) into y3; moments[0] and [1] get
    each channel's mean and biased variance (float64) for the running statistics."""
    n, nc, p = x3.shape
    for c in numba.prange(nc):
        mean, var = _channel_moments(x3, c)
        moments[0, c] = mean
        moments[1, c] = var
        mt, _it, scale, shift, zero = _consts(x3, mean, 1.0 / math.sqrt(var + eps),
                                              w[c], b[c])
        for i in range(n):
            for j in range(p):
                z = (x3[i, c, j] - mt) * scale + shift
                if relu and not z > zero:  # NaN stays NaN; z > 0 is the backward's mask
                    z = zero if z == z else z
                y3[i, c, j] = z


@numba.njit(**_PAR)
def bn_grad_stats(dy3, x3, w, b, eps, relu, out):
    """Batchnorm's backward statistics into out (4, C): sum(g * x_hat), sum(g), the batch
    mean and 1/std, where g is dy (times the relu mask z > 0 with `relu`)."""
    n, nc, p = x3.shape
    for c in numba.prange(nc):
        mean, var = _channel_moments(x3, c)
        mt, it, scale, shift, zero = _consts(x3, mean, 1.0 / math.sqrt(var + eps),
                                             w[c], b[c])
        sg = 0.0
        sgd = 0.0
        for i in range(n):
            for j in range(p):
                d = x3[i, c, j] - mt
                g = dy3[i, c, j]
                if relu and not d * scale + shift > zero:
                    g = zero
                sg += np.float64(g)
                sgd += np.float64(g) * np.float64(d)
        out[0, c] = sgd * np.float64(it)
        out[1, c] = sg
        out[2, c] = mt
        out[3, c] = it


@numba.njit(**_PAR)
def bn_grad_input(dy3, x3, st, w, b, relu, acc3, accumulate, dx3):
    """dx of batchnorm (+ relu) from bn_grad_stats' rows into dx3:
    w * inv * (g - sum(g) / M - (x - mean) * inv * sum(g * x_hat) / M), plus acc3 with
    `accumulate` (acc3 may be dx3 itself otherwise: it is not read then)."""
    n, nc, p = x3.shape
    m = n * p
    for c in numba.prange(nc):
        gw, sg = np.float64(st[0, c]), np.float64(st[1, c])
        mt, it, scale, shift, zero = _consts(x3, st[2, c], st[3, c], w[c], b[c])
        k_dev, k_sum, _s, _b, _z = _consts(x3, -np.float64(it) * gw / m, -sg / m, 0.0, 0.0)
        for i in range(n):
            for j in range(p):
                d = x3[i, c, j] - mt
                g = dy3[i, c, j]
                if relu and not d * scale + shift > zero:
                    g = zero
                v = (d * k_dev + k_sum + g) * scale
                if accumulate:
                    v += acc3[i, c, j]
                dx3[i, c, j] = v


# -- layernorm over rows -----------------------------------------------------------------------
# x2 is (R, D): R rows each normalised over its D elements. The statistics are accumulated
# in float64 over data shifted by the row's first element (as batchnorm's, above), rows in
# parallel; w and b are (D,) (ones and zeros without affine).
@numba.njit(inline="always")
def _row_moments(x2, r):
    d_ = x2.shape[1]
    k = np.float64(x2[r, 0])
    s1 = 0.0
    s2 = 0.0
    for j in range(d_):
        d = np.float64(x2[r, j]) - k
        s1 += d
        s2 += d * d
    mu = s1 / d_
    return k + mu, max(s2 / d_ - mu * mu, 0.0)


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


@numba.njit(**_JIT)
def ln_grad_weight(dy2, x2, eps, acc):
    """acc[j] += sum over rows of dy * x_hat (acc float64)."""
    for r in range(x2.shape[0]):
        mean, var = _row_moments(x2, r)
        mt, it, _s, _b, _z = _consts(x2, mean, 1.0 / math.sqrt(var + eps), 1.0, 0.0)
        for j in range(x2.shape[1]):
            acc[j] += np.float64(dy2[r, j] * ((x2[r, j] - mt) * it))


# -- softmax over rows ---------------------------------------------------------------------------
@numba.njit(**_PAR)
def softmax_rows(x2, y2):
    """y = exp(x - max) / sum per row of the (R, D) x2; the sum in float64."""
    d_ = x2.shape[1]
    for r in numba.prange(x2.shape[0]):
        m = x2[r, 0]
        for j in range(1, d_):
            m = max(m, x2[r, j])
        s = 0.0
        for j in range(d_):
            e = math.exp(x2[r, j] - m)
            y2[r, j] = e
            s += np.float64(e)
        inv = _consts(x2, 1.0 / s, 0.0, 0.0, 0.0)[0]
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
        st = _consts(y2, s, 0.0, 0.0, 0.0)[0]
        for j in range(d_):
            dx2[r, j] = y2[r, j] * (dy2[r, j] - st)


# -- 2-d max pooling's backward ------------------------------------------------------------------
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


# -- SGD update -------------------------------------------------------------------------------
# One pass over the parameter, its gradient and its momentum buffer (NumPy takes five, two
# of them allocating). No fastmath: the same float operations in the same order as the
# NumPy reference kernel (netdsl.ir.ops.optim), so the result is bit for bit the same.
_EXACT = {"cache": True, "nogil": True, "error_model": "numpy"}


@numba.njit(**_EXACT)
def sgd_update(p, g, buf, lr, momentum, weight_decay, nesterov):
    """In place on 1-d p (and buf with momentum): torch.optim.SGD's step. The scalars are
    in p's dtype."""
    for i in range(p.size):
        gi = g[i]
        if weight_decay != 0:
            gi = gi + weight_decay * p[i]
        if momentum != 0:
            b = buf[i] * momentum + gi
            buf[i] = b
            gi = gi + momentum * b if nesterov else b
        p[i] = p[i] - lr * gi


@numba.njit(**_EXACT)
def adam_update(p, g, m, v, decay, wd, b1, c1, b2, c2, step_size, bc2_sqrt, eps):
    """In place on 1-d p, m and v: the Adam / AdamW step of the NumPy kernel, element by
    element in the same order (decay is 1 - lr * wd for AdamW, else 1 and wd the L2
    weight decay). The scalars are in p's dtype."""
    for i in range(p.size):
        pi = p[i] * decay
        gi = g[i]
        if wd != 0:
            gi = gi + wd * pi
        mi = m[i] * b1 + c1 * gi
        vi = v[i] * b2 + c2 * (gi * gi)
        m[i] = mi
        v[i] = vi
        p[i] = pi - step_size * (mi / (math.sqrt(vi) / bc2_sqrt + eps))


# -- GELU in float32 --------------------------------------------------------------------------
# erf(z) on [-4, 4] as the rational function z * P(z^2) / Q(z^2) that Eigen and XLA use for
# float32 (outside it erf is +-1 in float32), with no exp and no branch, so LLVM vectorises
# the loop: 0.13 ms for 262,144 elements against 2.9 ms for SciPy's erf (docs/benchmarks.md).
# Within 1e-6 of the exact GELU over [-6, 6] (1.8e-7 relative to |x|; PyTorch's float32
# kernel is within 1.1e-6). The backward's density term takes exp (scalar, 0.8 ms): the
# rational function's own derivative is 2e-6 off near the ends. float64 keeps SciPy's erf.
# error_model="numpy": a division may not raise, which is what lets the loops vectorise;
# no "nnan"/"ninf", so NaN and inf behave as in the reference.
_VEC = {"cache": True, "nogil": True, "error_model": "numpy",
        "fastmath": {"nsz", "arcp", "contract", "afn", "reassoc"}}
_ERF_P = tuple(np.float32(v) for v in (
    -2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
    -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
    -1.60960333262415e-02))  # z^13 ... z^1
_ERF_Q = tuple(np.float32(v) for v in (
    -1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
    -7.37332916720468e-03, -1.42647390514189e-02))  # z^8 ... z^0
_P13, _P11, _P9, _P7, _P5, _P3, _P1 = _ERF_P
_Q8, _Q6, _Q4, _Q2, _Q0 = _ERF_Q
_F32 = np.float32


@numba.njit(inline="always", **_VEC)
def _half_erf_plus_half(v):
    """Phi(v) = (1 + erf(v / sqrt 2)) / 2 in float32, kept in [0, 1] (the rational erf
    overshoots +-1 by about 1e-7 near the ends, which would give gelu(x) the wrong sign)."""
    z = min(max(v * _F32(0.7071067811865476), _F32(-4.0)), _F32(4.0))
    z2 = z * z
    p = ((((((_P13 * z2 + _P11) * z2 + _P9) * z2 + _P7) * z2 + _P5) * z2 + _P3) * z2
         + _P1) * z
    q = (((_Q8 * z2 + _Q6) * z2 + _Q4) * z2 + _Q2) * z2 + _Q0
    return min(max(_F32(0.5) + _F32(0.5) * (p / q), _F32(0.0)), _F32(1.0))


@numba.njit(**_VEC)
def gelu_f32(x, y):
    """y = x * Phi(x) over 1-d float32 arrays."""
    for i in range(x.size):
        v = x[i]
        y[i] = v * _half_erf_plus_half(v)


@numba.njit(**_VEC)
def gelu_grad_f32(dy, x, dx):
    """dx = dy * (Phi(x) + x * phi(x)) over 1-d float32 arrays."""
    for i in range(x.size):
        v = x[i]
        pdf = math.exp(_F32(-0.5) * v * v) * _F32(0.3989422804014327)
        dx[i] = dy[i] * (_half_erf_plus_half(v) + v * pdf)


def thread_count() -> int:
    """The threads the loops run on: as the BLAS is told (OMP_NUM_THREADS or
    OPENBLAS_NUM_THREADS, what `--threads` sets in the benchmarks), else Numba's default
    (NUMBA_NUM_THREADS, or the cores), never more than Numba's pool."""
    pool = numba.config.NUMBA_NUM_THREADS
    for key in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        v = os.environ.get(key, "").strip()
        if v.isdigit() and int(v) > 0:
            return min(int(v), pool)
    return pool


class FusedKernels:
    """What kernels see as `ctx.backend.fused`: the compiled loops above, for float32 and
    float64 C-contiguous arrays (callers fall back to the NumPy reference otherwise)."""

    bn_forward = staticmethod(bn_forward)
    bn_grad_stats = staticmethod(bn_grad_stats)
    bn_grad_input = staticmethod(bn_grad_input)
    winograd = numpy_winograd  # F(2x2, 3x3) tile transforms (netdsl.ir.ops.conv_winograd)
    ln_forward = staticmethod(ln_forward)
    sgd_update = staticmethod(sgd_update)
    adam_update = staticmethod(adam_update)
    maxpool2d_grad = staticmethod(maxpool2d_grad)
    softmax_rows = staticmethod(softmax_rows)
    softmax_grad_rows = staticmethod(softmax_grad_rows)
    ln_grad_input = staticmethod(ln_grad_input)
    ln_grad_weight = staticmethod(ln_grad_weight)

    def __init__(self):
        self.threads = thread_count()
        numba.set_num_threads(self.threads)
        # each compiled signature is loaded from the cache (or compiled) on its first call:
        # make those calls now, on tiny arrays, so none happens inside a measured step
        for dt in (np.float32, np.float64):
            x = np.ones((1, 1, 2), dt)
            w, st, y = np.ones(1, dt), np.ones((4, 1), dt), np.empty_like(x)
            bn_forward(x, w, w, 1e-5, True, y, np.empty((2, 1)))
            bn_grad_stats(x, x, w, w, 1e-5, True, st)
            bn_grad_input(x, x, st, w, w, True, x, True, y)
            r2, d1 = np.ones((1, 2), dt), np.ones(2, dt)
            sgd_update(d1, d1, d1.copy(), dt(0), dt(0), dt(0), False)
            adam_update(d1, d1, d1.copy(), d1.copy(), *(dt(1),) * 9)
            q = np.ones((1, 1, 2, 2), dt)
            maxpool2d_grad(q, q, 1, 1, 1, 1, 0, 0, q.copy())
            ln_forward(r2, d1, d1, 1e-5, r2.copy())
            ln_grad_input(r2, r2, d1, 1e-5, r2.copy())
            ln_grad_weight(r2, r2, 1e-5, np.zeros(2))
            softmax_rows(r2, r2.copy())
            softmax_grad_rows(r2, r2, r2.copy())
            t = np.ones((1, 1, 2, 2), dt)
            # the tile matrices are strided views (conv_winograd._tile_matrices): a
            # different Numba type from a C-contiguous array, so warmed up as one
            tiles = np.empty((16, 2), dt)[:, :1].reshape(16, 1, 1)
            numpy_winograd.input_tiles(t, 1, 1, 0, 1, 1, 1, tiles)
            numpy_winograd.output_tiles(tiles, 0, 1, 1, 1, t)
            numpy_winograd.output_tiles_adjoint(t, 0, 1, 1, 1, tiles)
        v = np.ones(2, np.float32)
        gelu_f32(v, v.copy())
        gelu_grad_f32(v, v, v.copy())

    @staticmethod
    def gelu(x):
        """x * Phi(x) for float32 x (None for other dtypes: they take the exact erf)."""
        if x.dtype != np.float32:
            return None
        y = np.empty_like(x)
        gelu_f32(x.reshape(-1), y.reshape(-1))
        return y

    @staticmethod
    def gelu_grad(dy, x):
        """GELU's dx for float32 (None for other dtypes)."""
        if x.dtype != np.float32 or dy.dtype != np.float32:
            return None
        dx = np.empty_like(x)
        gelu_grad_f32(dy.reshape(-1), x.reshape(-1), dx.reshape(-1))
        return dx

    @staticmethod
    def accepts(*arrays) -> bool:
        return all(isinstance(a, np.ndarray) and a.dtype in (np.float32, np.float64)
                   and a.flags.c_contiguous and a.size > 0 for a in arrays)

    def __repr__(self) -> str:
        return f"FusedKernels(numba {numba.__version__}, {self.threads} threads)"
