"""How each netdsl operator is written in ONNX (opset 17): one exporter per operator.

An exporter is `fn(e, n, xs)`: `n` is the netdsl node, `xs` the ONNX names of its inputs
(tensor arguments first, then its parameters and buffers in the order the operator's
`params()` lists them). It emits ONNX nodes through `e` (an `onnx_export.Emitter`) and ends
with `e.result(...)`, the node whose output carries `n`'s value. The forward network is
exported in evaluation mode: dropout is the identity, batchnorm uses its running statistics.
Adding an operator is adding an entry to EXPORTERS.
"""
from __future__ import annotations

import math

import numpy as np

from netdsl.ir.ops._util import norm_axis, pair


def _same(op_type):
    return lambda e, n, xs: e.result(op_type, xs)


def _conv2d(e, n, xs):
    a = n.attrs
    ph, pw = pair(a["padding"])
    e.result("Conv", xs, kernel_shape=list(pair(a["kernel"])), strides=list(pair(a["stride"])),
             pads=[ph, pw, ph, pw], dilations=list(pair(a["dilation"])), group=a["groups"])


def _pool(op_type, **extra):
    def export(e, n, xs):
        a = n.attrs
        ph, pw = pair(a["padding"])
        e.result(op_type, xs, kernel_shape=list(pair(a["kernel"])),
                 strides=list(pair(a["stride"])), pads=[ph, pw, ph, pw], **extra)
    return export


def _linear(e, n, xs):
    if e.type(n.inputs[0]).rank == 2:  # Gemm: y = x W^T + b
        e.result("Gemm", xs, transB=1)
        return
    wt = e.emit("Transpose", [xs[1]], perm=[1, 0])
    if len(xs) == 2:
        e.result("MatMul", [xs[0], wt])
    else:
        e.result("Add", [e.emit("MatMul", [xs[0], wt]), xs[2]])


def _batchnorm(e, n, xs):
    c = e.type(n.inputs[0]).shape[1]
    if n.attrs["affine"]:
        x, w, b, mean, var = xs
    else:
        (x, mean, var), w, b = xs, e.const(np.ones(c, np.float32), "scale"), \
            e.const(np.zeros(c, np.float32), "bias")
    e.result("BatchNormalization", [x, w, b, mean, var], epsilon=n.attrs["eps"])


def _layernorm(e, n, xs):
    if n.attrs["affine"]:
        ins = xs
    else:
        d = e.type(n.inputs[0]).shape[-1]
        ins = [xs[0], e.const(np.ones(d, np.float32), "scale")]
    e.result("LayerNormalization", ins, axis=-1, epsilon=n.attrs["eps"])


def _gelu(e, n, xs):
    # x * Phi(x) = 0.5 * x * (1 + erf(x / sqrt 2)): the exact form netdsl computes
    # (opset 20's Gelu is newer than many runtimes)
    x = xs[0]
    erf = e.emit("Erf", [e.emit("Mul", [x, e.scalar(1.0 / math.sqrt(2.0), "inv_sqrt2")])])
    half_x = e.emit("Mul", [x, e.scalar(0.5, "half")])
    e.result("Mul", [half_x, e.emit("Add", [erf, e.scalar(1.0, "one")])])


def _scale(e, n, xs):
    e.result("Mul", [xs[0], e.scalar(n.attrs["factor"], "factor")])


def _mean(e, n, xs):
    ax = norm_axis(n.attrs["axis"], e.type(n.inputs[0]).rank, "mean")
    e.result("ReduceMean", xs, axes=[ax], keepdims=int(n.attrs["keepdims"]))


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


def _slice(e, n, xs):
    a = n.attrs
    e.result("Slice", [xs[0], e.ints([a["start"]], "starts"), e.ints([a["stop"]], "ends"),
                       e.ints([a["axis"]], "axes")])


def _dropout_mask(e, n, xs):
    # evaluation mode: all ones, shaped like x
    one = e.onnx.numpy_helper.from_array(np.ones(1, np.float32), "one")
    e.result("ConstantOfShape", [e.emit("Shape", xs[:1])], value=one)


def _embedding(e, n, xs):
    ids, table = xs
    e.result("Gather", [table, ids], axis=0)


EXPORTERS = {
    "add": _same("Add"),
    "sub": _same("Sub"),
    "mul": _same("Mul"),
    "scale": _scale,
    "mean": _mean,
    "matmul": _same("MatMul"),
    "linear": _linear,
    "embedding": _embedding,
    "conv2d": _conv2d,
    "maxpool": _pool("MaxPool"),
    "avgpool": _pool("AveragePool", count_include_pad=1),
    "global_avgpool": _same("GlobalAveragePool"),
    "batchnorm": _batchnorm,
    "layernorm": _layernorm,
    "relu": _same("Relu"),
    "leaky_relu": lambda e, n, xs: e.result("LeakyRelu", xs, alpha=n.attrs["slope"]),
    "gelu": _gelu,
    "sigmoid": _same("Sigmoid"),
    "tanh": _same("Tanh"),
    "softmax": lambda e, n, xs: e.result("Softmax", xs, axis=n.attrs["axis"]),
    "dropout": _same("Identity"),  # evaluation mode
    "dropout_mask": _dropout_mask,
    "flatten": _flatten,
    "reshape": _reshape,
    "permute": _permute,
    "transpose": _transpose,
    "concat": lambda e, n, xs: e.result("Concat", xs, axis=n.attrs["axis"]),
    "slice": _slice,
}

# forward operators deliberately without an export: the losses (the exported model is the
# network's outputs; its loss needs labels) and constants made for the backward pass
NOT_EXPORTED = {"softmax_cross_entropy": "a loss", "mse": "a loss",
                "fill": "a constant of the backward pass"}
