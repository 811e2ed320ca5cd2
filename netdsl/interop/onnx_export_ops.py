"""How each netdsl operator is written in ONNX (opset 17): one exporter per operator.

An exporter is `fn(e, n, xs)`: `n` is the netdsl node, `xs` the ONNX names of its inputs
(tensor arguments first, then its parameters and buffers in the order the operator's
`params()` lists them). It emits ONNX nodes through `e` (an `onnx_export.Emitter`) and ends
with `e.result(...)`, the node whose output carries `n`'s value. The forward network is
exported in evaluation mode: dropout is the identity, batchnorm uses its running statistics.
Adding an operator is adding an entry to EXPORTERS; the layer operators' exporters
(convolution, pooling, normalisation, resizing, attention) are in `onnx_export_layers`.
"""
from __future__ import annotations

import math

import numpy as np

from netdsl.errors import InteropError
from netdsl.interop import onnx_export_layers as layers
from netdsl.ir.ops._util import norm_axis


def _same(op_type):
    return lambda e, n, xs: e.result(op_type, xs)


def _linear(e, n, xs):
    if e.type(n.inputs[0]).rank == 2:  # Gemm: y = x W^T + b
        e.result("Gemm", xs, transB=1)
        return
    wt = e.emit("Transpose", [xs[1]], perm=[1, 0])
    if len(xs) == 2:
        e.result("MatMul", [xs[0], wt])
    else:
        e.result("Add", [e.emit("MatMul", [xs[0], wt]), xs[2]])


def _bn_inputs(e, n, xs):
    c = e.type(n.inputs[0]).shape[1]
    if n.attrs["affine"]:
        return xs
    (x, mean, var), w, b = xs, e.const(np.ones(c, np.float32), "scale"), \
        e.const(np.zeros(c, np.float32), "bias")
    return [x, w, b, mean, var]


def _batchnorm(e, n, xs):
    e.result("BatchNormalization", _bn_inputs(e, n, xs), epsilon=n.attrs["eps"])


def _batchnorm_relu(e, n, xs):  # the fuse pass's op: unfused again (relu6's as a Clip)
    y = e.emit("BatchNormalization", _bn_inputs(e, n, xs), epsilon=n.attrs["eps"])
    if n.attrs.get("cap") is None:
        e.result("Relu", [y])
    else:
        _clip(e, n, [y], 0.0, n.attrs["cap"])


def _add_relu(e, n, xs):  # the fuse pass's op: unfused again
    e.result("Relu", [e.emit("Add", xs)])


class _Inner:
    """The exporter as a fused op's first part sees it: its result is a helper node, whose
    output `value` keeps, for the fused op's last node to read."""

    def __init__(self, e):
        self._e = e
        self.value = None

    def result(self, op_type, inputs, **attrs):
        self.value = self._e.emit(op_type, inputs, **attrs)

    def __getattr__(self, name):
        return getattr(self._e, name)


def _plus_residual(export):
    """conv2d_add and linear_add (the fuse pass's ops), unfused again: the layer's nodes
    (from its inputs less the residual, the second), then an Add."""
    def run(e, n, xs):
        inner = _Inner(e)
        export(inner, n, xs[:1] + xs[2:])
        e.result("Add", [inner.value, xs[1]])
    return run


def _scale(e, n, xs):
    e.result("Mul", [xs[0], e.scalar(n.attrs["factor"], "factor")])


def _flatten(e, n, xs):
    s = norm_axis(n.attrs["start"], e.type(n.inputs[0]).rank, "flatten")
    e.result("Reshape", [xs[0], e.ints([0] * s + [-1], "shape")])


def _reshape(e, n, xs):
    e.result("Reshape", [xs[0], e.ints(e.shape_spec(n), "shape")])


def _permute(e, n, xs):
    rank = e.type(n.inputs[0]).rank
    e.result("Transpose", xs, perm=[p % rank for p in n.attrs["dims"]])


def _transpose(e, n, xs):
    rank = e.type(n.inputs[0]).rank
    perm = list(range(rank))
    i, j = n.attrs["dim0"] % rank, n.attrs["dim1"] % rank
    perm[i], perm[j] = perm[j], perm[i]
    e.result("Transpose", xs, perm=perm)


def _dropout_mask(e, n, xs):
    # evaluation mode: all ones, shaped like x
    one = e.onnx.numpy_helper.from_array(np.ones(1, np.float32), "one")
    e.result("ConstantOfShape", [e.emit("Shape", xs[:1])], value=one)


def _embedding(e, n, xs):
    ids, table = xs
    e.result("Gather", [table, ids], axis=0)


def _gelu(e, n, xs):
    x = xs[0]
    half_x = e.emit("Mul", [x, e.scalar(0.5, "half")])
    if n.attrs.get("approximate", "none") == "tanh":
        # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        cube = e.emit("Mul", [e.emit("Mul", [x, x]), x])
        inner = e.emit("Add", [x, e.emit("Mul", [cube, e.scalar(0.044715, "c")])])
        t = e.emit("Tanh", [e.emit("Mul", [inner, e.scalar(math.sqrt(2.0 / math.pi), "k")])])
        e.result("Mul", [half_x, e.emit("Add", [t, e.scalar(1.0, "one")])])
        return
    # x * Phi(x) = 0.5 * x * (1 + erf(x / sqrt 2)): the exact form netdsl computes
    # (opset 20's Gelu is newer than many runtimes)
    erf = e.emit("Erf", [e.emit("Mul", [x, e.scalar(1.0 / math.sqrt(2.0), "inv_sqrt2")])])
    e.result("Mul", [half_x, e.emit("Add", [erf, e.scalar(1.0, "one")])])


def _slice(e, n, xs):
    a = n.attrs
    e.result("Slice", [xs[0], e.ints([a["start"]], "starts"), e.ints([a["stop"]], "ends"),
                       e.ints([a["axis"]], "axes"), e.ints([a.get("step", 1)], "steps")])


def _clip(e, n, xs, lo=None, hi=None):
    lo = n.attrs.get("min") if lo is None else lo
    hi = n.attrs.get("max") if hi is None else hi
    e.result("Clip", [xs[0], "" if lo is None else e.scalar(lo, "min"),
                      "" if hi is None else e.scalar(hi, "max")])


def _silu(e, n, xs):
    e.result("Mul", [xs[0], e.emit("Sigmoid", xs)])


def _mish(e, n, xs):
    # x * tanh(softplus(x)) (ONNX's Mish is opset 18)
    e.result("Mul", [xs[0], e.emit("Tanh", [e.emit("Softplus", xs)])])


def _softplus(e, n, xs):
    # log(1 + e^(beta x)) / beta, x itself where beta x > threshold (as torch)
    beta, x = n.attrs["beta"], xs[0]
    bx = x if beta == 1.0 else e.emit("Mul", [x, e.scalar(beta, "beta")])
    sp = e.emit("Softplus", [bx])
    if beta != 1.0:
        sp = e.emit("Div", [sp, e.scalar(beta, "beta")])
    e.result("Where", [e.emit("Greater", [bx, e.scalar(n.attrs["threshold"], "threshold")]),
                       x, sp])


def _selu(e, n, xs):
    e.result("Selu", xs, alpha=1.6732632423543772848170429916717,
             gamma=1.0507009873554804934193349852946)


def _prelu(e, n, xs):
    x, w = xs
    rank = e.type(n.inputs[0]).rank
    if n.attrs["num_parameters"] > 1:  # one slope per channel: [C, 1, ...] against (N, C, ...)
        w = e.emit("Reshape", [w, e.ints([-1] + [1] * (rank - 2), "slope_shape")])
    e.result("PRelu", [x, w])


def _fill(e, n, xs):
    # a constant (a scalar in an expression, `x - 1`): a Constant of its value
    shape = n.attrs["shape"]
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise InteropError(f"fill %{n.name} has shape {shape}, which is not static; "
                           "export with --batch B", loc=n.loc, stack=n.stack)
    value = np.full(tuple(shape), n.attrs["value"], dtype=_NUMPY[n.attrs["dtype"]])
    e.result("Constant", [], value=e.onnx.numpy_helper.from_array(value, n.name))


def _cast(e, n, xs):
    to = getattr(e.onnx.TensorProto, _ONNX_TYPE[n.attrs["dtype"]])
    e.result("Cast", xs, to=to)


def _squeeze(e, n, xs):
    rank = e.type(n.inputs[0]).rank
    axes = n.attrs["axis"] if isinstance(n.attrs["axis"], tuple) else (n.attrs["axis"],)
    e.result("Squeeze", [xs[0], e.ints(sorted(a % rank for a in axes), "axes")])


def _unsqueeze(e, n, xs):
    rank = e.type(n.inputs[0]).rank + 1
    e.result("Unsqueeze", [xs[0], e.ints([n.attrs["axis"] % rank], "axes")])


def _expand(e, n, xs):
    # ONNX Expand broadcasts: a 1 keeps the input's dimension, as -1 and N do in netdsl
    shape = [d if isinstance(d, int) and d >= 0 else 1 for d in n.attrs["shape"]]
    e.result("Expand", [xs[0], e.ints(shape, "shape")])


# floats run at f32 (as the executor runs them)
_ONNX_TYPE = {"f16": "FLOAT", "f32": "FLOAT", "f64": "FLOAT", "i32": "INT32", "i64": "INT64",
              "bool": "BOOL"}
_NUMPY = {"f16": np.float32, "f32": np.float32, "f64": np.float32, "i32": np.int32,
          "i64": np.int64, "bool": np.bool_}


EXPORTERS = {
    "add": _same("Add"),
    "sub": _same("Sub"),
    "mul": _same("Mul"),
    "scale": _scale,
    "div": _same("Div"),
    "pow": _same("Pow"),
    "maximum": _same("Max"),
    "minimum": _same("Min"),
    "neg": _same("Neg"),
    "abs": _same("Abs"),
    "exp": _same("Exp"),
    "log": _same("Log"),
    "sqrt": _same("Sqrt"),
    "equal": _same("Equal"),
    "greater": _same("Greater"),
    "greater_equal": _same("GreaterOrEqual"),
    "less": _same("Less"),
    "less_equal": _same("LessOrEqual"),
    "where": _same("Where"),
    "cast": _cast,
    "fill": _fill,
    "mean": layers.reduce("ReduceMean"),
    "sum": layers.reduce("ReduceSum"),
    "amax": layers.reduce("ReduceMax"),
    "amin": layers.reduce("ReduceMin"),
    "matmul": _same("MatMul"),
    "linear": _linear,
    "linear_add": _plus_residual(_linear),
    "embedding": _embedding,
    "conv1d": layers.conv(1),
    "conv2d": layers.conv(2),
    "conv2d_add": _plus_residual(layers.conv(2)),
    "conv3d": layers.conv(3),
    "conv_transpose2d": layers.conv_transpose2d,
    "maxpool1d": layers.pool("MaxPool", 1),
    "maxpool": layers.pool("MaxPool", 2),
    "maxpool3d": layers.pool("MaxPool", 3),
    "avgpool1d": layers.pool("AveragePool", 1),
    "avgpool": layers.pool("AveragePool", 2),
    "avgpool3d": layers.pool("AveragePool", 3),
    "global_avgpool": _same("GlobalAveragePool"),
    "global_maxpool": _same("GlobalMaxPool"),
    "adaptive_avgpool": layers.adaptive("AveragePool", "ReduceMean"),
    "adaptive_maxpool": layers.adaptive("MaxPool", "ReduceMax"),
    "batchnorm": _batchnorm,
    "batchnorm_relu": _batchnorm_relu,
    "add_relu": _add_relu,
    "layernorm": layers.layernorm,
    "groupnorm": layers.groupnorm,
    "instancenorm": layers.instancenorm,
    "rmsnorm": layers.rmsnorm,
    "relu": _same("Relu"),
    "leaky_relu": lambda e, n, xs: e.result("LeakyRelu", xs, alpha=n.attrs["slope"]),
    "gelu": _gelu,
    "relu6": lambda e, n, xs: _clip(e, n, xs, 0.0, 6.0),
    "clip": _clip,
    "hardswish": _same("HardSwish"),
    "hardsigmoid": lambda e, n, xs: e.result("HardSigmoid", xs, alpha=1.0 / 6, beta=0.5),
    "silu": _silu,
    "mish": _mish,
    "elu": lambda e, n, xs: e.result("Elu", xs, alpha=n.attrs["alpha"]),
    "selu": _selu,
    "softplus": _softplus,
    "prelu": _prelu,
    "sigmoid": _same("Sigmoid"),
    "tanh": _same("Tanh"),
    "softmax": lambda e, n, xs: e.result("Softmax", xs, axis=n.attrs["axis"]),
    "log_softmax": lambda e, n, xs: e.result("LogSoftmax", xs, axis=n.attrs["axis"]),
    "causal_mask": layers.causal_mask,
    "scaled_dot_product_attention": layers.scaled_dot_product_attention,
    "attention_qkv": layers.attention_qkv,
    "attention_qkv_probs": layers.attention_qkv_probs,
    "dropout": _same("Identity"),  # evaluation mode
    "dropout_mask": _dropout_mask,
    "flatten": _flatten,
    "reshape": _reshape,
    "permute": _permute,
    "transpose": _transpose,
    "concat": lambda e, n, xs: e.result("Concat", xs, axis=n.attrs["axis"]),
    "slice": _slice,
    "squeeze": _squeeze,
    "unsqueeze": _unsqueeze,
    "expand": _expand,
    "gather": lambda e, n, xs: e.result("Gather", xs, axis=n.attrs["axis"]),
    "gather_elements": lambda e, n, xs: e.result("GatherElements", xs, axis=n.attrs["axis"]),
    "pad": layers.pad,
    "upsample": layers.upsample,
}

# forward operators deliberately without an export: the losses (the exported model is the
# network's outputs; its loss needs labels)
NOT_EXPORTED = {op: "a loss" for op in ("softmax_cross_entropy", "mse", "nll", "l1",
                                        "smooth_l1", "bce_with_logits")}
