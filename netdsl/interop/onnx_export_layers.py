"""ONNX exporters (opset 17) for the layer operators: convolutions, pooling, normalisation,
resizing and padding, attention. The table that maps netdsl operators to them is
`onnx_export_ops.EXPORTERS`; see there for the exporter signature `fn(e, n, xs)`.

ONNX has no adaptive pooling, no GroupNormalization before opset 18 and no RMS norm, so
those are written as opset-17 primitives that compute exactly what netdsl's kernels do.
"""
from __future__ import annotations

import numpy as np

from netdsl.ir.ops.conv import explicit_padding
from netdsl.ir.ops.pool import spatial
from netdsl.ir.ops.reduce import axes_of
from netdsl.ir.ops.resize import pad_widths

# -- convolution -----------------------------------------------------------------------------


def conv(d: int):
    def export(e, n, xs):
        a = n.attrs
        begins, ends = explicit_padding(a, d)
        e.result("Conv", xs, kernel_shape=list(spatial(a["kernel"], d, "kernel", n.op)),
                 strides=list(spatial(a["stride"], d, "stride", n.op)),
                 pads=list(begins) + list(ends),
                 dilations=list(spatial(a["dilation"], d, "dilation", n.op)), group=a["groups"])
    return export


def conv_transpose2d(e, n, xs):
    # netdsl's weight is [in, out/groups, kh, kw], ONNX ConvTranspose's layout too
    a, op = n.attrs, n.op
    p = spatial(a["padding"], 2, "padding", op)
    e.result("ConvTranspose", xs, kernel_shape=list(spatial(a["kernel"], 2, "kernel", op)),
             strides=list(spatial(a["stride"], 2, "stride", op)), pads=list(p) + list(p),
             output_padding=list(spatial(a["output_padding"], 2, "output_padding", op)),
             dilations=list(spatial(a["dilation"], 2, "dilation", op)), group=a["groups"])


# -- pooling ---------------------------------------------------------------------------------


def pool(op_type: str, d: int):
    def export(e, n, xs):
        a = n.attrs
        k = spatial(a["kernel"], d, "kernel", n.op)
        s = spatial(a["stride"] if a["stride"] is not None else a["kernel"], d, "stride", n.op)
        p = spatial(a["padding"], d, "padding", n.op)
        extra = {"count_include_pad": int(a["count_include_pad"])} \
            if op_type == "AveragePool" else {}
        e.result(op_type, xs, kernel_shape=list(k), strides=list(s), pads=list(p) + list(p),
                 ceil_mode=int(a["ceil_mode"]), **extra)
    return export


def _bins(n: int, o: int) -> list[tuple[int, int]]:
    """torch's adaptive pooling bins along one axis (as netdsl's kernel)."""
    return [(i * n // o, -(-(i + 1) * n // o)) for i in range(o)]


def adaptive(op_type: str, reduce_type: str):
    """Adaptive pooling: a plain pool where every size divides evenly; otherwise, since the
    bins of each axis are independent, one axis at a time: each bin sliced and reduced,
    the bins concatenated."""
    def export(e, n, xs):
        x = e.type(n.inputs[0])
        d = x.rank - 2
        sizes = [int(v) for v in x.shape[2:]]
        out = spatial(n.attrs["output_size"], d, "output_size", n.op)
        if all(s % o == 0 for s, o in zip(sizes, out)):
            k = [s // o for s, o in zip(sizes, out)]
            e.result(op_type, xs, kernel_shape=k, strides=k, pads=[0] * (2 * d))
            return
        cur = xs[0]
        for i, (s, o) in enumerate(zip(sizes, out)):
            ax = 2 + i
            if s == o:
                continue
            parts = [e.emit(reduce_type, [e.emit("Slice", [cur, e.ints([lo], "start"),
                                                           e.ints([hi], "stop"),
                                                           e.ints([ax], "axis")])],
                            axes=[ax], keepdims=1) for lo, hi in _bins(s, o)]
            cur = e.emit("Concat", parts, axis=ax)
        e.result("Identity", [cur])
    return export


# -- normalisation ---------------------------------------------------------------------------


def _per_channel(e, w: str, rank: int) -> str:
    """A [C] weight as [C, 1, ...] to broadcast over (N, C, *spatial)."""
    return e.emit("Reshape", [w, e.ints([-1] + [1] * (rank - 2), "channel_shape")])


def _ones_zeros(e, c: int):
    return (e.const(np.ones(c, np.float32), "scale"),
            e.const(np.zeros(c, np.float32), "bias"))


def instancenorm(e, n, xs):
    c = e.type(n.inputs[0]).shape[1]
    ins = xs if n.attrs["affine"] else [xs[0], *_ones_zeros(e, c)]
    e.result("InstanceNormalization", ins, epsilon=n.attrs["eps"])


def groupnorm(e, n, xs):
    # opset 17 has no GroupNormalization: instance-normalise [N, G, C/G * spatial] (each
    # group one "channel"), shape back, then the per-channel weight and bias
    x = e.type(n.inputs[0])
    g = n.attrs["num_groups"]
    grouped = e.emit("Reshape", [xs[0], e.ints([0, g, -1], "grouped")])
    normed = e.emit("InstanceNormalization", [grouped, *_ones_zeros(e, g)],
                    epsilon=n.attrs["eps"])
    back = e.emit("Reshape", [normed, e.emit("Shape", [xs[0]])])
    if not n.attrs["affine"]:
        e.result("Identity", [back])
        return
    scaled = e.emit("Mul", [back, _per_channel(e, xs[1], x.rank)])
    e.result("Add", [scaled, _per_channel(e, xs[2], x.rank)])


def layernorm(e, n, xs):
    x = e.type(n.inputs[0])
    axis = n.attrs.get("axis", -1) % x.rank
    ins = xs if n.attrs["affine"] else \
        [xs[0], e.const(np.ones(tuple(x.shape[axis:]), np.float32), "scale")]
    e.result("LayerNormalization", ins, axis=axis, epsilon=n.attrs["eps"])


def rmsnorm(e, n, xs):
    # x / sqrt(mean(x^2 over the dims from axis) + eps) * weight
    x = e.type(n.inputs[0])
    axis = n.attrs["axis"] % x.rank
    ms = e.emit("ReduceMean", [e.emit("Mul", [xs[0], xs[0]])],
                axes=list(range(axis, x.rank)), keepdims=1)
    rms = e.emit("Sqrt", [e.emit("Add", [ms, e.scalar(n.attrs["eps"], "eps")])])
    if not n.attrs["affine"]:
        e.result("Div", [xs[0], rms])
        return
    e.result("Mul", [e.emit("Div", [xs[0], rms]), xs[1]])


# -- padding and resizing --------------------------------------------------------------------

_PAD_MODE = {"constant": "constant", "reflect": "reflect", "replicate": "edge"}


def pad(e, n, xs):
    rank = e.type(n.inputs[0]).rank
    w = pad_widths(n.attrs["pads"], rank)
    pads = e.ints([b for b, _ in w] + [a for _, a in w], "pads")
    ins = [xs[0], pads]
    if n.attrs["mode"] == "constant":
        ins.append(e.scalar(n.attrs["value"], "value"))
    e.result("Pad", ins, mode=_PAD_MODE[n.attrs["mode"]])


def upsample(e, n, xs):
    # torch's F.interpolate: nearest reads floor(j / scale) ("asymmetric", "floor"); linear
    # is "align_corners" or "pytorch_half_pixel". A scale_factor is passed as the scales
    # (so the coordinates use 1/scale_factor as torch does), a size as the sizes
    a = n.attrs
    x = e.type(n.inputs[0])
    d = x.rank - 2
    if a["mode"] == "nearest":
        kw = {"mode": "nearest", "coordinate_transformation_mode": "asymmetric",
              "nearest_mode": "floor"}
    else:
        kw = {"mode": "linear", "coordinate_transformation_mode":
              "align_corners" if a["align_corners"] else "pytorch_half_pixel"}
    if a["size"] is None:
        scales = e.const(np.array([1.0, 1.0] + [a["scale_factor"]] * d, np.float32), "scales")
        e.result("Resize", [xs[0], "", scales], **kw)
        return
    size = tuple(a["size"]) * d if len(a["size"]) == 1 else tuple(a["size"])
    lead = e.emit("Shape", [xs[0]], end=2)  # N and C, whatever the batch
    sizes = e.emit("Concat", [lead, e.ints(list(size), "spatial")], axis=0)
    e.result("Resize", [xs[0], "", "", sizes], **kw)


# -- attention -------------------------------------------------------------------------------


def _future(e, length: int, keys: int) -> str:
    """A bool [L, S] constant, true where key j comes after query i (j > i)."""
    return e.const(np.triu(np.ones((length, keys), bool), k=1), "future")


def causal_mask(e, n, xs):
    shape = e.type(n.inputs[0]).shape
    value = e.const(np.array(n.attrs["value"], np.float32), "value")
    e.result("Where", [_future(e, shape[-2], shape[-1]), value, xs[0]])


def _attention_probs(e, q, k, length: int, keys: int, width: int, rank: int, scale, causal):
    """softmax(q k^T * scale [+ causal mask]) over [..., L, E] q and [..., S, E] k; its
    name (scale None: 1/sqrt(E))."""
    perm = list(range(rank))
    perm[-2], perm[-1] = perm[-1], perm[-2]
    scale = scale if scale is not None else 1.0 / float(width) ** 0.5
    s = e.emit("Mul", [e.emit("MatMul", [q, e.emit("Transpose", [k], perm=perm)]),
                       e.scalar(scale, "scale")])
    if causal:
        s = e.emit("Where", [_future(e, length, keys), e.scalar(-np.inf, "minus_inf"), s])
    return e.emit("Softmax", [s], axis=-1)


def scaled_dot_product_attention(e, n, xs):
    qt, kt = e.type(n.inputs[0]), e.type(n.inputs[1])
    p = _attention_probs(e, xs[0], xs[1], qt.shape[-2], kt.shape[-2], qt.shape[-1], kt.rank,
                         n.attrs["scale"], n.attrs["causal"])
    e.result("MatMul", [p, xs[2]])


def _qkv_heads(e, n, qkv):
    """q, k and v of qkv [N, T, 3D]: Reshape to [N, T, 3, heads, hd], Transpose to
    [3, N, heads, T, hd], Gather each; and (T, D, hd)."""
    _, t, d3 = e.type(n.inputs[0]).shape
    heads = n.attrs["heads"]
    hd = d3 // 3 // heads
    split = e.emit("Transpose", [e.emit("Reshape", [qkv, e.ints([0, t, 3, heads, hd],
                                                                "by_head")])],
                   perm=[2, 0, 3, 1, 4])
    return [e.emit("Gather", [split, e.ints(j, "which")], axis=0) for j in range(3)], \
        (t, d3 // 3, hd)


def attention_qkv(e, n, xs):
    """The heads of qkv, attention (or P v with the probabilities given), the heads
    merged back into [N, T, D]."""
    (q, k, v), (t, d, hd) = _qkv_heads(e, n, xs[0])
    p = xs[1] if len(xs) > 1 else _attention_probs(e, q, k, t, t, hd, 4, n.attrs["scale"],
                                                   n.attrs["causal"])
    merged = e.emit("Transpose", [e.emit("MatMul", [p, v])], perm=[0, 2, 1, 3])
    e.result("Reshape", [merged, e.ints([0, t, d], "merged")])


def attention_qkv_probs(e, n, xs):
    (q, k, _), (t, _, hd) = _qkv_heads(e, n, xs[0])
    p = _attention_probs(e, q, k, t, t, hd, 4, n.attrs["scale"], n.attrs["causal"])
    e.result("Identity", [p])


def reduce(op_type: str):
    """sum, amax, amin (and mean): opset 17's ReduceSum takes the axes as an input, the
    others as an attribute."""
    def export(e, n, xs):
        axes = list(axes_of(n.attrs["axis"], e.type(n.inputs[0]).rank, n.op))
        keep = int(n.attrs["keepdims"])
        if op_type == "ReduceSum":
            e.result(op_type, [xs[0], e.ints(axes, "axes")], keepdims=keep)
        else:
            e.result(op_type, xs, axes=axes, keepdims=keep)
    return export
