"""Pooling over N, C, *spatial tensors: max and average pooling in 1, 2 and 3 spatial
dimensions (`maxpool1d`, `maxpool` (2-d), `maxpool3d`; likewise `avgpool`), with
`ceil_mode` and, for average pooling, `count_include_pad`; global average and max pooling;
adaptive average and max pooling to a given output size.

PyTorch's conventions throughout: the stride defaults to the kernel; with `ceil_mode` the
last window may run past the (right) padding but must start inside the input or the left
padding; an average divides by the window's size clipped to the padded input
(`count_include_pad=true`) or to the input itself (`false`); max pooling passes the
gradient to the first maximum of each window.
"""
from __future__ import annotations

import itertools
import math

from netdsl.errors import ShapeError
from netdsl.ir.opdef import NON_NEGATIVE, POSITIVE, Arg, OpDef, grad_rule, kernel, register
from netdsl.ir.ops._util import fused_kernels, need_float, need_rank
from netdsl.ir.types import TensorType


def spatial(v, d: int, what: str, op: str) -> tuple[int, ...]:
    """An int or tuple attribute as a d-tuple (an int or 1-tuple applies to every dim)."""
    t = tuple(v) if isinstance(v, (tuple, list)) else (v,)
    if len(t) == 1:
        t = t * d
    if len(t) != d:
        raise ShapeError(f"{op}: {what} {v} needs {d} values (one per spatial dimension)")
    return tuple(int(x) for x in t)


def pool_out(size: int, k: int, s: int, p: int, ceil: bool) -> int:
    """Output length of one pooled dimension (torch's pooling_output_shape, dilation 1)."""
    span = size + 2 * p - k
    o = (-(-span // s) if ceil else span // s) + 1
    if ceil and (o - 1) * s >= size + p:  # the last window would start in the right padding
        o -= 1
    return o


def _geom(shape, a, d, op="pool"):
    k = spatial(a["kernel"], d, "kernel", op)
    s = spatial(a["stride"] if a["stride"] is not None else a["kernel"], d, "stride", op)
    p = spatial(a["padding"], d, "padding", op)
    sizes = tuple(int(x) for x in shape[2:])
    out = tuple(pool_out(n, ki, si, pi, a["ceil_mode"]) for n, ki, si, pi in
                zip(sizes, k, s, p))
    return k, s, p, sizes, out


def _pool_shape(op, d):
    def shape(ins, a):
        (x,) = ins
        need_rank(x, op, (d + 2,))
        need_float(x, op)
        k = spatial(a["kernel"], d, "kernel", op)
        s = spatial(a["stride"] if a["stride"] is not None else a["kernel"], d, "stride", op)
        p = spatial(a["padding"], d, "padding", op)
        if min(k + s) < 1 or min(p) < 0:
            raise ShapeError(f"{op}: kernel and stride must be positive, padding >= 0")
        if any(pi > ki // 2 for pi, ki in zip(p, k)):
            raise ShapeError(f"{op}: padding {a['padding']} is more than half the kernel "
                             f"{a['kernel']}")
        out = []
        names = {1: ("length",), 2: ("height", "width"), 3: ("depth", "height", "width")}[d]
        for i, (n, ki, si, pi) in enumerate(zip(x.shape[2:], k, s, p)):
            if not isinstance(n, int):
                raise ShapeError(f"{op}: the {names[i]} dimension must be static, got {n}")
            o = pool_out(n, ki, si, pi, a["ceil_mode"])
            if o < 1:
                raise ShapeError(f"{op}: a {names[i]} of {n} is too small for kernel {ki} "
                                 f"with padding {pi}; {{x}} would become empty")
            out.append(o)
        return TensorType(x.shape[:2] + tuple(out), x.dtype)
    return shape


def _pool_flops(ins, out, a):
    n = 1
    for k in (a["kernel"] if isinstance(a["kernel"], tuple) else (a["kernel"],)):
        n *= k
    return out.numel() * n


def _window_scratch(x, a, passes: int):
    """(elements of the padded copy of x, 0 when it does not pad; of the padded x; of the
    window reduction's first `passes` passes; of the result)."""
    k, s, p, sizes, o = _geom(x.shape, a, x.rank - 2)
    full = tuple(n + 2 * pi + e for n, pi, e in zip(sizes, p, _extra(sizes, k, s, p, o)))
    nc = x.shape[0] * x.shape[1]
    padded = nc * math.prod(full)
    # after axis i: reduced up to it, padded after it
    reduced = sum(nc * math.prod(o[:i + 1]) * math.prod(full[i + 1:]) for i in range(passes))
    return (padded if full != sizes else 0), padded, reduced, nc * math.prod(o)


def _pool_workspace(avg: bool):
    """Float32 bytes of the forward kernels' scratch (below): the padded copy of x, when it
    pads, and the window reduction's passes but the last (which is the result; averaging
    then divides it into a new array, so there the last pass counts too)."""
    def rule(ins, out, a):
        x = ins[0]
        copy, _, reduced, _ = _window_scratch(x, a, x.rank - 2 - (0 if avg else 1))
        return 4 * (copy + reduced)
    return rule


def _avgpool_grad_workspace(ins, out, a):
    """Float32 bytes of the kernel's scratch: dy divided by the counts, the padded
    gradient when it pads (else that is the result itself), and the ufunc buffers of its
    strided adds (NumPy's 8,192 elements for each of two operands)."""
    copy, padded, _, o = _window_scratch(out, a, 0)
    return 4 * (o + (padded if copy else 0) + 2 * 8192)


def _maxpool_grad_workspace(ins, out, a):
    """Float32 bytes of the NumPy kernel's scratch (the fused one's result is all it
    allocates): the forward's passes, then the padded x and its gradient (the result
    itself where nothing pads), the maxima and the masked dy, and three bool masks."""
    x = ins[1]
    copy, padded, reduced, o = _window_scratch(x, a, x.rank - 3)
    return int(4 * max(copy + reduced + o, copy + (padded if copy else 0) + 2.75 * o))


# name -> spatial dims; the 2-d operators keep their historical names
_DIMS = {"": 2, "1d": 1, "3d": 3}
_MAX_EXTRA = (Arg("ceil_mode", "bool", False),)
_AVG_EXTRA = (Arg("ceil_mode", "bool", False), Arg("count_include_pad", "bool", True))
for _suffix, _d in _DIMS.items():
    _kind = "pair" if _d == 2 else "ints"
    _sig = (Arg("x", "tensor"), Arg("kernel", _kind, range=POSITIVE),
            Arg("stride", _kind, None, range=POSITIVE),
            Arg("padding", _kind, 0, range=NON_NEGATIVE))
    _what = {1: "1-d (N, C, L)", 2: "2-d (N, C, H, W)", 3: "3-d (N, C, D, H, W)"}[_d]
    # maxpool's backward recomputes the argmax from x, so it keeps x but not its output
    register(OpDef(f"maxpool{_suffix}", _sig + _MAX_EXTRA, _pool_shape(f"maxpool{_suffix}", _d),
                   "pool", flops=_pool_flops, workspace=_pool_workspace(False),
                   retains=("inputs",), doc=f"{_what} max pooling; stride defaults to kernel",
                   extra={"default_from": {"stride": "kernel"}, "spatial": _d,
                          "fused_kernels": ("pool",) if _d == 2 else ()}))
    register(OpDef(f"avgpool{_suffix}", _sig + _AVG_EXTRA, _pool_shape(f"avgpool{_suffix}", _d),
                   "pool", flops=_pool_flops, workspace=_pool_workspace(True),
                   doc=f"{_what} average pooling; stride defaults to kernel; padding counts "
                       "as zeros unless count_include_pad=false",
                   extra={"default_from": {"stride": "kernel"}, "spatial": _d}))
    register(OpDef(f"maxpool{_suffix}_grad",
                   (Arg("dy", "tensor"), Arg("x", "tensor")) + _sig[1:] + _MAX_EXTRA,
                   lambda ins, a: ins[1], "backward", flops=_pool_flops, differentiable=False,
                   workspace=_maxpool_grad_workspace,
                   doc="route dy to the first maximum of each window (argmax recomputed "
                       "from x)",
                   extra={"spatial": _d, "fused_kernels": ("pool",) if _d == 2 else ()}))
    register(OpDef(f"avgpool{_suffix}_grad",
                   (Arg("dy", "tensor"), Arg("shape", "shape")) + _sig[1:] + _AVG_EXTRA,
                   lambda ins, a: TensorType(tuple(a["shape"]), ins[0].dtype), "backward",
                   flops=_pool_flops, differentiable=False, workspace=_avgpool_grad_workspace,
                   doc="spread dy evenly over each window (divided as the forward divides)",
                   extra={"spatial": _d}))


def _global_shape(op):
    def shape(ins, a):
        (x,) = ins
        if x.rank < 3:
            raise ShapeError(f"{op} expects an (N, C, spatial...) input, but {{x}} is {x}")
        need_float(x, op)
        return TensorType(x.shape[:2] + (1,) * (x.rank - 2), x.dtype)
    return shape


register(OpDef("global_avgpool", (Arg("x", "tensor"),), _global_shape("global_avgpool"), "pool",
               flops=lambda ins, out, a: ins[0].numel(),
               doc="mean over every spatial dimension: [N, C, H, W] -> [N, C, 1, 1] (and "
                   "likewise for 1-d and 3-d)"))
register(OpDef("global_maxpool", (Arg("x", "tensor"),), _global_shape("global_maxpool"), "pool",
               flops=lambda ins, out, a: ins[0].numel(), retains=("inputs", "output"),
               doc="maximum over every spatial dimension: [N, C, ...] -> [N, C, 1, ...] "
                   "(ties share the gradient)"))


def _adaptive_shape(op):
    def shape(ins, a):
        (x,) = ins
        if x.rank < 3:
            raise ShapeError(f"{op} expects an (N, C, spatial...) input, but {{x}} is {x}")
        need_float(x, op)
        out = spatial(a["output_size"], x.rank - 2, "output_size", op)
        if min(out) < 1:
            raise ShapeError(f"{op}: output_size must be positive, not {a['output_size']}")
        if any(not isinstance(n, int) for n in x.shape[2:]):
            raise ShapeError(f"{op}: the spatial dimensions of {{x}} must be static; it is {x}")
        return TensorType(x.shape[:2] + out, x.dtype)
    return shape


for _mode in ("avg", "max"):
    register(OpDef(f"adaptive_{_mode}pool", (Arg("x", "tensor"), Arg("output_size", "ints")),
                   _adaptive_shape(f"adaptive_{_mode}pool"), "pool",
                   flops=lambda ins, out, a: ins[0].numel(),
                   retains=("inputs",) if _mode == "max" else (),
                   doc=f"{_mode} pooling to a given output size (one int for every spatial "
                       "dimension, or one per dimension); bins as torch's adaptive pooling"))
    register(OpDef(f"adaptive_{_mode}pool_grad",
                   (Arg("dy", "tensor"), Arg("x" if _mode == "max" else "shape",
                                             "tensor" if _mode == "max" else "shape")),
                   (lambda ins, a: ins[1]) if _mode == "max" else
                   (lambda ins, a: TensorType(tuple(a["shape"]), ins[0].dtype)),
                   "backward", flops=lambda ins, out, a: out.numel(), differentiable=False,
                   doc=f"backward of adaptive_{_mode}pool"))
register(OpDef("global_avgpool_grad", (Arg("dy", "tensor"), Arg("shape", "shape")),
               lambda ins, a: TensorType(tuple(a["shape"]), ins[0].dtype),
               "backward", flops=lambda ins, out, a: out.numel(), differentiable=False,
               doc="spread dy evenly over the spatial dimensions"))


# -- kernels ----------------------------------------------------------------------------------
def _extra(sizes, k, s, p, out):
    """Right padding beyond p that ceil_mode's last windows reach."""
    return tuple(max(0, (o - 1) * si + ki - (n + 2 * pi))
                 for n, ki, si, pi, o in zip(sizes, k, s, p, out))


def _pad(xp, x, p, extra, value):
    sizes = x.shape[2:]
    full = x.shape[:2] + tuple(n + 2 * pi + e for n, pi, e in zip(sizes, p, extra))
    if full == x.shape:
        return xp.ascontiguousarray(x)
    buf = xp.full(full, value, dtype=x.dtype)
    buf[_inner(p, sizes)] = x
    return buf


def _inner(p, sizes):
    return (slice(None), slice(None)) + tuple(slice(pi, pi + n) for pi, n in zip(p, sizes))


def _offset(off, s, out):
    """The [N, C, *out] strided view index of kernel offset `off` in the padded input:
    element o of it is window o's element `off`."""
    return (slice(None), slice(None)) + tuple(
        slice(o, o + si * (n - 1) + 1, si) for o, si, n in zip(off, s, out))


def _offsets(k):
    return itertools.product(*(range(ki) for ki in k))


def _scatter_windows(xp, dxpad, cols, k, s, out):
    """Add cols [N, C, *out, *k] onto the padded input at their windows (windows' adjoint):
    one strided add per kernel offset."""
    for off in _offsets(k):
        dxpad[_offset(off, s, out)] += cols[(Ellipsis,) + off]


def _nd(a, shape):
    return len(shape) - 2


def _padded_max(xp, x, a):
    k, s, p, sizes, out = _geom(x.shape, a, _nd(a, x.shape))
    return _pad(xp, x, p, _extra(sizes, k, s, p, out), -xp.inf), (k, s, p, sizes, out)


def _window_reduce(xp, xpad, k, s, out, op):
    """`op` (maximum or add) over every window, one spatial axis at a time (windows are
    boxes, so the reduction separates): per axis, one element-wise pass per kernel offset
    over a strided view. A reduction over the small window axes of a strided view is
    several times slower, and separating the axes makes k1 + k2 passes instead of
    k1 x k2. NaN propagates through maximum as in a max reduction."""
    r = xpad
    for ax, (ki, si, n) in enumerate(zip(k, s, out), start=2):
        acc = None
        for o in range(ki):
            idx = (slice(None),) * ax + (slice(o, o + si * (n - 1) + 1, si),)
            v = r[idx]
            if acc is None:
                acc = xp.array(v)
            else:
                op(acc, v, out=acc)
        r = acc
    return r


def _window_max(xp, xpad, k, s, out):
    return _window_reduce(xp, xpad, k, s, out, xp.maximum)


def _two_by_two(geom) -> bool:
    """2x2 windows at stride 2, unpadded, every window inside x (no ceil-mode edge), for
    `_geom`'s 2-d (k, s, p, sizes, out): the fused kernels' own loops
    (numpy_fused_pool.maxpool2x2*)."""
    k, s, p, sizes, out = geom
    return ((*k, *s, *p) == (2, 2, 2, 2, 0, 0)
            and 2 * out[0] <= sizes[0] and 2 * out[1] <= sizes[1])


def _maxpool(xp, ins, a, ctx):
    x = ins[0]
    f = fused_kernels(ctx, x)
    if f is not None and x.ndim == 4:
        geom = _geom(x.shape, a, 2)
        if _two_by_two(geom):
            y = xp.empty(x.shape[:2] + tuple(geom[4]), x.dtype)
            f.maxpool2x2(x, y)
            return y
    xpad, (k, s, _p, _sizes, out) = _padded_max(xp, x, a)
    return _window_max(xp, xpad, k, s, out)


def _maxpool_grad(xp, ins, a, ctx):
    """dy goes to the first maximum of each window in row-major window order (torch's
    argmax rule; a NaN counts as the maximum), added where windows overlap."""
    dy, x = ins
    f = fused_kernels(ctx, dy, x)
    if f is not None and x.ndim == 4:  # one pass over x (Numba), the same rule
        geom = _geom(x.shape, a, 2)
        if _two_by_two(geom):
            # every element written where the windows cover x (even H and W): no zeroing
            covered = x.shape[2] % 2 == 0 and x.shape[3] % 2 == 0
            dx = xp.empty_like(x) if covered else xp.zeros_like(x)
            f.maxpool2x2_grad(dy, x, dx)
            return dx
        dx = xp.zeros_like(x)
        (kh, kw), (sh, sw), (ph, pw) = geom[:3]
        f.maxpool2d_grad(dy, x, kh, kw, sh, sw, ph, pw, dx)
        return dx
    xpad, (k, s, p, sizes, out) = _padded_max(xp, x, a)
    y = _window_max(xp, xpad, k, s, out)
    nan = xp.isnan(y)
    # (a recorded step cannot look: it keeps the NaN test, the same result)
    nan = nan if getattr(ctx, "capturing", False) or bool(nan.any()) else None
    dxpad = xp.zeros(xpad.shape, dtype=dy.dtype)
    taken = xp.zeros(y.shape, dtype=bool)  # windows whose maximum has had its gradient
    hit = xp.empty(y.shape, dtype=bool)
    part = xp.empty(dy.shape, dtype=dy.dtype)
    for off in _offsets(k):  # buffers reused: five passes per offset, no allocation
        idx = _offset(off, s, out)
        v = xpad[idx]
        xp.equal(v, y, out=hit)
        if nan is not None:
            hit |= xp.isnan(v) & nan
        xp.greater(hit, taken, out=hit)  # hit and not taken
        taken |= hit
        xp.multiply(dy, hit, out=part)
        dxpad[idx] += part
    return xp.ascontiguousarray(dxpad[_inner(p, sizes)])


def _counts(xp, a, k, s, p, sizes, out, dtype):
    """The divisor of every output position, [*out], as torch's avg_pool computes it."""
    total = None
    for n, ki, si, pi, o in zip(sizes, k, s, p, out):
        start = xp.arange(o) * si - pi
        end = xp.minimum(start + ki, n + pi)
        if a["count_include_pad"]:
            c = end - start
        else:
            c = xp.minimum(end, n) - xp.maximum(start, 0)
        c = c.astype(dtype)
        total = c if total is None else total[..., None] * c
    return total


def _avgpool(xp, ins, a, ctx):
    x = ins[0]
    k, s, p, sizes, out = _geom(x.shape, a, _nd(a, x.shape))
    xpad = _pad(xp, x, p, _extra(sizes, k, s, p, out), 0.0)
    total = _window_reduce(xp, xpad, k, s, out, xp.add)
    return total / _counts(xp, a, k, s, p, sizes, out, x.dtype)


def _avgpool_grad(xp, ins, a, ctx):
    dy = ins[0]
    shape = tuple(int(v) for v in a["shape"])
    k, s, p, sizes, out = _geom(shape, a, len(shape) - 2)
    g = dy / _counts(xp, a, k, s, p, sizes, out, dy.dtype)
    extra = _extra(sizes, k, s, p, out)
    dxpad = xp.zeros((dy.shape[0],) + shape[1:2] +
                     tuple(n + 2 * pi + e for n, pi, e in zip(sizes, p, extra)), dtype=dy.dtype)
    cols = xp.broadcast_to(g.reshape(g.shape + (1,) * len(k)), g.shape + k)
    _scatter_windows(xp, dxpad, cols, k, s, out)
    return xp.ascontiguousarray(dxpad[_inner(p, sizes)])


for _suffix in _DIMS:
    kernel(f"maxpool{_suffix}")(_maxpool)
    kernel(f"maxpool{_suffix}_grad")(_maxpool_grad)
    kernel(f"avgpool{_suffix}")(_avgpool)
    kernel(f"avgpool{_suffix}_grad")(_avgpool_grad)


@kernel("global_avgpool")
def _gap(xp, ins, a, ctx):
    x = ins[0]
    return x.mean(axis=tuple(range(2, x.ndim)), keepdims=True)


@kernel("global_avgpool_grad")
def _gap_grad(xp, ins, a, ctx):
    dy = ins[0]
    shape = tuple(int(d) for d in a["shape"])
    count = 1
    for d in shape[2:]:
        count *= d
    return xp.ascontiguousarray(xp.broadcast_to(dy * (1.0 / count),
                                                (dy.shape[0],) + shape[1:]))


@kernel("global_maxpool")
def _gmp(xp, ins, a, ctx):
    x = ins[0]
    return x.max(axis=tuple(range(2, x.ndim)), keepdims=True)


def _bins(n: int, o: int) -> list[tuple[int, int]]:
    """torch's adaptive pooling bins: [floor(i n / o), ceil((i + 1) n / o))."""
    return [(i * n // o, -(-(i + 1) * n // o)) for i in range(o)]


def _cells(in_sizes, out_sizes):
    """(output index, input box as slices) for every output cell."""
    per_dim = [list(enumerate(_bins(n, o))) for n, o in zip(in_sizes, out_sizes)]
    for combo in itertools.product(*per_dim):
        yield (tuple(i for i, _ in combo),
               tuple(slice(lo, hi) for _, (lo, hi) in combo))


def _adaptive_matrix(xp, n, o, dtype):
    """[o, n]: row i averages bin i (adaptive average pooling is separable)."""
    m = xp.zeros((o, n), dtype=dtype)
    for i, (lo, hi) in enumerate(_bins(n, o)):
        m[i, lo:hi] = 1.0 / (hi - lo)
    return m


def _apply_per_axis(xp, x, mats, transpose=False):
    """Multiply each spatial axis of x by its matrix (or the matrix's transpose)."""
    for i, m in enumerate(mats):
        ax = 2 + i
        m = m.T if transpose else m
        x = xp.moveaxis(xp.tensordot(x, m, axes=([ax], [1])), -1, ax)
    return xp.ascontiguousarray(x)


@kernel("adaptive_avgpool")
def _aap(xp, ins, a, ctx):
    x = ins[0]
    out = spatial(a["output_size"], x.ndim - 2, "output_size", "adaptive_avgpool")
    mats = [_adaptive_matrix(xp, n, o, x.dtype) for n, o in zip(x.shape[2:], out)]
    return _apply_per_axis(xp, x, mats)


@kernel("adaptive_avgpool_grad")
def _aap_grad(xp, ins, a, ctx):
    dy = ins[0]
    shape = tuple(int(v) for v in a["shape"])
    mats = [_adaptive_matrix(xp, n, o, dy.dtype) for n, o in zip(shape[2:], dy.shape[2:])]
    return _apply_per_axis(xp, dy, mats, transpose=True)


@kernel("adaptive_maxpool")
def _amp(xp, ins, a, ctx):
    x = ins[0]
    out = spatial(a["output_size"], x.ndim - 2, "output_size", "adaptive_maxpool")
    y = xp.empty(x.shape[:2] + out, dtype=x.dtype)
    sp = tuple(range(2, x.ndim))
    for idx, box in _cells(x.shape[2:], out):
        y[(slice(None), slice(None)) + idx] = x[(slice(None), slice(None)) + box].max(axis=sp)
    return y


@kernel("adaptive_maxpool_grad")
def _amp_grad(xp, ins, a, ctx):
    dy, x = ins
    dx = xp.zeros_like(x, dtype=dy.dtype)
    n, c = x.shape[:2]
    for idx, box in _cells(x.shape[2:], dy.shape[2:]):
        sl = (slice(None), slice(None)) + box
        part = x[sl]
        flat = part.reshape(n, c, -1)
        hot = (flat.argmax(axis=-1)[..., None] == xp.arange(flat.shape[-1]))  # first max
        g = dy[(slice(None), slice(None)) + idx][..., None] * hot
        dx[sl] += g.reshape(part.shape)
    return dx


# -- gradient rules ---------------------------------------------------------------------------
def _attrs(n, names):
    return {k: n.attrs[k] for k in names}


_MAX_ATTRS = ("kernel", "stride", "padding", "ceil_mode")
_AVG_ATTRS = _MAX_ATTRS + ("count_include_pad",)
for _suffix in _DIMS:
    grad_rule(f"maxpool{_suffix}")(
        lambda n, b, gy, _s=_suffix: [b.emit(f"maxpool{_s}_grad", [gy, n.inputs[0]],
                                             _attrs(n, _MAX_ATTRS))])
    grad_rule(f"avgpool{_suffix}")(
        lambda n, b, gy, _s=_suffix: [b.emit(f"avgpool{_s}_grad", [gy],
                                             {"shape": b.type(n.inputs[0]).shape,
                                              **_attrs(n, _AVG_ATTRS)})])


@grad_rule("global_avgpool")
def _gap_rule(n, b, gy):
    return [b.emit("global_avgpool_grad", [gy], {"shape": b.type(n.inputs[0]).shape})]


@grad_rule("global_maxpool")
def _gmp_rule(n, b, gy):
    x = n.inputs[0]
    return [b.emit("extremum_grad", [gy, x, n.name],
                   {"axis": tuple(range(2, b.type(x).rank)), "keepdims": True})]


@grad_rule("adaptive_avgpool")
def _aap_rule(n, b, gy):
    return [b.emit("adaptive_avgpool_grad", [gy], {"shape": b.type(n.inputs[0]).shape})]


@grad_rule("adaptive_maxpool")
def _amp_rule(n, b, gy):
    return [b.emit("adaptive_maxpool_grad", [gy, n.inputs[0]])]
