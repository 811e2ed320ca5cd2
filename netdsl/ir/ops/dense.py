"""Dense algebra: linear layers, batched matrix products, embeddings."""
from netdsl.errors import ShapeError
from netdsl.ir.ops._util import broadcast, need_float
from netdsl.ir.registry import Arg, OpDef, ParamSpec, register
from netdsl.ir.types import TensorType


def _linear_shape(ins, a):
    (x,) = ins
    need_float(x, "linear")
    if x.rank < 2:
        raise ShapeError(f"linear expects an input of rank 2 or more, but {{x}} is {x}")
    if not isinstance(x.shape[-1], int):
        raise ShapeError(f"linear needs a static last dimension, but {{x}} is {x}")
    if a["out_features"] < 1:
        raise ShapeError("linear: out_features must be positive")
    return TensorType(x.shape[:-1] + (a["out_features"],), x.dtype)


def _linear_params(ins, a):
    d = ins[0].shape[-1]
    p = {"weight": ParamSpec((a["out_features"], d), "kaiming_uniform", d)}
    if a["bias"]:
        p["bias"] = ParamSpec((a["out_features"],), "uniform_fan_in", d)
    return p


register(OpDef(
    "linear", (Arg("x", "tensor"), Arg("out_features", "int"), Arg("bias", "bool", True)),
    _linear_shape, "linear", _linear_params,
    lambda ins, out, a: 2 * out.numel() * ins[0].shape[-1], retains=("inputs", "params"),
    doc="y = x W^T + b over the last dimension; weight [out, in]"))


def _matmul_shape(ins, a):
    x, y = ins
    need_float(x, "matmul", "a")
    need_float(y, "matmul", "b")
    if x.rank < 2 or y.rank < 2:
        raise ShapeError(f"matmul expects operands of rank 2 or more, but {{a}} is {x} "
                         f"and {{b}} is {y}")
    if x.shape[-1] != y.shape[-2]:
        raise ShapeError(f"matmul: inner dimensions differ: {{a}} is {x} and {{b}} is {y} "
                         f"({x.shape[-1]} vs {y.shape[-2]})")
    batch = broadcast(TensorType(x.shape[:-2]), TensorType(y.shape[:-2]), "matmul")
    return TensorType(batch + (x.shape[-2], y.shape[-1]), x.dtype)


register(OpDef(
    "matmul", (Arg("a", "tensor"), Arg("b", "tensor")), _matmul_shape, "matmul",
    flops=lambda ins, out, a: 2 * out.numel() * ins[0].shape[-1], retains=("inputs",),
    doc="batched matrix product with NumPy broadcasting of the leading dimensions"))


def _emb_shape(ins, a):
    (ids,) = ins
    if ids.dtype not in ("i32", "i64"):
        raise ShapeError(f"embedding expects integer ids, but {{ids}} is {ids}")
    if a["num"] < 1 or a["dim"] < 1:
        raise ShapeError("embedding: num and dim must be positive")
    return TensorType(ids.shape + (a["dim"],), "f32")


register(OpDef(
    "embedding", (Arg("ids", "tensor"), Arg("num", "int"), Arg("dim", "int")),
    _emb_shape, "embedding",
    lambda ins, a: {"weight": ParamSpec((a["num"], a["dim"]), "normal")},
    retains=("inputs",), doc="look up rows of a [num, dim] table by integer id"))
