"""Normalisation: batchnorm (over N and spatial dims) and layernorm (over the last dim).

Backward recomputes the batch statistics from x instead of keeping them: both ops retain
only their input and their scale (`weight`); the running statistics are never read.
Batchnorm's backward is the training-mode one (gradients through the batch statistics).
"""
from netdsl.ir.ops._util import need_float, need_rank
from netdsl.ir.registry import Arg, OpDef, ParamSpec, grad_rule, kernel, register
from netdsl.ir.types import TensorType


def _bn_shape(ins, a):
    (x,) = ins
    need_rank(x, "batchnorm", (2, 3, 4))
    need_float(x, "batchnorm")
    return x


def _bn_params(ins, a):
    c = ins[0].shape[1]
    p = {}
    if a["affine"]:
        p["weight"] = ParamSpec((c,), "ones")
        p["bias"] = ParamSpec((c,), "zeros")
    p["running_mean"] = ParamSpec((c,), "zeros", buffer=True)
    p["running_var"] = ParamSpec((c,), "ones", buffer=True)
    return p


def _ln_shape(ins, a):
    (x,) = ins
    need_float(x, "layernorm")
    if x.rank < 1:
        need_rank(x, "layernorm", (2, 3))
    return x


def _ln_params(ins, a):
    d = ins[0].shape[-1]
    if not a["affine"]:
        return {}
    return {"weight": ParamSpec((d,), "ones"), "bias": ParamSpec((d,), "zeros")}


def _flops(ins, out, a):
    return 8 * out.numel()  # mean, var, normalise, scale and shift


register(OpDef(
    "batchnorm",
    (Arg("x", "tensor"), Arg("eps", "float", 1e-5), Arg("momentum", "float", 0.1),
     Arg("affine", "bool", True)),
    _bn_shape, "norm", _bn_params, _flops, retains=("inputs", "weight"),
    doc="batch normalisation over every dim but 1; running stats in buffers"))

register(OpDef(
    "layernorm",
    (Arg("x", "tensor"), Arg("eps", "float", 1e-5), Arg("affine", "bool", True)),
    _ln_shape, "norm", _ln_params, _flops, retains=("inputs", "weight"),
    doc="layer normalisation over the last dimension"))


# -- backward operators -----------------------------------------------------------------------
def _gi_shape(ins, a):
    return TensorType(ins[1].shape, ins[0].dtype)


def _gw_shape(axis):
    def shape(ins, a):
        return TensorType((ins[1].shape[axis],), ins[0].dtype)
    return shape


for _op, _axis in (("batchnorm", 1), ("layernorm", -1)):
    register(OpDef(f"{_op}_grad_input",
                   (Arg("dy", "tensor"), Arg("x", "tensor"), Arg("weight", "tensor", None),
                    Arg("eps", "float", 1e-5)),
                   _gi_shape, "backward", flops=lambda ins, out, a: 10 * out.numel(),
                   differentiable=False,
                   doc=f"dx of {_op} (batch statistics recomputed from x); weight optional"))
    register(OpDef(f"{_op}_grad_weight",
                   (Arg("dy", "tensor"), Arg("x", "tensor"), Arg("eps", "float", 1e-5)),
                   _gw_shape(_axis), "backward", flops=lambda ins, out, a: 6 * ins[0].numel(),
                   differentiable=False, doc=f"d(weight) of {_op}: sum of dy * x_hat"))


# -- kernels ----------------------------------------------------------------------------------
def _bn_axes(x):
    return (0,) + tuple(range(2, x.ndim))


def _bshape(x, c):
    return (1, c) + (1,) * (x.ndim - 2)


def _normalise(xp, x, axes, eps):
    mean = x.mean(axis=axes, keepdims=True)
    var = x.var(axis=axes, keepdims=True)  # biased, as used for normalisation
    inv = 1.0 / xp.sqrt(var + eps)
    return (x - mean) * inv, inv, mean, var


@kernel("batchnorm")
def _batchnorm(xp, ins, a, ctx):
    x = ins[0]
    c = x.shape[1]
    if a["affine"]:
        w, bias, rm, rv = ins[1:5]
    else:
        w = bias = None
        rm, rv = ins[1:3]
    if ctx.training:
        xhat, _, mean, var = _normalise(xp, x, _bn_axes(x), a["eps"])
        m = a["momentum"]
        count = x.size // c
        # running statistics updated in place (PyTorch: unbiased variance in the running var)
        rm *= 1.0 - m
        rm += m * mean.reshape(c)
        rv *= 1.0 - m
        rv += (m * count / max(count - 1, 1)) * var.reshape(c)
    else:
        xhat = (x - rm.reshape(_bshape(x, c))) / xp.sqrt(rv.reshape(_bshape(x, c)) + a["eps"])
    if w is None:
        return xhat
    return xhat * w.reshape(_bshape(x, c)) + bias.reshape(_bshape(x, c))


def _norm_grad_input(xp, dy, x, w, axes, wshape, eps):
    xhat, inv, _, _ = _normalise(xp, x, axes, eps)
    dxhat = dy if w is None else dy * w.reshape(wshape)
    return inv * (dxhat - dxhat.mean(axis=axes, keepdims=True)
                  - xhat * (dxhat * xhat).mean(axis=axes, keepdims=True))


@kernel("batchnorm_grad_input")
def _bn_gi(xp, ins, a, ctx):
    dy, x = ins[0], ins[1]
    w = ins[2] if len(ins) > 2 else None
    return _norm_grad_input(xp, dy, x, w, _bn_axes(x), _bshape(x, x.shape[1]), a["eps"])


@kernel("batchnorm_grad_weight")
def _bn_gw(xp, ins, a, ctx):
    dy, x = ins
    xhat = _normalise(xp, x, _bn_axes(x), a["eps"])[0]
    return (dy * xhat).sum(axis=_bn_axes(x))


@kernel("layernorm")
def _layernorm(xp, ins, a, ctx):
    x = ins[0]
    xhat = _normalise(xp, x, -1, a["eps"])[0]
    if len(ins) > 1:
        return xhat * ins[1] + ins[2]
    return xhat


@kernel("layernorm_grad_input")
def _ln_gi(xp, ins, a, ctx):
    dy, x = ins[0], ins[1]
    w = ins[2] if len(ins) > 2 else None
    return _norm_grad_input(xp, dy, x, w, -1, (x.shape[-1],), a["eps"])


@kernel("layernorm_grad_weight")
def _ln_gw(xp, ins, a, ctx):
    dy, x = ins
    xhat = _normalise(xp, x, -1, a["eps"])[0]
    return (dy * xhat).reshape(-1, x.shape[-1]).sum(axis=0)


# -- gradient rules ---------------------------------------------------------------------------
def _norm_rule(op, axis):
    def rule(n, b, gy):
        x = n.inputs[0]
        eps = {"eps": n.attrs["eps"]}
        if not n.attrs["affine"]:
            out = [b.emit(f"{op}_grad_input", [gy, x], eps, tag="x")]
        else:
            w = n.inputs[1]
            out = [b.emit(f"{op}_grad_input", [gy, x, w], eps, tag="x"),
                   b.emit(f"{op}_grad_weight", [gy, x], eps, tag="weight"),
                   b.emit("sum_except", [gy], {"axis": axis}, tag="bias")]
        return out + [None] * (len(n.inputs) - len(out))  # no gradients for the buffers
    return rule


grad_rule("batchnorm")(_norm_rule("batchnorm", 1))
grad_rule("layernorm")(_norm_rule("layernorm", -1))
