"""Padding and resizing: `pad` (constant, reflect, replicate; PyTorch's F.pad) and
`upsample` (nearest, linear, bilinear, with align_corners either way; F.interpolate).

Both act on each padded or resized axis separately: along one axis every output element
reads one input element (padding, nearest) or blends two (linear). So the forward pass is
one gather per axis and the backward pass one scatter-add per axis, with the same indices.
"""
from __future__ import annotations

import math

import numpy as np

from netdsl.errors import ShapeError
from netdsl.ir.opdef import GT0, Arg, OpDef, grad_rule, kernel, register
from netdsl.ir.ops._util import need_float
from netdsl.ir.types import TensorType

_PAD_MODES = ("constant", "reflect", "replicate")


def pad_widths(pads, rank: int) -> list[tuple[int, int]]:
    """torch's pad tuple (last dim first: left, right, then the dim before ...) as
    (before, after) per dimension of a rank-`rank` tensor."""
    w = [(0, 0)] * rank
    for i in range(len(pads) // 2):
        w[rank - 1 - i] = (int(pads[2 * i]), int(pads[2 * i + 1]))
    return w


def _pad_shape(ins, a):
    (x,) = ins
    pads = a["pads"]
    if len(pads) % 2 or not pads:
        raise ShapeError(f"pad: pads {pads} must hold pairs (before, after), last dim first")
    if len(pads) // 2 > x.rank - 1:
        raise ShapeError(f"pad: pads {pads} cover {len(pads) // 2} dims, but {{x}} ({x}) has "
                         f"only {x.rank - 1} besides the batch")
    if min(pads) < 0:
        raise ShapeError(f"pad: negative padding {pads} is not supported; use slice")
    out = list(x.shape)
    for i, (lo, hi) in enumerate(pad_widths(pads, x.rank)):
        if lo or hi:
            n = x.shape[i]
            if a["mode"] == "reflect" and (lo >= n or hi >= n):
                raise ShapeError(f"pad: reflect padding {max(lo, hi)} must be smaller than "
                                 f"the dimension ({n}) of {{x}}, which is {x}")
            out[i] = n + lo + hi
    return TensorType(tuple(out), x.dtype)


register(OpDef("pad", (Arg("x", "tensor"), Arg("pads", "ints"),
                       Arg("mode", "str", "constant", choices=_PAD_MODES),
                       Arg("value", "float", 0.0)),
               _pad_shape, "shape", flops=lambda ins, out, a: 0,
               extra={"output_attrs": ("value",)},  # (held as it is: f16 must hold it)
               doc="pad like torch's F.pad: pads = (left, right) of the last dim, then of "
                   "the dim before ...; mode constant (with value), reflect or replicate"))
register(OpDef("pad_grad", (Arg("dy", "tensor"), Arg("shape", "shape"), Arg("pads", "ints"),
                            Arg("mode", "str", "constant", choices=_PAD_MODES)),
               lambda ins, a: TensorType(tuple(a["shape"]), ins[0].dtype), "backward",
               flops=lambda ins, out, a: ins[0].numel(), differentiable=False,
               doc="backward of pad: the centre, plus the reflected/replicated border "
                   "gradients added back"))


def _pad_index(n: int, lo: int, hi: int, mode: str):
    i = np.arange(-lo, n + hi)
    if mode == "reflect":
        i = np.abs(i)
        i = np.where(i >= n, 2 * (n - 1) - i, i)
    return np.clip(i, 0, n - 1)  # replicate (and a no-op for reflect)


@kernel("pad")
def _pad(xp, ins, a, ctx):
    x = ins[0]
    w = pad_widths(a["pads"], x.ndim)
    if a["mode"] == "constant":
        return xp.pad(x, w, mode="constant", constant_values=a["value"])
    return xp.pad(x, w, mode="reflect" if a["mode"] == "reflect" else "edge")


def _scatter_axis(xp, g, ax, idx, n, weight=None):
    """The adjoint of `take(x, idx, axis=ax)` (times `weight` per output position)."""
    gm = xp.moveaxis(g, ax, 0)
    if weight is not None:
        gm = gm * weight.reshape((-1,) + (1,) * (gm.ndim - 1))
    # scatter into a contiguous array (the axis first), then move the axis back
    out = xp.zeros((n,) + gm.shape[1:], dtype=g.dtype)
    xp.add.at(out, idx, gm)
    return xp.ascontiguousarray(xp.moveaxis(out, 0, ax))


@kernel("pad_grad")
def _pad_grad(xp, ins, a, ctx):
    g = ins[0]
    shape = tuple(int(d) for d in a["shape"])
    w = pad_widths(a["pads"], len(shape))
    if a["mode"] == "constant":
        return xp.ascontiguousarray(g[tuple(slice(lo, lo + n) for (lo, _), n in zip(w, shape))])
    for ax, (lo, hi) in enumerate(w):
        if lo or hi:
            idx = xp.asarray(_pad_index(shape[ax], lo, hi, a["mode"]))
            g = _scatter_axis(xp, g, ax, idx, shape[ax])
    return g


@grad_rule("pad")
def _pad_rule(n, b, gy):
    return [b.emit("pad_grad", [gy], {"shape": b.type(n.inputs[0]).shape,
                                      "pads": n.attrs["pads"], "mode": n.attrs["mode"]})]


# -- upsample -----------------------------------------------------------------------------
_MODES = {"nearest": None, "linear": 1, "bilinear": 2, "trilinear": 3}


def _scales(x_shape, a) -> tuple[tuple[int, ...], tuple[float | None, ...]]:
    """Output sizes and the scale factors given (None where a size was given)."""
    d = len(x_shape) - 2
    if a["size"] is not None:
        size = tuple(a["size"]) * d if len(a["size"]) == 1 else tuple(a["size"])
        return size, (None,) * d
    f = a["scale_factor"]
    return tuple(int(math.floor(n * f)) for n in x_shape[2:]), (f,) * d


def _upsample_shape(ins, a):
    (x,) = ins
    need_float(x, "upsample")
    if x.rank < 3:
        raise ShapeError(f"upsample expects an (N, C, spatial...) input, but {{x}} is {x}")
    want = _MODES[a["mode"]]
    if want is not None and x.rank - 2 != want:
        raise ShapeError(f"upsample: mode \"{a['mode']}\" is for {want} spatial dimension"
                         f"{'s' * (want > 1)}, but {{x}} is {x}")
    if (a["size"] is None) == (a["scale_factor"] is None):
        raise ShapeError("upsample needs exactly one of `size` and `scale_factor`")
    if a["size"] is not None and len(a["size"]) not in (1, x.rank - 2):
        raise ShapeError(f"upsample: size {a['size']} needs one value or one per spatial "
                         f"dimension of {{x}}, which is {x}")
    if any(not isinstance(n, int) for n in x.shape[2:]):
        raise ShapeError(f"upsample: the spatial dimensions of {{x}} must be static; it is {x}")
    size, _ = _scales(x.shape, a)
    if min(size) < 1:
        raise ShapeError(f"upsample would make an empty tensor from {{x}} ({x})")
    return TensorType(x.shape[:2] + size, x.dtype)


_UP_ATTRS = (Arg("size", "ints", None), Arg("scale_factor", "float", None, range=GT0),
             Arg("mode", "str", "nearest", choices=tuple(_MODES)),
             Arg("align_corners", "bool", False))
register(OpDef("upsample", (Arg("x", "tensor"),) + _UP_ATTRS, _upsample_shape, "shape",
               flops=lambda ins, out, a: 3 * out.numel(),
               doc="resize the spatial dims like torch's F.interpolate: to `size` or by "
                   "`scale_factor`; nearest, linear (1-d), bilinear (2-d) or trilinear "
                   "(3-d), align_corners either way"))
register(OpDef("upsample_grad", (Arg("dy", "tensor"), Arg("shape", "shape")) + _UP_ATTRS,
               lambda ins, a: TensorType(tuple(a["shape"]), ins[0].dtype), "backward",
               flops=lambda ins, out, a: 3 * ins[0].numel(), differentiable=False,
               doc="backward of upsample: scatter-add with the forward's indices and weights"))


def _axis_map(n: int, o: int, scale_factor, mode: str, align: bool):
    """(i0, i1, w0, w1) for one axis: output j = w0[j] * x[i0[j]] + w1[j] * x[i1[j]]
    (torch's index and weight computation, upsample kernels of ATen)."""
    j = np.arange(o)
    if mode == "nearest":
        if o == n:
            i0 = j
        else:
            scale = np.float32(1.0 / scale_factor if scale_factor else n / o)
            i0 = np.minimum(np.floor(j.astype(np.float32) * scale).astype(np.int64), n - 1)
        return i0, i0, np.ones(o), np.zeros(o)
    if align:
        scale = (n - 1) / (o - 1) if o > 1 else 0.0
        src = scale * j
    else:
        scale = 1.0 / scale_factor if scale_factor else n / o
        src = np.maximum(scale * (j + 0.5) - 0.5, 0.0)
    i0 = np.minimum(src.astype(np.int64), n - 1)
    i1 = np.minimum(i0 + 1, n - 1)
    w1 = src - i0
    return i0, i1, 1.0 - w1, w1


def _maps(in_shape, a):
    size, factors = _scales(in_shape, a)
    return [_axis_map(int(n), o, f, a["mode"], a["align_corners"])
            for n, o, f in zip(in_shape[2:], size, factors)]


@kernel("upsample")
def _upsample(xp, ins, a, ctx):
    y = ins[0]
    for k, (i0, i1, w0, w1) in enumerate(_maps(y.shape, a)):
        ax = 2 + k
        part = xp.take(y, xp.asarray(i0), axis=ax)
        if a["mode"] != "nearest":
            bshape = (-1,) + (1,) * (y.ndim - ax - 1)
            part = part * xp.asarray(w0, dtype=y.dtype).reshape(bshape) + \
                xp.take(y, xp.asarray(i1), axis=ax) * xp.asarray(w1, dtype=y.dtype).reshape(bshape)
        y = part
    return xp.ascontiguousarray(y)


@kernel("upsample_grad")
def _upsample_grad(xp, ins, a, ctx):
    g = ins[0]
    shape = tuple(int(d) for d in a["shape"])
    maps = _maps(shape, a)
    for k in reversed(range(len(maps))):
        i0, i1, w0, w1 = maps[k]
        ax, n = 2 + k, shape[2 + k]
        if a["mode"] == "nearest":
            g = _scatter_axis(xp, g, ax, xp.asarray(i0), n)
        else:
            g = _scatter_axis(xp, g, ax, xp.asarray(i0), n, xp.asarray(w0, dtype=g.dtype)) + \
                _scatter_axis(xp, g, ax, xp.asarray(i1), n, xp.asarray(w1, dtype=g.dtype))
    return g


@grad_rule("upsample")
def _upsample_rule(n, b, gy):
    attrs = {k: n.attrs[k] for k in ("size", "scale_factor", "mode", "align_corners")}
    return [b.emit("upsample_grad", [gy], {"shape": b.type(n.inputs[0]).shape, **attrs})]
