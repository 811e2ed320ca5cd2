"""Dense algebra: linear layers, batched matrix products, embeddings."""
from netdsl.errors import ShapeError
from netdsl.ir.opdef import (
    GPU_LIBRARIES,
    OPS,
    POSITIVE,
    Arg,
    OpDef,
    ParamSpec,
    grad_rule,
    kernel,
    register,
)
from netdsl.ir.ops._util import broadcast, fused_kernels, matmul, need_float
from netdsl.ir.ops.elementwise import unbroadcast
from netdsl.ir.ops.shape_ops import checked_indices, scatter_add_rows
from netdsl.ir.types import TensorType


def linear_shape(ins, a):
    (x,) = ins
    need_float(x, "linear")
    if x.rank < 2:
        raise ShapeError(f"linear expects an input of rank 2 or more, but {{x}} is {x}")
    if not isinstance(x.shape[-1], int):
        raise ShapeError(f"linear needs a static last dimension, but {{x}} is {x}")
    if a["out_features"] < 1:
        raise ShapeError("linear: out_features must be positive")
    return TensorType(x.shape[:-1] + (a["out_features"],), x.dtype)


def linear_params(ins, a):
    d = ins[0].shape[-1]
    p = {"weight": ParamSpec((a["out_features"], d), "kaiming_uniform", d)}
    if a["bias"]:
        p["bias"] = ParamSpec((a["out_features"],), "uniform_fan_in", d)
    return p


def linear_flops(ins, out, a):
    return 2 * out.numel() * ins[0].shape[-1]


LINEAR_ARGS = (Arg("x", "tensor"), Arg("out_features", "int", range=POSITIVE),
               Arg("bias", "bool", True))
register(OpDef(
    "linear", LINEAR_ARGS, linear_shape, "linear", linear_params, linear_flops,
    retains=("inputs", "weight"),
    doc="y = x W^T + b over the last dimension; weight [out, in]",
    extra={"fused_kernels": ("gemm",)}, precision="reduced"))


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
    doc="batched matrix product with NumPy broadcasting of the leading dimensions",
    extra={"fused_kernels": ("gemm",)}, precision="reduced"))


def _emb_shape(ins, a):
    (ids,) = ins
    if ids.dtype not in ("i32", "i64"):
        raise ShapeError(f"embedding expects integer ids, but {{ids}} is {ids}")
    if a["num"] < 1 or a["dim"] < 1:
        raise ShapeError("embedding: num and dim must be positive")
    return TensorType(ids.shape + (a["dim"],), "f32")


register(OpDef(
    "embedding",
    (Arg("ids", "tensor"), Arg("num", "int", range=POSITIVE), Arg("dim", "int", range=POSITIVE)),
    _emb_shape, "embedding",
    lambda ins, a: {"weight": ParamSpec((a["num"], a["dim"]), "normal")},
    retains=("inputs",),
    doc="look up rows of a [num, dim] table by integer id (an id outside 0..num-1 is an "
        "error at run time)"))


# -- backward operators -----------------------------------------------------------------------
def _lin_gi_shape(ins, a):
    dy, w = ins
    return TensorType(dy.shape[:-1] + (w.shape[1],), dy.dtype)


def _lin_gw_shape(ins, a):
    dy, x = ins
    return TensorType((dy.shape[-1], x.shape[-1]), dy.dtype)


register(OpDef("linear_grad_input", (Arg("dy", "tensor"), Arg("weight", "tensor")),
               _lin_gi_shape, "backward", differentiable=False,
               flops=lambda ins, out, a: 2 * out.numel() * ins[1].shape[0],
               doc="dx = dy W", extra={"fused_kernels": ("gemm",)}, precision="reduced"))
register(OpDef("linear_grad_weight", (Arg("dy", "tensor"), Arg("x", "tensor")),
               _lin_gw_shape, "backward", differentiable=False,
               flops=lambda ins, out, a: 2 * ins[0].numel() * ins[1].shape[-1],
               doc="dW = dy^T x, summed over all leading dimensions",
               extra={"fused_kernels": ("gemm",)}, precision="reduced"))


def _emb_grad_shape(ins, a):
    dy, ids = ins
    return TensorType((a["num"], dy.shape[-1]), dy.dtype)


register(OpDef("embedding_grad",
               (Arg("dy", "tensor"), Arg("ids", "tensor"), Arg("num", "int", range=POSITIVE)),
               _emb_grad_shape, "backward", differentiable=False,
               flops=lambda ins, out, a: ins[0].numel(),
               doc="scatter-add dy rows into a [num, dim] table at the ids",
               extra={"fused_kernels": ("scatter",)}))


# -- kernels ----------------------------------------------------------------------------------
def rows_times(xp, x, w, fast, bias=None, residual=None):
    """x @ w (+ bias) (+ residual, of the result's shape) over x's last dim; x of rank > 2
    as one 2-d GEMM over all its leading dims (matmul would broadcast into a batched GEMM
    of small ones: twice the time for a transformer's [N, T, d] activations)."""
    if x.ndim > 2 and x.flags.c_contiguous:
        r = None if residual is None else residual.reshape(-1, w.shape[1])
        return matmul(xp, x.reshape(-1, x.shape[-1]), w, fast=fast, bias=bias, residual=r) \
            .reshape(x.shape[:-1] + (w.shape[1],))
    return matmul(xp, x, w, fast=fast, bias=bias, residual=residual)


@kernel("linear")
def _linear(xp, ins, a, ctx):
    # the bias added by each GEMM thread to its block while it is in cache (where the
    # fused kernels take the product), not by another pass over the result
    return rows_times(xp, ins[0], ins[1].T, fused_kernels(ctx, ins[0], ins[1]),
                       ins[2] if len(ins) > 2 else None)


@kernel("linear_grad_input")
def _linear_gi(xp, ins, a, ctx):
    return rows_times(xp, ins[0], ins[1], fused_kernels(ctx, ins[0], ins[1]))


@kernel("linear_grad_weight")
def _linear_gw(xp, ins, a, ctx):
    dy, x = ins
    return matmul(xp, dy.reshape(-1, dy.shape[-1]).T, x.reshape(-1, x.shape[-1]),
                  fast=fused_kernels(ctx, dy, x))


@kernel("matmul")
def _matmul(xp, ins, a, ctx):
    # on the loops' threads where they take it, views as they lie (a transformer's heads:
    # [N, heads, T, d] permuted, the batch's two levels strided apart): the heads' small
    # products split among the threads, measured faster than NumPy's matmul on two
    # (bench_kernels.py --threads 2)
    return matmul(xp, ins[0], ins[1], fast=fused_kernels(ctx))


@kernel("embedding")
def _embedding(xp, ins, a, ctx):
    ids, w = ins
    return xp.take(w, checked_indices(xp, ids, a["num"], ctx, negative=False, what="id"),
                   axis=0)


@kernel("embedding_grad")
def _embedding_grad(xp, ins, a, ctx):
    dy, ids = ins
    ids = checked_indices(xp, ids, a["num"], ctx, negative=False, what="id")
    dw = xp.zeros((a["num"], dy.shape[-1]), dtype=dy.dtype)
    scatter_add_rows(xp, ctx, dw, ids.reshape(-1), dy.reshape(-1, dy.shape[-1]))
    return dw


# -- gradient rules ---------------------------------------------------------------------------
@grad_rule("linear")
def linear_rule(n, b, gy):
    x, w = n.inputs[0], n.inputs[1]
    out = [b.emit("linear_grad_input", [gy, w], tag="x"),
           b.emit("linear_grad_weight", [gy, x], tag="weight")]
    if len(n.inputs) > 2:
        out.append(b.emit("sum_except", [gy], {"axis": -1}, tag="bias"))
    return out


@grad_rule("matmul")
def _matmul_rule(n, b, gy):
    x, y = n.inputs
    yt = b.emit("transpose", [y], {"dim0": -2, "dim1": -1}, tag="bT")
    xt = b.emit("transpose", [x], {"dim0": -2, "dim1": -1}, tag="aT")
    da = b.emit("matmul", [gy, yt], tag="a")
    db = b.emit("matmul", [xt, gy], tag="b")
    return [unbroadcast(b, da, x), unbroadcast(b, db, y)]


@grad_rule("embedding")
def _embedding_rule(n, b, gy):
    return [None, b.emit("embedding_grad", [gy, n.inputs[0]], {"num": n.attrs["num"]},
                         tag="weight")]

# on a GPU, cuBLAS and cuDNN read and write f16 themselves (mixed precision)
for _name in ("linear", "matmul", "linear_grad_input", "linear_grad_weight"):
    OPS[_name].reads_reduced = GPU_LIBRARIES
