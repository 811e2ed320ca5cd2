"""Normalisation: batchnorm (over N and spatial dims) and layernorm (over the last dim)."""
from netdsl.ir.ops._util import need_float, need_rank
from netdsl.ir.registry import Arg, OpDef, ParamSpec, register


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
    _bn_shape, "norm", _bn_params, _flops, retains=("inputs", "params"),
    doc="batch normalisation over every dim but 1; running stats in buffers"))

register(OpDef(
    "layernorm",
    (Arg("x", "tensor"), Arg("eps", "float", 1e-5), Arg("affine", "bool", True)),
    _ln_shape, "norm", _ln_params, _flops, retains=("inputs", "params"),
    doc="layer normalisation over the last dimension"))
