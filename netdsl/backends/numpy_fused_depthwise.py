"""Depthwise convolutions (every group one input channel: MobileNet's 3x3s) as direct loops
for the NumPy backend's fused kernels: forward, input gradient and weight gradient.

As grouped GEMMs, each group's product is [O/G, kh*kw] @ [kh*kw, Ho*Wo]: far too small
for a GEMM, behind an im2col copy kh*kw times the input: MobileNetV2's depthwise 3x3s run
an order of magnitude slower than PyTorch's that way (bench/bench_kernels.py --conv-only
depthwise). Here a task takes one input plane x[n, c] at a time and copies it,
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

Stride 1 with at most "same" column padding (MobileNet's stride-1 3x3s) keeps the rows
unpadded (T = W), so that a plane moves in and out as one copy, not a copy a row: a tap
reaching past a row's end then wraps into the next row (or the previous one), so each
kernel column b reads its own copy of the planes in which the columns it can reach only
by wrapping are zeros (kw planes instead of the one phase). At 14x14 and 7x7 the
row-by-row copies took more time than the taps.

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
def unpadded_rows(kw, sh, sw, pw, dw):
    """Whether the planes keep W columns (the column copies) rather than phases: stride
    1 both ways (the rows are not split into phases either) and a column padding that
    wraps no tap past its neighbouring row (Wo <= W)."""
    return sh == 1 and sw == 1 and 2 * pw <= dw * (kw - 1)


@numba.njit(cache=True)
def geometry(h, w, kh, kw, sh, sw, ph, pw, dh, dw):
    """(Ho, Wo, R, T, planes): the output size, a scratch plane's rows and columns an
    image, and the scratch planes (phases, or kw column copies for unpadded rows)."""
    hp, wp = h + 2 * ph, w + 2 * pw
    ho = (hp - dh * (kh - 1) - 1) // sh + 1
    wo = (wp - dw * (kw - 1) - 1) // sw + 1
    if unpadded_rows(kw, sh, sw, pw, dw):
        return ho, wo, -(-hp // sh), w, kw
    return ho, wo, -(-hp // sh), -(-wp // sw), sh * sw


def stack(n, h, w, kh, kw, sh, sw, ph, pw, dh, dw) -> int:
    """Images a stack: the largest divisor of n whose stack of planes, R*T elements an
    image, fits one chunk (1 from 46x46 up; 8 of MobileNetV2's 14x14 and 7x7)."""
    _ho, _wo, r, t, _planes = geometry(h, w, kh, kw, sh, sw, ph, pw, dh, dw)
    return max(s for s in range(1, n + 1) if n % s == 0 and (s == 1 or s * r * t <= _CHUNK))


def scratch_elems(h, w, kh, kw, sh, sw, ph, pw, dh, dw, s=1) -> int:
    """Elements of one task's scratch for stacks of `s` images: its planes and one
    output-sized run."""
    ho, _wo, r, t, planes = geometry(h, w, kh, kw, sh, sw, ph, pw, dh, dw)
    return planes * _plane_size(s, r, t, pw) + _run_length(s, r, t, ho)


@numba.njit(cache=True)
def _plane_size(s, r, t, pw):
    """A scratch plane's elements: a stack's images R*T apart, then room for the last
    taps' runs (a row; unpadded rows are stored pw on, and read up to 2*pw past)."""
    return (s * r + 1) * t + 2 * pw


@numba.njit(cache=True)
def _run_length(s, r, t, ho):
    """A stack's run: its images R*T apart, the last one's Ho rows."""
    return ((s - 1) * r + ho) * t


@numba.njit(inline="always")
def _move_plane(plane, ph, pw, sh, sw, t, phases, base, load):
    """With `load`, plane [H, W] into the phase planes from element `base` of each on,
    zero-padded: padded element (r, p) at phases[(r % sh) * sw + p % sw, base + (r // sh)
    * T + p // sw] (the padding was zeroed once and is never written); else the inverse,
    plane = the phases' elements inside the padding."""
    h, w = plane.shape
    if sw == 1:  # whole rows as slices: faster than element by element
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
def _load_stack(x, i0, ch, s, ph, pw, sh, sw, dw, t, r_, planes, flat):
    """Planes x[i0 + k, ch] for k < s into the scratch planes, image k from element k*R*T
    of each on, zero-padded. Phases: as _move_plane. Unpadded rows (T = W): element (r, p)
    at planes[b, k*R*T + (r + ph) * W + p + pw] in every column copy b, whose columns that
    tap b reaches only by wrapping are zeros: the images copied into column copy 0, the
    stack's run copied whole into the others, then each copy's wrapped columns zeroed
    (s + kw - 1 copies rather than s*kw: at 7x7 the copies, not the taps, took the
    time). The padding rows are zeroed once and never written."""
    if not flat:
        for k in range(s):
            _move_plane(x[i0 + k, ch], ph, pw, sh, sw, t, planes, k * r_ * t, True)
        return
    h, w = x.shape[2], x.shape[3]
    start = ph * t + pw
    for k in range(s):
        run = planes[0, k * r_ * t + start:k * r_ * t + start + h * w]
        run[:] = x[i0 + k, ch].reshape(h * w)
    used = (s - 1) * r_ * t + start + h * w
    for b in range(1, planes.shape[0]):
        run = planes[b, :used]
        run[:] = planes[0, :used]
    for b in range(planes.shape[0]):
        for k in range(s):
            _zero_wrapped(planes[b], k * r_ * t + start, h, w, b * dw - pw)


@numba.njit(inline="always")
def _store_plane(plane, ph, pw, sh, sw, dw, t, planes, base, flat):
    """plane = what the scratch planes hold of it from element `base` on (_load_stack's
    layout): for unpadded rows the sum of the column copies' columns that are not
    wrapped."""
    if not flat:
        _move_plane(plane, ph, pw, sh, sw, t, planes, base, False)
        return
    h, w = plane.shape
    whole = plane.reshape(h * w)
    start = base + ph * t + pw
    for b in range(planes.shape[0]):
        _zero_wrapped(planes[b], start, h, w, b * dw - pw)
        run = planes[b, start:start + h * w]
        if b == 0:
            whole[:] = run
        else:
            for f in range(h * w):
                whole[f] += run[f]


@numba.njit(inline="always")
def _zero_wrapped(run, base, h, w, off):
    """Zeros in the columns of an [h, w] plane (laid out in `run` from `base` on) that a
    tap reading column j + off for output column j reaches only by wrapping to a
    neighbouring row."""
    lo, hi = (max(0, w + off), w) if off < 0 else (0, min(off, w))
    for r in range(h):
        for j in range(lo, hi):
            run[base + r * w + j] = 0


@numba.njit(inline="always")
def _sizes(x, w, sh, sw, ph, pw, dh, dw, s):
    """N, C, m (outputs a channel), kh, kw, Ho, Wo, R, T, the scratch planes and their
    size, whether the rows are unpadded and a stack's run length for an input (or dx) x [N, C,
    H, W], weights w [O, 1, kh, kw] and stacks of s images."""
    n, c, h, wd = x.shape
    o, _one, kh, kw = w.shape
    ho, wo, r_, t, planes = geometry(h, wd, kh, kw, sh, sw, ph, pw, dh, dw)
    return (n, c, o // c, kh, kw, ho, wo, r_, t, planes, _plane_size(s, r_, t, pw),
            unpadded_rows(kw, sh, sw, pw, dw), _run_length(s, r_, t, ho))


@numba.njit(inline="always")
def _spread_rows(plane, t, run, base):
    """plane [Ho, Wo]'s rows into run from `base` on, T apart (run's other columns are left
    as they are)."""
    ho, wo = plane.shape
    if wo == t:
        dst = run[base:base + ho * wo]
        dst[:] = plane.reshape(ho * wo)
        return
    for r in range(ho):
        dst = run[base + r * t:base + r * t + wo]
        dst[:] = plane[r]


@numba.njit(inline="always")
def _gather_rows(run, base, t, plane):
    """plane [Ho, Wo] = run's rows from `base` on, T apart (_spread_rows' inverse)."""
    ho, wo = plane.shape
    if wo == t:
        dst = plane.reshape(ho * wo)
        dst[:] = run[base:base + ho * wo]
        return
    for r in range(ho):
        dst = plane[r]
        dst[:] = run[base + r * t:base + r * t + wo]


@numba.njit(inline="always")
def _tap_run(planes, a, b, lay):
    """What kernel tap (a, b) reads for all the output rows of a stack at once: `length`
    elements of one scratch plane (its phase, or its column copy b), output (i, j) of
    image k at (k*R + i)*T + j (columns j >= Wo and rows i >= Ho: unused). lay: (sh, sw,
    dh, dw, T, length, flat)."""
    sh, sw, dh, dw, t, length, flat = lay
    ra, rb = a * dh, b * dw
    start = (ra // sh) * t + rb // sw
    p = b if flat else (ra % sh) * sw + rb % sw
    return planes[p, start:start + length]


def conv(x, w, geom, threads, budget, out=None):
    """y = conv2d(x, w) with groups = C for geom (kh, kw, sh, sw, ph, pw, dh, dw), into
    `out` if given (C-contiguous, the result's shape and dtype), on at most `threads`
    tasks whose scratch planes fit in `budget` elements; None where these loops do not
    take it (the caller's grouped GEMMs run)."""
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    n, c, h, wd = x.shape
    o = w.shape[0]
    ho, wo = geometry(h, wd, *geom)[:2]
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
    ho, wo = geometry(h, wd, *geom)[:2]
    qh, qw = dh * (kh - 1) - ph, dw * (kw - 1) - pw
    if (sh, sw) == (1, 1) and o == c and qh >= 0 and qw >= 0 and dy.shape == (n, c, ho, wo):
        # stride 1, one output a channel: dx is dy convolved with the flipped kernel
        # (padding (k-1)*d - p), the forward's gathers rather than the scatters below
        flipped = np.ascontiguousarray(w[:, :, ::-1, ::-1])
        return conv(dy, flipped, (kh, kw, 1, 1, qh, qw, dh, dw), threads, budget, out)
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
    ho, wo = geometry(h, wd, *geom)[:2]
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
    n, c, m, kh, kw, ho, wo, r_, t, np_, size, flat, length = _sizes(
        x, w, sh, sw, ph, pw, dh, dw, s)
    lay = (sh, sw, dh, dw, t, length, flat)
    units = n // s * c
    for task in numba.prange(tasks):
        planes = np.zeros((np_, size), x.dtype)
        acc = np.empty(length, x.dtype)
        for q in range(task * units // tasks, (task + 1) * units // tasks):
            i0, ch = q // c * s, q % c
            _load_stack(x, i0, ch, s, ph, pw, sh, sw, dw, t, r_, planes, flat)
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
                                   _tap_run(planes, a, 0, lay)[f0:f1],
                                   w[oc, 0, a, 1],
                                   _tap_run(planes, a, 1, lay)[f0:f1],
                                   w[oc, 0, a, 2],
                                   _tap_run(planes, a, 2, lay)[f0:f1],
                                   a == 0)
                            continue
                        for b in range(kw):
                            _madd(dst, w[oc, 0, a, b],
                                  _tap_run(planes, a, b, lay)[f0:f1],
                                  a == 0 and b == 0)
                for k in range(s):
                    _gather_rows(acc, k * r_ * t, t, y[i0 + k, oc])


@numba.njit(**_JIT, parallel=True)
def depthwise_grad_input(dy, w, sh, sw, ph, pw, dh, dw, dx, s, tasks):
    """dx of depthwise_forward: each stack's planes gather w * dy from its m output
    channels at every tap (the forward's reads, as adds; dy's rows laid out T apart,
    images R*T apart, with zeros in the columns from Wo and rows from Ho, which so add
    nothing), then their inside is dx's planes."""
    n, c, m, kh, kw, _ho, _wo, r_, t, np_, size, flat, length = _sizes(
        dx, w, sh, sw, ph, pw, dh, dw, s)
    lay = (sh, sw, dh, dw, t, length, flat)
    units = n // s * c
    for task in numba.prange(tasks):
        planes = np.empty((np_, size), dx.dtype)
        g = np.zeros(length, dx.dtype)  # its unused columns and rows stay 0
        for q in range(task * units // tasks, (task + 1) * units // tasks):
            i0, ch = q // c * s, q % c
            planes[:] = 0
            for u in range(m):
                oc = ch * m + u
                for k in range(s):
                    _spread_rows(dy[i0 + k, oc], t, g, k * r_ * t)
                for f0 in range(0, length, _CHUNK):  # g's chunk in L1 across the taps
                    src = g[f0:f0 + _CHUNK]
                    f1 = f0 + src.size
                    for a in range(kh):
                        for b in range(kw):
                            run = _tap_run(planes, a, b, lay)[f0:f1]
                            _madd(run, w[oc, 0, a, b], src, False)
            for k in range(s):
                _store_plane(dx[i0 + k, ch], ph, pw, sh, sw, dw, t, planes, k * r_ * t, flat)


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
    n, c, m, kh, kw, _ho, _wo, r_, t, np_, size, flat, length = _sizes(
        x, gw, sh, sw, ph, pw, dh, dw, s)
    lay = (sh, sw, dh, dw, t, length, flat)
    for task in numba.prange(tasks):
        planes = np.zeros((np_, size), x.dtype)
        g = np.zeros(length, x.dtype)  # its unused columns and rows stay 0
        acc = np.zeros((m, kh, kw))
        for ch in range(task * c // tasks, (task + 1) * c // tasks):
            acc[:] = 0.0
            for i0 in range(0, n, s):
                _load_stack(x, i0, ch, s, ph, pw, sh, sw, dw, t, r_, planes, flat)
                for u in range(m):
                    for k in range(s):
                        _spread_rows(dy[i0 + k, ch * m + u], t, g, k * r_ * t)
                    for f0 in range(0, length, _BLOCK):
                        gb = g[f0:f0 + _BLOCK]
                        f1 = f0 + gb.size
                        for a in range(kh):
                            if kw == 3:  # a kernel row's three sums in one pass
                                s0, s1, s2 = _dot3(
                                    gb, _tap_run(planes, a, 0, lay)[f0:f1],
                                    _tap_run(planes, a, 1, lay)[f0:f1],
                                    _tap_run(planes, a, 2, lay)[f0:f1])
                                acc[u, a, 0] += np.float64(s0)
                                acc[u, a, 1] += np.float64(s1)
                                acc[u, a, 2] += np.float64(s2)
                                continue
                            for b in range(kw):
                                run = _tap_run(planes, a, b, lay)
                                acc[u, a, b] += np.float64(_dot(gb, run[f0:f1]))
            for u in range(m):
                for a in range(kh):
                    for b in range(kw):
                        gw[ch * m + u, 0, a, b] = acc[u, a, b]
