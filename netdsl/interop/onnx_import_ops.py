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


def _pads2d(at, what: str) -> tuple[int, int]:
    _need(at.get("auto_pad", "NOTSET") in ("NOTSET", b"NOTSET", "VALID", b"VALID"),
          f"{what} with auto_pad={at.get('auto_pad')}")
    t, left, b, r = at.get("pads", [0, 0, 0, 0])
    _need((t, left) == (b, r), f"{what} with asymmetric pads {list(at['pads'])}")
    return int(t), int(left)


def _pair(v):
    a, b = int(v[0]), int(v[1])
    return a if a == b else (a, b)


def _conv(r, node, at):
    w = r.const(node.input[1])
    _need(w is not None, "Conv whose weight is not a constant")
    _need(w.ndim == 4, f"Conv with a {w.ndim - 2}-d kernel (netdsl has conv2d)")
    bias = r.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    params = {"weight": w} if bias is None else {"weight": w, "bias": bias}
    attrs = {"out_channels": int(w.shape[0]),
             "kernel": _pair(at.get("kernel_shape", w.shape[2:])),
             "stride": _pair(at.get("strides", [1, 1])),
             "padding": _pair(_pads2d(at, "Conv")),
             "dilation": _pair(at.get("dilations", [1, 1])),
             "groups": int(at.get("group", 1)), "bias": bias is not None}
    r.call("conv2d", [node.input[0]], attrs, params, node.output[0])


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


def _binary(op):
    def imp(r, node, at):
        a, b = node.input[0], node.input[1]
        ca, cb = r.const(a), r.const(b)
        if ca is None and cb is None:
            r.call(op, [a, b], {}, {}, node.output[0])
            return
        c, x = (ca, b) if ca is not None else (cb, a)
        if op == "mul" and c.size == 1:
            r.call("scale", [x], {"factor": float(c.reshape(()))}, {}, node.output[0])
            return
        if op == "add" and cb is not None and r.add_bias(x, cb, node.output[0]):
            return
        # any other constant operand (a positional table) becomes a trainable parameter
        _need(c.ndim >= 1 and c.size > 1, f"{node.op_type} with a constant operand")
        p = r.parameter(c, node.output[0])
        r.call(op, [p, b] if ca is not None else [a, p], {}, {}, node.output[0])
    return imp


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


def _pool(op, onnx_op):
    def imp(r, node, at):
        k = at.get("kernel_shape", [])
        _need(len(k) == 2, f"{onnx_op} over {len(k)} dimensions (netdsl pools 2-d)")
        _need(list(at.get("dilations", [1, 1])) == [1, 1], f"{onnx_op} with dilations")
        _need(len(node.output) == 1 or not node.output[1], f"{onnx_op} with indices output")
        pad = _pads2d(at, onnx_op)
        strides = at.get("strides", [1, 1])
        if at.get("ceil_mode", 0):
            # ceil mode adds a last, partial window only where the windows do not tile the
            # padded input exactly; where they do (SqueezeNet at 224 or 64), it is floor mode
            size = r.shape(node.input[0])[2:]
            _need(all(isinstance(d, int) and (d + 2 * p - kk) % st == 0
                      for d, p, kk, st in zip(size, pad, k, strides)),
                  f"{onnx_op} with ceil_mode=1 where it adds a partial window")
        if op == "avgpool" and max(pad) > 0:
            _need(at.get("count_include_pad", 0) == 1, "AveragePool with count_include_pad=0")
        _need(pad[0] <= k[0] // 2 and pad[1] <= k[1] // 2,
              f"{onnx_op} padded by more than half its kernel")
        r.call(op, [node.input[0]], {"kernel": _pair(k), "stride": _pair(strides),
                                     "padding": _pair(pad)}, {}, node.output[0])
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


def _reduce_mean(r, node, at):
    axes = at.get("axes")
    if axes is None and len(node.input) > 1:
        c = r.const(node.input[1])
        axes = None if c is None else [int(a) for a in c]
    _need(axes is not None and len(axes) == 1, "ReduceMean over other than exactly one axis")
    r.call("mean", [node.input[0]], {"axis": int(axes[0]),
                                     "keepdims": bool(at.get("keepdims", 1))},
           {}, node.output[0])


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
    _need(steps is None or int(steps.reshape(-1)[0]) == 1, "Slice with a step")
    shape = r.shape(node.input[0])
    axis = int(axes.reshape(-1)[0]) if axes is not None else 0
    axis %= len(shape)
    size = shape[axis]
    _need(axis > 0 and isinstance(size, int), "Slice along the batch dimension")
    start, stop = (int(np.clip(v + size if v < 0 else v, 0, size))
                   for v in (int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])))
    r.call("slice", [node.input[0]], {"axis": axis, "start": start, "stop": stop}, {},
           node.output[0])


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


def _identity(r, node, at):
    r.alias(node.output[0], node.input[0])


IMPORTERS = {
    "Conv": _conv,
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
    "MatMul": _matmul,
    "Gemm": _gemm,
    "MaxPool": _pool("maxpool", "MaxPool"),
    "AveragePool": _pool("avgpool", "AveragePool"),
    "GlobalAveragePool": _same("global_avgpool"),
    "Flatten": _flatten,
    "Reshape": _reshape,
    "Transpose": _transpose,
    "Concat": _concat,
    "Softmax": _softmax,
    "ReduceMean": _reduce_mean,
    "Gather": _gather,
    "LayerNormalization": _layernorm,
    "Slice": _slice,
    "Split": _split,
    "Gelu": _gelu,  # also what the erf form of gelu is fused into (onnx_patterns)
    "Identity": _identity,
    "Dropout": _identity,  # inference graphs: dropout is the identity
}
