"""How each ONNX operator becomes netdsl operator calls: one importer per ONNX op type.

An importer is `fn(r, node, at)`: `r` is the `onnx_import.Reader` (constants, inferred
shapes, the calls made so far), `node` the ONNX NodeProto, `at` its attributes as a dict.
It adds netdsl calls with `r.call(op, args, attrs, params, out)`, makes its output another
name for an input with `r.alias(out, src)`, or raises `Unsupported(reason)` for a form
netdsl cannot express (asymmetric padding, ceil_mode...), which is reported with every
other unsupported node in one error. Adding an ONNX operator is adding an entry to
IMPORTERS.
"""
from __future__ import annotations

import numpy as np


class Unsupported(Exception):
    """This node's configuration has no netdsl form; the message says which."""


def _need(cond: bool, reason: str) -> None:
    if not cond:
        raise Unsupported(reason)


def _pads(at, d: int, what: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(begins, ends) of a Conv's or pool's pads (auto_pad VALID is none)."""
    _need(at.get("auto_pad", "NOTSET") in ("NOTSET", "VALID"),
          f"{what} with auto_pad={at.get('auto_pad')}")
    pads = [int(p) for p in at.get("pads", [0] * (2 * d))]
    if at.get("auto_pad") == "VALID":
        pads = [0] * (2 * d)
    return tuple(pads[:d]), tuple(pads[d:])


def _one(v):
    """A per-dimension tuple as netdsl writes it: one int where all agree."""
    t = tuple(int(x) for x in v)
    return t[0] if len(set(t)) == 1 else t


def _padding(begins, ends):
    return _one(begins) if begins == ends else tuple(begins) + tuple(ends)


_CONV = {1: "conv1d", 2: "conv2d", 3: "conv3d"}


def _conv(r, node, at):
    w = r.const(node.input[1])
    _need(w is not None, "Conv whose weight is not a constant")
    d = w.ndim - 2
    _need(d in _CONV, f"Conv with a {d}-d kernel")
    bias = r.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    params = {"weight": w} if bias is None else {"weight": w, "bias": bias}
    strides = at.get("strides", [1] * d)
    dil = at.get("dilations", [1] * d)
    if at.get("auto_pad") in ("SAME_UPPER", "SAME_LOWER"):
        # netdsl's "same" is stride 1 with the odd pad at the end (SAME_UPPER)
        _need(at["auto_pad"] == "SAME_UPPER" and all(int(s) == 1 for s in strides),
              f"Conv with auto_pad={at['auto_pad']} and strides {list(strides)}")
        padding = "same"
    else:
        padding = _padding(*_pads(at, d, "Conv"))
    attrs = {"out_channels": int(w.shape[0]),
             "kernel": _one(at.get("kernel_shape", w.shape[2:])),
             "stride": _one(strides), "padding": padding, "dilation": _one(dil),
             "groups": int(at.get("group", 1)), "bias": bias is not None}
    r.call(_CONV[d], [node.input[0]], attrs, params, node.output[0])


def _conv_transpose(r, node, at):
    w = r.const(node.input[1])
    _need(w is not None and w.ndim == 4, "ConvTranspose other than 2-d with a constant weight")
    _need("output_shape" not in at, "ConvTranspose with output_shape")
    begins, ends = _pads(at, 2, "ConvTranspose")
    _need(begins == ends, f"ConvTranspose with asymmetric pads {list(at.get('pads'))}")
    bias = r.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    params = {"weight": w} if bias is None else {"weight": w, "bias": bias}
    g = int(at.get("group", 1))
    attrs = {"out_channels": int(w.shape[1]) * g,
             "kernel": _one(at.get("kernel_shape", w.shape[2:])),
             "stride": _one(at.get("strides", [1, 1])), "padding": _one(begins),
             "output_padding": _one(at.get("output_padding", [0, 0])),
             "dilation": _one(at.get("dilations", [1, 1])), "groups": g,
             "bias": bias is not None}
    r.call("conv_transpose2d", [node.input[0]], attrs, params, node.output[0])


def _batchnorm(r, node, at):
    _need(not at.get("training_mode", 0), "BatchNormalization with training_mode=1")
    scale, bias, mean, var = (r.const(i) for i in node.input[1:5])
    _need(all(v is not None for v in (scale, bias, mean, var)),
          "BatchNormalization whose scale, bias or statistics are not constants")
    # ONNX keeps (momentum) of the running value, netdsl (like torch) takes (momentum) of the
    # new batch statistic
    attrs = {"eps": float(at.get("epsilon", 1e-5)),
             "momentum": round(1.0 - float(at.get("momentum", 0.9)), 6), "affine": True}
    r.call("batchnorm", [node.input[0]], attrs,
           {"weight": scale, "bias": bias, "running_mean": mean, "running_var": var},
           node.output[0])


def _same(op):
    return lambda r, node, at: r.call(op, [node.input[0]], {}, {}, node.output[0])


def _scalar_value(c: np.ndarray):
    v = c.reshape(())
    return int(v) if np.issubdtype(c.dtype, np.integer) else float(v)


def _binary(op):
    """An element-wise operator of two operands (Min and Max: of several). A one-element
    constant operand is a scalar in the expression (`x - 1.0`, `max(x, 0.0)`: the call's
    `scalar` attribute, (position, value)); a multiplication or division by one is `scale`;
    another constant operand is a trainable parameter (a positional table)."""
    def imp(r, node, at):
        if len(node.input) > 2:  # Min, Max of several: a chain of pairs
            _need(all(r.const(i) is None for i in node.input), f"{node.op_type} of "
                  "several operands with a constant among them")
            acc = node.input[0]
            for k, b in enumerate(node.input[1:], 1):
                out = node.output[0] if k == len(node.input) - 1 else f"{node.output[0]}/{k}"
                r.call(op, [acc, b], {}, {}, out)
                acc = out
            return
        a, b = node.input[0], node.input[1]
        ca, cb = r.const(a), r.const(b)
        if ca is None and cb is None:
            r.call(op, [a, b], {}, {}, node.output[0])
            return
        _need(ca is None or cb is None, f"{node.op_type} of two constants")
        c, x = (ca, b) if ca is not None else (cb, a)
        if op == "mul" and c.size == 1:
            r.call("scale", [x], {"factor": float(c.reshape(()))}, {}, node.output[0])
            return
        if op == "div" and cb is not None and c.size == 1 and float(c.reshape(())) != 0.0:
            r.call("scale", [x], {"factor": 1.0 / float(c.reshape(()))}, {}, node.output[0])
            return
        if op == "add" and cb is not None and r.add_bias(x, cb, node.output[0]):
            return
        if c.size == 1 and len(r.shape(node.output[0])) == len(r.shape(x)):
            r.call(op, [x], {"scalar": (0 if ca is not None else 1, _scalar_value(c))}, {},
                   node.output[0])
            return
        # any other constant operand (a positional table) becomes a trainable parameter
        _need(c.ndim >= 1 and c.size > 1, f"{node.op_type} with a constant operand")
        p = r.parameter(c, node.output[0])
        r.call(op, [p, b] if ca is not None else [a, p], {}, {}, node.output[0])
    return imp


def _where(r, node, at):
    c, a, b = node.input
    ca, cb = r.const(a), r.const(b)
    mask = r.const(c)
    if mask is not None:
        _causal_mask(r, node, mask, ca, cb)
        return
    _need(all(v is None or v.size == 1 for v in (ca, cb)) and (ca is None or cb is None),
          "Where with a constant operand other than one scalar")
    if ca is None and cb is None:
        r.call("where", [c, a, b], {}, {}, node.output[0])
    elif ca is not None:
        r.call("where", [c, b], {"scalar": (1, _scalar_value(ca))}, {}, node.output[0])
    else:
        r.call("where", [c, a], {"scalar": (2, _scalar_value(cb))}, {}, node.output[0])


def _causal_mask(r, node, mask, ca, cb):
    """Where(future, value, scores) with `future` true above the diagonal of the last two
    dimensions (netdsl's and PyTorch's causal attention): `causal_mask`. An infinite value
    becomes netdsl's finite -1e9 (a following softmax gives those keys weight exactly 0
    either way)."""
    m = mask.reshape(mask.shape[-2:]) if mask.ndim >= 2 and mask.size == np.prod(
        mask.shape[-2:]) else None
    _need(m is not None and ca is not None and ca.size == 1 and cb is None
          and m.dtype == bool and np.array_equal(m, np.triu(np.ones(m.shape, bool), k=1))
          and tuple(r.shape(node.input[2])[-2:]) == m.shape,
          "Where with a constant condition other than a causal mask")
    value = float(ca.reshape(()))
    r.call("causal_mask", [node.input[2]], {"value": value if np.isfinite(value) else -1e9},
           {}, node.output[0])


def _clip(r, node, at):
    def bound(i, key):
        if len(node.input) > i and node.input[i]:
            v = r.const(node.input[i])
            _need(v is not None, "Clip with bounds that are not constants")
            return float(v.reshape(()))
        return float(at[key]) if key in at else None  # opset < 11: attributes
    lo, hi = bound(1, "min"), bound(2, "max")
    if lo == 0.0 and hi == 6.0:
        r.call("relu6", [node.input[0]], {}, {}, node.output[0])
        return
    _need(lo is not None or hi is not None, "Clip without bounds")
    attrs = {k: v for k, v in (("min", lo), ("max", hi)) if v is not None}
    r.call("clip", [node.input[0]], attrs, {}, node.output[0])


def _hardsigmoid(r, node, at):
    alpha, beta = float(at.get("alpha", 0.2)), float(at.get("beta", 0.5))
    _need(abs(alpha - 1 / 6) < 1e-6 and abs(beta - 0.5) < 1e-6,
          f"HardSigmoid with alpha={alpha:g}, beta={beta:g} (netdsl's is relu6(x + 3) / 6)")
    r.call("hardsigmoid", [node.input[0]], {}, {}, node.output[0])


def _matmul(r, node, at):
    a, b = node.input
    w = r.const(b)
    if w is None:
        _need(r.const(a) is None, "MatMul with a constant first operand")
        r.call("matmul", [a, b], {}, {}, node.output[0])
        return
    _need(w.ndim == 2, "MatMul with a constant of rank other than 2")
    r.call("linear", [a], {"out_features": int(w.shape[1]), "bias": False},
           {"weight": np.ascontiguousarray(w.T)}, node.output[0])


def _gemm(r, node, at):
    w = r.const(node.input[1])
    _need(w is not None and r.const(node.input[0]) is None,
          "Gemm whose second operand is not a constant weight")
    _need(float(at.get("alpha", 1.0)) == 1.0 and float(at.get("beta", 1.0)) == 1.0
          and not at.get("transA", 0), "Gemm with alpha, beta or transA")
    w = w if at.get("transB", 0) else w.T
    c = r.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    params = {"weight": np.ascontiguousarray(w)}
    if c is not None:
        _need(c.size == w.shape[0], "Gemm with a bias that is not one value per output")
        params["bias"] = np.broadcast_to(c, (w.shape[0],)).reshape(w.shape[0])
    r.call("linear", [node.input[0]], {"out_features": int(w.shape[0]), "bias": c is not None},
           params, node.output[0])


_POOL_SUFFIX = {1: "1d", 2: "", 3: "3d"}


def _pool(op, onnx_op):
    def imp(r, node, at):
        k = [int(v) for v in at.get("kernel_shape", [])]
        d = len(k)
        _need(d in _POOL_SUFFIX, f"{onnx_op} over {d} dimensions")
        _need(all(int(v) == 1 for v in at.get("dilations", [1] * d)), f"{onnx_op} with dilations")
        _need(len(node.output) == 1 or not node.output[1], f"{onnx_op} with indices output")
        _need(at.get("storage_order", 0) == 0, f"{onnx_op} with storage_order=1")
        begins, ends = _pads(at, d, onnx_op)
        strides = [int(v) for v in at.get("strides", [1] * d)]
        include = bool(at.get("count_include_pad", 0))
        x = node.input[0]
        if begins != ends:
            # the pads go in front as an explicit pad (with the smallest float for max
            # pooling, zeros for an average that counts them), the pool pads nothing
            _need(op == "maxpool" or include or not any(begins + ends),
                  "AveragePool with asymmetric pads and count_include_pad=0")
            pads = [v for b, e in zip(begins[::-1], ends[::-1]) for v in (b, e)]
            x = f"{node.output[0]}/pad"
            r.call("pad", [node.input[0]],
                   {"pads": tuple(pads),
                    "value": float(np.finfo(np.float32).min) if op == "maxpool" else 0.0},
                   {}, x)
            begins = ends = (0,) * d
        _need(all(p <= kk // 2 for p, kk in zip(begins, k)),
              f"{onnx_op} padded by more than half its kernel")
        attrs = {"kernel": _one(k), "stride": _one(strides), "padding": _one(begins)}
        if at.get("ceil_mode", 0):
            attrs["ceil_mode"] = True
        if op == "avgpool" and not include and any(begins):
            attrs["count_include_pad"] = False
        r.call(op + _POOL_SUFFIX[d], [x], attrs, {}, node.output[0])
    return imp


def _flatten(r, node, at):
    axis = int(at.get("axis", 1))
    _need(axis == 1, f"Flatten with axis={axis}")
    r.call("flatten", [node.input[0]], {}, {}, node.output[0])


def _reshape(r, node, at):
    shape = r.const(node.input[1])
    _need(shape is not None, "Reshape to a computed (not constant) shape")
    _need(not at.get("allowzero", 0), "Reshape with allowzero=1")
    src = r.shape(node.input[0])
    target: list = [int(d) for d in shape]
    for i, d in enumerate(target):
        if d == 0:
            _need(i < len(src), "Reshape copying a dimension the input lacks")
            target[i] = src[i]
    # the batch stays first: a target that starts with it (copied, or -1 with every other
    # dimension static) is written with N
    if target and (target[0] == src[0] or (target[0] == -1 and -1 not in target[1:])):
        target[0] = "N"
    _need(target and target[0] == "N", "Reshape that does not keep the batch dimension first")
    r.call("reshape", [node.input[0]], {"shape": tuple(target)}, {}, node.output[0])


def _transpose(r, node, at):
    perm = [int(p) for p in at["perm"]]
    _need(perm[0] == 0, "Transpose that moves the batch dimension")
    r.call("permute", [node.input[0]], {"dims": tuple(perm)}, {}, node.output[0])


def _concat(r, node, at):
    _need(all(r.const(i) is None for i in node.input), "Concat with a constant operand")
    r.call("concat", list(node.input), {"axis": int(at["axis"])}, {}, node.output[0])


def _softmax(r, node, at):
    r.call("softmax", [node.input[0]], {"axis": int(at.get("axis", -1))}, {}, node.output[0])


def _reduce(op, onnx_op):
    def imp(r, node, at):
        axes = at.get("axes")
        if axes is None and len(node.input) > 1 and node.input[1]:
            c = r.const(node.input[1])
            _need(c is not None, f"{onnx_op} over axes that are not constants")
            axes = [int(a) for a in c]
        rank = len(r.shape(node.input[0]))
        _need(axes is not None and len(axes) > 0, f"{onnx_op} over every axis (the batch too)")
        axes = sorted(int(a) % rank for a in axes)
        _need(0 not in axes, f"{onnx_op} over the batch dimension")
        r.call(op, [node.input[0]], {"axis": axes[0] if len(axes) == 1 else tuple(axes),
                                     "keepdims": bool(at.get("keepdims", 1))},
               {}, node.output[0])
    return imp


def _gather(r, node, at):
    table = r.const(node.input[0])
    _need(table is not None and table.ndim == 2 and int(at.get("axis", 0)) == 0,
          "Gather other than an embedding lookup (rows of a constant table)")
    r.call("embedding", [node.input[1]], {"num": int(table.shape[0]), "dim": int(table.shape[1])},
           {"weight": table}, node.output[0])


def _layernorm(r, node, at):
    rank = len(r.shape(node.input[0]))
    _need(int(at.get("axis", -1)) in (-1, rank - 1), "LayerNormalization over more than the "
          "last dimension")
    scale = r.const(node.input[1])
    bias = r.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    _need(scale is not None, "LayerNormalization whose scale is not a constant")
    if bias is None:
        bias = np.zeros_like(scale)
    r.call("layernorm", [node.input[0]], {"eps": float(at.get("epsilon", 1e-5)), "affine": True},
           {"weight": scale, "bias": bias}, node.output[0])


def _slice(r, node, at):
    starts, ends = r.const(node.input[1]), r.const(node.input[2])
    axes = r.const(node.input[3]) if len(node.input) > 3 and node.input[3] else None
    steps = r.const(node.input[4]) if len(node.input) > 4 and node.input[4] else None
    _need(starts is not None and ends is not None and starts.size == 1,
          "Slice other than a constant range along one axis")
    step = 1 if steps is None else int(steps.reshape(-1)[0])
    _need(step > 0, "Slice with a negative step")
    shape = r.shape(node.input[0])
    axis = int(axes.reshape(-1)[0]) if axes is not None else 0
    axis %= len(shape)
    size = shape[axis]
    _need(axis > 0 and isinstance(size, int), "Slice along the batch dimension")
    start, stop = (int(np.clip(v + size if v < 0 else v, 0, size))
                   for v in (int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])))
    attrs = {"axis": axis, "start": start, "stop": stop}
    if step != 1:
        attrs["step"] = step
    r.call("slice", [node.input[0]], attrs, {}, node.output[0])


def _split(r, node, at):
    shape = r.shape(node.input[0])
    axis = int(at.get("axis", 0)) % len(shape)
    size = shape[axis]
    _need(axis > 0 and isinstance(size, int), "Split along the batch dimension")
    sizes = r.const(node.input[1]) if len(node.input) > 1 and node.input[1] else None
    if sizes is None:
        sizes = at.get("split")  # opset < 13 keeps the sizes in an attribute
    k = len(node.output)
    if sizes is None:  # equal parts, the last one smaller if it must be (opset 18)
        step = -(-size // k)
        sizes = [min(step, size - i * step) for i in range(k)]
    start = 0
    for out, n in zip(node.output, [int(v) for v in np.asarray(sizes).reshape(-1)]):
        r.call("slice", [node.input[0]], {"axis": axis, "start": start, "stop": start + n}, {},
               out)
        start += n


def _gelu(r, node, at):
    _need(at.get("approximate", "none") == "none", "Gelu with the tanh approximation")
    r.call("gelu", [node.input[0]], {}, {}, node.output[0])


_LINEAR = {3: "linear", 4: "bilinear", 5: "trilinear"}


def _resize(r, node, at):
    mode = at.get("mode", "nearest")
    ct = at.get("coordinate_transformation_mode", "half_pixel")
    x_shape, out_shape = r.shape(node.input[0]), r.shape(node.output[0])
    rank = len(x_shape)
    _need(3 <= rank <= 5, f"Resize of a {rank}-d tensor")
    # (shape inference may lose the channels behind a computed Pad; a resize of them, if
    # there were one, would fail the check of the imported network's output shapes)
    _need(all(isinstance(v, int) for v in out_shape[2:])
          and (not isinstance(out_shape[1], int) or out_shape[1] == x_shape[1]),
          "Resize of other than the spatial dimensions, or to sizes not known statically")
    _need("axes" not in at and not at.get("antialias", 0), "Resize with axes or antialias")
    size = tuple(int(v) for v in out_shape[2:])
    if mode == "nearest":
        _need(ct == "asymmetric" and at.get("nearest_mode", "round_prefer_floor") == "floor",
              f"Resize nearest with {ct} coordinates and nearest_mode="
              f"{at.get('nearest_mode', 'round_prefer_floor')} (netdsl's is torch's: "
              "asymmetric, floor)")
        attrs = {"mode": "nearest"}
    else:
        _need(mode == "linear", f"Resize with mode={mode}")
        _need(ct in ("align_corners", "pytorch_half_pixel")
              or ct == "half_pixel" and min(size) > 1,
              f"Resize linear with {ct} coordinates")
        attrs = {"mode": _LINEAR[rank], "align_corners": ct == "align_corners"}
    scales = r.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if scales is not None and scales.size == rank and len(set(scales[2:].tolist())) == 1 \
            and list(scales[:2]) == [1.0, 1.0]:
        attrs["scale_factor"] = float(scales[2])  # torch's coordinates use 1 / factor
    else:
        attrs["size"] = size
    r.call("upsample", [node.input[0]], attrs, {}, node.output[0])


_PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "replicate"}


def _pad(r, node, at):
    mode = at.get("mode", "constant")
    _need(mode in _PAD_MODES, f"Pad with mode={mode}")
    pads = r.const(node.input[1]) if len(node.input) > 1 and node.input[1] else \
        np.asarray(at.get("pads", []))
    _need(pads is not None and pads.size > 0, "Pad by amounts that are not constants")
    _need(len(node.input) < 4 or not node.input[3], "Pad with axes")
    value = 0.0
    if len(node.input) > 2 and node.input[2]:
        v = r.const(node.input[2])
        _need(v is not None, "Pad with a value that is not a constant")
        value = float(v.reshape(()))
    elif "value" in at:
        value = float(at["value"])
    pads = [int(p) for p in pads.reshape(-1)]
    rank = len(pads) // 2
    begins, ends = pads[:rank], pads[rank:]
    _need(min(pads) >= 0, "Pad with negative amounts (a crop)")
    _need(begins[0] == ends[0] == 0, "Pad of the batch dimension")
    # torch's order: (left, right) of the last dimension, then the one before ...
    first = min((i for i in range(1, rank) if begins[i] or ends[i]), default=rank - 1)
    flat = [v for i in range(rank - 1, first - 1, -1) for v in (begins[i], ends[i])]
    attrs = {"pads": tuple(flat)}
    if _PAD_MODES[mode] != "constant":
        attrs["mode"] = _PAD_MODES[mode]
    elif value != 0.0:
        attrs["value"] = value
    r.call("pad", [node.input[0]], attrs, {}, node.output[0])


def _instancenorm(r, node, at):
    scale, bias = r.const(node.input[1]), r.const(node.input[2])
    _need(scale is not None and bias is not None,
          "InstanceNormalization whose scale or bias is not a constant")
    r.call("instancenorm", [node.input[0]], {"eps": float(at.get("epsilon", 1e-5)),
                                             "affine": True},
           {"weight": scale, "bias": bias}, node.output[0])


def _log_softmax(r, node, at):
    r.call("log_softmax", [node.input[0]], {"axis": int(at.get("axis", -1))}, {},
           node.output[0])


def _selu(r, node, at):
    alpha, gamma = float(at.get("alpha", 1.67326319217681884765625)), \
        float(at.get("gamma", 1.05070102214813232421875))
    _need(abs(alpha - 1.6732632) < 1e-6 and abs(gamma - 1.0507010) < 1e-6,
          "Selu with other than the self-normalising constants")
    r.call("selu", [node.input[0]], {}, {}, node.output[0])


def _prelu(r, node, at):
    slope = r.const(node.input[1])
    _need(slope is not None, "PRelu whose slope is not a constant")
    shape = r.shape(node.input[0])
    k = int(slope.size)
    # one shared slope, or one per channel ([C] or [C, 1, ...] against (N, C, ...))
    _need(k == 1 or len(shape) >= 2 and shape[1] == k and
          slope.reshape(-1).shape[0] == k and slope.ndim in (1, len(shape) - 1),
          "PRelu with a slope other than one shared or one per channel")
    r.call("prelu", [node.input[0]], {"num_parameters": k}, {"weight": slope.reshape(k)},
           node.output[0])


_CAST = {1: "f32", 11: "f32", 10: "f32", 7: "i64", 6: "i32", 9: "bool"}  # TensorProto codes


def _cast(r, node, at):
    to = int(at["to"])
    _need(to in _CAST, f"Cast to ONNX type {to}")
    r.call("cast", [node.input[0]], {"dtype": _CAST[to]}, {}, node.output[0])


def _squeeze(r, node, at):
    axes = r.const(node.input[1]) if len(node.input) > 1 and node.input[1] else at.get("axes")
    _need(axes is not None, "Squeeze without constant axes")
    axes = tuple(int(a) for a in np.asarray(axes).reshape(-1))
    r.call("squeeze", [node.input[0]], {"axis": axes[0] if len(axes) == 1 else axes}, {},
           node.output[0])


def _unsqueeze(r, node, at):
    axes = r.const(node.input[1]) if len(node.input) > 1 and node.input[1] else at.get("axes")
    _need(axes is not None, "Unsqueeze without constant axes")
    axes = sorted(int(a) for a in np.asarray(axes).reshape(-1))
    rank = len(r.shape(node.input[0])) + len(axes)
    src, out = node.input[0], node.output[0]
    for k, ax in enumerate(sorted(a % rank for a in axes)):
        dst = out if k == len(axes) - 1 else f"{out}/{k}"
        r.call("unsqueeze", [src], {"axis": ax}, {}, dst)
        src = dst


def _expand(r, node, at):
    _need(r.const(node.input[1]) is not None, "Expand to a computed shape")
    src, out = r.shape(node.input[0]), r.shape(node.output[0])
    _need(len(out) == len(src) and not isinstance(src[0], int),
          "Expand that adds dimensions or has no batch first")
    # -1 keeps a dimension, as netdsl writes it; the batch stays N
    target = tuple("N" if i == 0 else -1 if o == d else o
                   for i, (o, d) in enumerate(zip(out, src)))
    _need(all(isinstance(t, int) or t == "N" for t in target), "Expand to unknown sizes")
    r.call("expand", [node.input[0]], {"shape": target}, {}, node.output[0])


def _identity(r, node, at):
    r.alias(node.output[0], node.input[0])


IMPORTERS = {
    "Conv": _conv,
    "ConvTranspose": _conv_transpose,
    "BatchNormalization": _batchnorm,
    "Relu": _same("relu"),
    "Sigmoid": _same("sigmoid"),
    "Tanh": _same("tanh"),
    "LeakyRelu": lambda r, node, at: r.call("leaky_relu", [node.input[0]],
                                            {"slope": float(at.get("alpha", 0.01))}, {},
                                            node.output[0]),
    "Add": _binary("add"),
    "Sub": _binary("sub"),
    "Mul": _binary("mul"),
    "Div": _binary("div"),
    "Pow": _binary("pow"),
    "Min": _binary("minimum"),
    "Max": _binary("maximum"),
    "Where": _where,
    "Greater": _binary("greater"),
    "Less": _binary("less"),
    "GreaterOrEqual": _binary("greater_equal"),
    "LessOrEqual": _binary("less_equal"),
    "Equal": _binary("equal"),
    "Cast": _cast,
    "Sqrt": _same("sqrt"),
    "Exp": _same("exp"),
    "Log": _same("log"),
    "Abs": _same("abs"),
    "Neg": _same("neg"),
    "Clip": _clip,
    "HardSwish": _same("hardswish"),
    "HardSigmoid": _hardsigmoid,
    "Elu": lambda r, node, at: r.call("elu", [node.input[0]],
                                      {"alpha": float(at.get("alpha", 1.0))}, {},
                                      node.output[0]),
    "Selu": _selu,
    "Softplus": _same("softplus"),
    "PRelu": _prelu,
    "MatMul": _matmul,
    "Gemm": _gemm,
    "MaxPool": _pool("maxpool", "MaxPool"),
    "AveragePool": _pool("avgpool", "AveragePool"),
    "GlobalAveragePool": _same("global_avgpool"),
    "GlobalMaxPool": _same("global_maxpool"),
    "Resize": _resize,
    "Pad": _pad,
    "Flatten": _flatten,
    "Reshape": _reshape,
    "Transpose": _transpose,
    "Squeeze": _squeeze,
    "Expand": _expand,
    "Unsqueeze": _unsqueeze,
    "Concat": _concat,
    "Softmax": _softmax,
    "LogSoftmax": _log_softmax,
    "ReduceMean": _reduce("mean", "ReduceMean"),
    "ReduceSum": _reduce("sum", "ReduceSum"),
    "ReduceMax": _reduce("amax", "ReduceMax"),
    "ReduceMin": _reduce("amin", "ReduceMin"),
    "Gather": _gather,
    "LayerNormalization": _layernorm,
    "InstanceNormalization": _instancenorm,
    "Slice": _slice,
    "Split": _split,
    "Gelu": _gelu,  # also what the erf form of gelu is fused into (onnx_patterns)
    "Identity": _identity,
    "Dropout": _identity,  # inference graphs: dropout is the identity
}
