"""Depthwise convolutions (every group one input channel: MobileNet's 3x3s) as direct loops
for the NumPy backend's fused kernels: forward, input gradient and weight gradient.

As grouped GEMMs, each group's product is [O/G, kh*kw] @ [kh*kw, Ho*Wo]: far too small
for a GEMM, behind an im2col copy kh*kw times the input. MobileNetV2's depthwise 3x3s ran
10-23x slower than PyTorch's that way (bench/bench_kernels.py --conv-only depthwise;
docs/benchmarks.md). Here a task takes one input plane x[n, c] at a time and copies it,
zero-padded, into scratch "phase planes": with stride (sh, sw), padded element (r, p)
goes to phase (r % sh, p % sw) at row r // sh, column p // sw of a plane T columns wide.
Every kernel tap then reads, for all the output rows at once, one contiguous run of Ho*T
elements of one phase plane, output (i, j) at i*T + j (the columns from Wo on are
computed and dropped): each tap is one long vectorised loop whatever the stride, a
multiply-add into an output run (forward), into the phase planes (input gradient) or a
dot product (weight gradient), in chunks that stay in the L1 cache across the taps.
Small planes are stacked: the images of a channel, `s` at a time (the largest divisor of
N whose stack still fits one chunk), lie R rows apart in the phase planes and are taken
as one run (the rows from Ho to R of each image computed and dropped), so a 7x7 plane's
taps are loops of 8 x 81 elements, not 63, and a task's overhead is paid once a stack.

Shapes: x [N, C, H, W], w [O, 1, kh, kw] with O = C*m (m output channels per input
channel, PyTorch's grouping: output channel oc reads input channel oc // m), dy
[N, O, Ho, Wo]; C-contiguous, one float dtype. The taps are summed in order a, b (row,
column); the weight gradient's dot products in the data's dtype over blocks of at most
_BLOCK elements, summed in float64 across blocks and images, the images in their order,
each channel by one task: the same numbers on any number of threads (the forward and
input gradient have one task per plane anyway).
"""
from __future__ import annotations

import numba
import numpy as np

_JIT = {"cache": True, "nogil": True, "fastmath": {"reassoc"}}


@numba.njit(cache=True)
def geometry(h, w, kh, kw, sh, sw, ph, pw, dh, dw):
    """(Ho, Wo, R, T): the output size and a phase plane's rows and columns."""
    hp, wp = h + 2 * ph, w + 2 * pw
    ho = (hp - dh * (kh - 1) - 1) // sh + 1
    wo = (wp - dw * (kw - 1) - 1) // sw + 1
    return ho, wo, -(-hp // sh), -(-wp // sw)


def stack(n, h, w, kh, kw, sh, sw, ph, pw, dh, dw) -> int:
    """Images a stack: the largest divisor of n whose stack of phase planes, R*T elements
    an image, fits one chunk (1 from 46x46 up; 8 of MobileNetV2's 14x14 and 7x7)."""
    _ho, _wo, r, t = geometry(h, w, kh, kw, sh, sw, ph, pw, dh, dw)
    return max(s for s in range(1, n + 1) if n % s == 0 and (s == 1 or s * r * t <= _CHUNK))


def scratch_elems(h, w, kh, kw, sh, sw, ph, pw, dh, dw, s=1) -> int:
    """Elements of one task's scratch for stacks of `s` images: its phase planes and one
    output-sized row run."""
    ho, _wo, r, t = geometry(h, w, kh, kw, sh, sw, ph, pw, dh, dw)
    return sh * sw * (s * r + 1) * t + _run_length(s, r, t, ho)


@numba.njit(cache=True)
def _run_length(s, r, t, ho):
    """A stack's run: its images R*T apart, the last one's Ho rows."""
    return ((s - 1) * r + ho) * t


@numba.njit(inline="always")
def _move_plane(plane, ph, pw, sh, sw, t, phases, base, load):
    """With `load`, plane [H, W] into phases [sh*sw, (s*R+1)*T] from element `base` of
    each phase on, zero-padded: padded element (r, p) at phases[(r % sh) * sw + p % sw,
    base + (r // sh) * T + p // sw] (the padding was zeroed once and is never written; the
    extra row is room for the last taps' runs). Else the inverse: plane = the phases'
    elements inside the padding."""
    h, w = plane.shape
    if sw == 1:  # whole rows as slices: 2.2x faster than element by element at 14x14
        for r in range(h):
            pr = r + ph
            start = base + (pr // sh) * t + pw
            if load:
                phases[pr % sh, start:start + w] = plane[r]
            else:
                plane[r] = phases[pr % sh, start:start + w]
        return
    for r in range(h):
        line = plane[r]
        pr = r + ph
        row = base + (pr // sh) * t
        for qc in range(sw):
            c0 = (qc - pw) % sw  # the first column of the plane in phase qc
            k = (w - c0 + sw - 1) // sw
            start = row + (c0 + pw) // sw
            run = phases[(pr % sh) * sw + qc, start:start + k]
            if load:
                for j in range(k):
                    run[j] = line[c0 + j * sw]
            else:
                for j in range(k):
                    line[c0 + j * sw] = run[j]


@numba.njit(inline="always")
def _sizes(x, w, sh, sw, ph, pw, dh, dw, s):
    """N, C, m (outputs a channel), kh, kw, Ho, Wo, R, T and the run's length for an input
    (or dx) x [N, C, H, W], weights w [O, 1, kh, kw] and stacks of s images."""
    n, c, h, wd = x.shape
    o, _one, kh, kw = w.shape
    ho, wo, r_, t = geometry(h, wd, kh, kw, sh, sw, ph, pw, dh, dw)
    return n, c, o // c, kh, kw, ho, wo, r_, t, _run_length(s, r_, t, ho)


@numba.njit(inline="always")
def _spread_rows(plane, t, run, base):
    """plane [Ho, Wo]'s rows into run from `base` on, T apart (run's other columns are left
    as they are)."""
    wo = plane.shape[1]
    for r in range(plane.shape[0]):
        dst = run[base + r * t:base + r * t + wo]
        dst[:] = plane[r]


@numba.njit(inline="always")
def _tap_run(phases, a, b, sh, sw, dh, dw, t, length):
    """What kernel tap (a, b) reads for all the output rows of a stack at once: `length`
    elements of one phase plane, output (i, j) of its image k at (k*R + i)*T + j (columns
    j >= Wo and rows i >= Ho: unused)."""
    ra, rb = a * dh, b * dw
    start = (ra // sh) * t + rb // sw
    return phases[(ra % sh) * sw + rb % sw, start:start + length]


def conv(x, w, geom, threads, budget, out=None):
    """y = conv2d(x, w) with groups = C for geom (kh, kw, sh, sw, ph, pw, dh, dw), into
    `out` if given (C-contiguous, the result's shape and dtype), on at most `threads`
    tasks whose scratch planes fit in `budget` elements; None where these loops do not
    take it (the caller's grouped GEMMs run)."""
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    n, c, h, wd = x.shape
    o = w.shape[0]
    ho, wo, _hp, _t = geometry(h, wd, *geom)
    s = stack(n, h, wd, *geom)
    tasks = _tasks(n // s * c, threads, budget, scratch_elems(h, wd, *geom, s))
    if not _takes(x, w, c, o, kh, kw, ho, wo, tasks):
        return None
    if out is None:
        out = np.empty((n, o, ho, wo), x.dtype)
    elif out.shape != (n, o, ho, wo) or out.dtype != x.dtype or not out.flags.c_contiguous:
        return None
    depthwise_forward(x, w, sh, sw, ph, pw, dh, dw, out, s, tasks)
    return out


def grad_input(dy, w, shape, geom, threads, budget, out=None):
    """dx [N, C, H, W] (`shape`) of conv(x, w, geom), into `out` if given; None as conv."""
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    n, c, h, wd = shape
    o = w.shape[0]
    ho, wo, _hp, _t = geometry(h, wd, *geom)
    s = stack(n, h, wd, *geom)
    tasks = _tasks(n // s * c, threads, budget, scratch_elems(h, wd, *geom, s))
    if dy.shape != (n, o, ho, wo) or not _takes(dy, w, c, o, kh, kw, ho, wo, tasks):
        return None
    if out is None:
        out = np.empty(shape, dy.dtype)
    elif out.shape != tuple(shape) or out.dtype != dy.dtype or not out.flags.c_contiguous:
        return None
    depthwise_grad_input(dy, w, sh, sw, ph, pw, dh, dw, out, s, tasks)
    return out


def grad_weight(dy, x, w_shape, geom, threads, budget):
    """The weight gradient (`w_shape`, [O, 1, kh, kw]) of conv(x, w, geom); None as conv."""
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    n, c, h, wd = x.shape
    o = w_shape[0]
    ho, wo, _hp, _t = geometry(h, wd, *geom)
    s = stack(n, h, wd, *geom)
    # each task's float64 sums too, counted as float32 elements
    tasks = _tasks(c, threads, budget, scratch_elems(h, wd, *geom, s) + 2 * o // c * kh * kw)
    if dy.shape != (n, o, ho, wo) or tuple(w_shape) != (o, 1, kh, kw) \
            or not _takes(dy, x, c, o, kh, kw, ho, wo, tasks):
        return None
    gw = np.empty(tuple(w_shape), x.dtype)
    depthwise_grad_weight(dy, x, sh, sw, ph, pw, dh, dw, gw, s, tasks)
    return gw


def _tasks(units, threads, budget, per_task) -> int:
    """Tasks of consecutive units (stacks or channels): one a thread, as many as the
    scratch `budget` (elements) holds."""
    return min(threads, units, budget // per_task)


def _takes(a, b, c, o, kh, kw, ho, wo, tasks) -> bool:
    return a.dtype == b.dtype and o % c == 0 and min(kh, kw, ho, wo, tasks) >= 1 \
        and a.flags.c_contiguous and b.flags.c_contiguous


# elements of a run taken at a time: 8 kB of float32, so that the accumulated chunk stays
# in the L1 cache across the taps (whole runs of a 112x112 plane, 51 kB, went to L2 at
# every tap)
_CHUNK = 2048


@numba.njit(inline="always")
def _madd(dst, v, src, first):
    """dst = v * src, or dst += v * src."""
    if first:
        for f in range(dst.size):
            dst[f] = v * src[f]
    else:
        for f in range(dst.size):
            dst[f] += v * src[f]


@numba.njit(inline="always")
def _madd3(dst, v0, s0, v1, s1, v2, s2, first):
    """dst = v0 * s0 + v1 * s1 + v2 * s2, or that added to dst (in that order)."""
    if first:
        for f in range(dst.size):
            dst[f] = v0 * s0[f] + v1 * s1[f] + v2 * s2[f]
    else:
        for f in range(dst.size):
            dst[f] += v0 * s0[f] + v1 * s1[f] + v2 * s2[f]


@numba.njit(**_JIT, parallel=True)
def depthwise_forward(x, w, sh, sw, ph, pw, dh, dw, y, s, tasks):
    """y = conv2d(x, w) with groups = C: `tasks` tasks of consecutive stacks (channel c,
    images k*s to k*s + s); each output channel's stack is its kh*kw taps added in order
    into one run, whose first Wo columns of the first Ho rows of each image are y's."""
    n, c, m, kh, kw, ho, wo, r_, t, length = _sizes(x, w, sh, sw, ph, pw, dh, dw, s)
    units = n // s * c
    for task in numba.prange(tasks):
        phases = np.zeros((sh * sw, (s * r_ + 1) * t), x.dtype)
        acc = np.empty(length, x.dtype)
        for q in range(task * units // tasks, (task + 1) * units // tasks):
            i0, ch = q // c * s, q % c
            for k in range(s):
                _move_plane(x[i0 + k, ch], ph, pw, sh, sw, t, phases, k * r_ * t, True)
            for u in range(m):
                oc = ch * m + u
                # in chunks that stay in the L1 cache across the taps, a kernel row's
                # taps in one pass where it has three
                for f0 in range(0, length, _CHUNK):
                    dst = acc[f0:f0 + _CHUNK]
                    f1 = f0 + dst.size
                    for a in range(kh):
                        if kw == 3:
                            _madd3(dst, w[oc, 0, a, 0],
                                   _tap_run(phases, a, 0, sh, sw, dh, dw, t, length)[f0:f1],
                                   w[oc, 0, a, 1],
                                   _tap_run(phases, a, 1, sh, sw, dh, dw, t, length)[f0:f1],
                                   w[oc, 0, a, 2],
                                   _tap_run(phases, a, 2, sh, sw, dh, dw, t, length)[f0:f1],
                                   a == 0)
                            continue
                        for b in range(kw):
                            _madd(dst, w[oc, 0, a, b],
                                  _tap_run(phases, a, b, sh, sw, dh, dw, t, length)[f0:f1],
                                  a == 0 and b == 0)
                for k in range(s):
                    for r in range(ho):
                        dst = y[i0 + k, oc, r]
                        dst[:] = acc[(k * r_ + r) * t:(k * r_ + r) * t + wo]


@numba.njit(**_JIT, parallel=True)
def depthwise_grad_input(dy, w, sh, sw, ph, pw, dh, dw, dx, s, tasks):
    """dx of depthwise_forward: each stack's phases gather w * dy from its m output
    channels at every tap (the forward's reads, as adds; dy's rows laid out T apart,
    images R*T apart, with zeros in the columns from Wo and rows from Ho, which so add
    nothing), then their inside is dx's planes."""
    n, c, m, kh, kw, _ho, _wo, r_, t, length = _sizes(dx, w, sh, sw, ph, pw, dh, dw, s)
    units = n // s * c
    for task in numba.prange(tasks):
        phases = np.empty((sh * sw, (s * r_ + 1) * t), dx.dtype)
        g = np.zeros(length, dx.dtype)  # its unused columns and rows stay 0
        for q in range(task * units // tasks, (task + 1) * units // tasks):
            i0, ch = q // c * s, q % c
            phases[:] = 0
            for u in range(m):
                oc = ch * m + u
                for k in range(s):
                    _spread_rows(dy[i0 + k, oc], t, g, k * r_ * t)
                for f0 in range(0, length, _CHUNK):  # g's chunk in L1 across the taps
                    src = g[f0:f0 + _CHUNK]
                    f1 = f0 + src.size
                    for a in range(kh):
                        for b in range(kw):
                            run = _tap_run(phases, a, b, sh, sw, dh, dw, t, length)[f0:f1]
                            _madd(run, w[oc, 0, a, b], src, False)
            for k in range(s):
                _move_plane(dx[i0 + k, ch], ph, pw, sh, sw, t, phases, k * r_ * t, False)


# the weight gradient's dot products are summed in the data's dtype over blocks of this
# many elements, in float64 across blocks, images and output channels' taps
_BLOCK = 1024


@numba.njit(inline="always")
def _dot(u, v):
    s = u[0] * v[0]
    for f in range(1, u.size):
        s += u[f] * v[f]
    return s


@numba.njit(inline="always")
def _dot3(u, v0, v1, v2):
    """u . v0, u . v1, u . v2 in one pass over u."""
    s0, s1, s2 = u[0] * v0[0], u[0] * v1[0], u[0] * v2[0]
    for f in range(1, u.size):
        s0 += u[f] * v0[f]
        s1 += u[f] * v1[f]
        s2 += u[f] * v2[f]
    return s0, s1, s2


@numba.njit(**_JIT, parallel=True)
def depthwise_grad_weight(dy, x, sh, sw, ph, pw, dh, dw, gw, s, tasks):
    """gw [O, 1, kh, kw] of depthwise_forward: a task per run of input channels, the
    stacks of images in order; each tap's sum is the dot product of dy (rows T apart,
    images R*T apart, zeros in the unused columns and rows) with the run of the phase
    plane that the tap read in the forward."""
    n, c, m, kh, kw, _ho, _wo, r_, t, length = _sizes(x, gw, sh, sw, ph, pw, dh, dw, s)
    for task in numba.prange(tasks):
        phases = np.zeros((sh * sw, (s * r_ + 1) * t), x.dtype)
        g = np.zeros(length, x.dtype)  # its unused columns and rows stay 0
        acc = np.zeros((m, kh, kw))
        for ch in range(task * c // tasks, (task + 1) * c // tasks):
            acc[:] = 0.0
            for i0 in range(0, n, s):
                for k in range(s):
                    _move_plane(x[i0 + k, ch], ph, pw, sh, sw, t, phases, k * r_ * t, True)
                for u in range(m):
                    for k in range(s):
                        _spread_rows(dy[i0 + k, ch * m + u], t, g, k * r_ * t)
                    for f0 in range(0, length, _BLOCK):
                        gb = g[f0:f0 + _BLOCK]
                        f1 = f0 + gb.size
                        for a in range(kh):
                            if kw == 3:  # a kernel row's three sums in one pass
                                s0, s1, s2 = _dot3(
                                    gb, _tap_run(phases, a, 0, sh, sw, dh, dw, t, length)[f0:f1],
                                    _tap_run(phases, a, 1, sh, sw, dh, dw, t, length)[f0:f1],
                                    _tap_run(phases, a, 2, sh, sw, dh, dw, t, length)[f0:f1])
                                acc[u, a, 0] += np.float64(s0)
                                acc[u, a, 1] += np.float64(s1)
                                acc[u, a, 2] += np.float64(s2)
                                continue
                            for b in range(kw):
                                run = _tap_run(phases, a, b, sh, sw, dh, dw, t, length)
                                acc[u, a, b] += np.float64(_dot(gb, run[f0:f1]))
            for u in range(m):
                for a in range(kh):
                    for b in range(kw):
                        gw[ch * m + u, 0, a, b] = acc[u, a, b]
