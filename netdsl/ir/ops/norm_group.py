"""Normalisation by per-example statistics: groupnorm (channels in groups), instancenorm
(every channel its own group) and rmsnorm (root mean square over the dims from `axis`).

Like layernorm, the statistics never involve other examples, so training and evaluation
compute the same thing and there are no running buffers. Backward recomputes the
statistics from x; the ops retain their input and their scale.
"""
from netdsl.errors import ShapeError
from netdsl.ir.opdef import GT0, POSITIVE, Arg, OpDef, ParamSpec, grad_rule, kernel, register
from netdsl.ir.ops._util import need_float, norm_axis
from netdsl.ir.types import TensorType, accumulate_dtype


def _group_shape(op):
    def shape(ins, a):
        (x,) = ins
        need_float(x, op)
        if x.rank < 2 or not isinstance(x.shape[1], int):
            raise ShapeError(f"{op} expects an (N, C, ...) input with static C, but {{x}} "
                             f"is {x}")
        if op == "instancenorm" and x.rank < 3:
            raise ShapeError(f"instancenorm needs spatial dims (N, C, ...), but {{x}} is {x}")
        g = a.get("num_groups", x.shape[1])
        if g < 1 or x.shape[1] % g:
            raise ShapeError(f"groupnorm: {x.shape[1]} channels of {{x}} do not divide into "
                             f"{g} groups")
        return x
    return shape


def _channel_params(ins, a):
    c = ins[0].shape[1]
    if not a["affine"]:
        return {}
    return {"weight": ParamSpec((c,), "ones"), "bias": ParamSpec((c,), "zeros")}


def _flops(ins, out, a):
    return 8 * out.numel()


register(OpDef("groupnorm", (Arg("x", "tensor"), Arg("num_groups", "int", range=POSITIVE),
                             Arg("eps", "float", 1e-5, range=GT0), Arg("affine", "bool", True)),
               _group_shape("groupnorm"), "norm", _channel_params, _flops,
               retains=("inputs", "weight"),
               doc="normalise each example over groups of channels (and all spatial "
                   "positions); weight and bias per channel"))
register(OpDef("instancenorm", (Arg("x", "tensor"), Arg("eps", "float", 1e-5, range=GT0),
                                Arg("affine", "bool", False)),
               _group_shape("instancenorm"), "norm", _channel_params, _flops,
               retains=("inputs", "weight"),
               doc="normalise each channel of each example over its spatial positions "
                   "(torch's InstanceNorm without running statistics)"))


def _rms_shape(ins, a):
    (x,) = ins
    need_float(x, "rmsnorm")
    ax = norm_axis(a["axis"], x.rank, "rmsnorm")
    if ax == 0:
        raise ShapeError("rmsnorm cannot normalise over the batch dimension (axis 0)")
    if any(not isinstance(d, int) for d in x.shape[ax:]):
        raise ShapeError(f"rmsnorm needs static normalised dims, but {{x}} is {x}")
    return x


def _rms_params(ins, a):
    x = ins[0]
    if not a["affine"]:
        return {}
    return {"weight": ParamSpec(tuple(x.shape[a["axis"] % x.rank:]), "ones")}


register(OpDef("rmsnorm", (Arg("x", "tensor"), Arg("eps", "float", 1e-6, range=GT0),
                           Arg("affine", "bool", True), Arg("axis", "axis", -1)),
               _rms_shape, "norm", _rms_params, lambda ins, out, a: 4 * out.numel(),
               retains=("inputs", "weight"),
               doc="x / sqrt(mean(x^2) + eps) * weight over the dims from `axis` on (the "
                   "last by default); no bias"))


# -- backward operators -----------------------------------------------------------------------
def _gi_shape(ins, a):
    return TensorType(ins[1].shape, ins[0].dtype)


_GROUPS = Arg("num_groups", "int")
register(OpDef("groupnorm_grad_input",
               (Arg("dy", "tensor"), Arg("x", "tensor"), Arg("weight", "tensor", None),
                _GROUPS, Arg("eps", "float", 1e-5)),
               _gi_shape, "backward", flops=lambda ins, out, a: 10 * out.numel(),
               differentiable=False, doc="dx of groupnorm/instancenorm; weight optional"))
register(OpDef("groupnorm_grad_weight",
               (Arg("dy", "tensor"), Arg("x", "tensor"), _GROUPS, Arg("eps", "float", 1e-5)),
               lambda ins, a: TensorType((ins[1].shape[1],), accumulate_dtype(ins[0].dtype)),
               "backward",
               flops=lambda ins, out, a: 6 * ins[0].numel(), differentiable=False,
               doc="d(weight) of groupnorm: per channel, the sum of dy * x_hat"))
_AX = Arg("axis", "axis", -1)
register(OpDef("rmsnorm_grad_input",
               (Arg("dy", "tensor"), Arg("x", "tensor"), Arg("weight", "tensor", None),
                Arg("eps", "float", 1e-6), _AX),
               _gi_shape, "backward", flops=lambda ins, out, a: 8 * out.numel(),
               differentiable=False, doc="dx of rmsnorm; weight optional"))
register(OpDef("rmsnorm_grad_weight",
               (Arg("dy", "tensor"), Arg("x", "tensor"), Arg("eps", "float", 1e-6), _AX),
               lambda ins, a: TensorType(tuple(ins[1].shape[a["axis"] % ins[1].rank:]),
                                         accumulate_dtype(ins[0].dtype)),
               "backward", flops=lambda ins, out, a: 4 * ins[0].numel(), differentiable=False,
               doc="d(weight) of rmsnorm: the sum of dy * x_hat over the leading dims"))


# -- kernels ----------------------------------------------------------------------------------
def _grouped(x, g):
    return x.reshape(x.shape[0], g, -1)


def _group_stats(xp, x, g, eps):
    """x_hat and 1/sqrt(var + eps) over each (example, group), as [N, G, M] and [N, G, 1]."""
    xg = _grouped(x, g)
    mean = xg.mean(axis=-1, keepdims=True)
    d = xg - mean
    inv = 1.0 / xp.sqrt((d * d).mean(axis=-1, keepdims=True) + eps)
    return d * inv, inv


def _cshape(x):
    return (1, x.shape[1]) + (1,) * (x.ndim - 2)


def _groups(a, x):
    return a["num_groups"] if "num_groups" in a else x.shape[1]


def _group_forward(xp, ins, a, ctx):
    x = ins[0]
    y = _group_stats(xp, x, _groups(a, x), a["eps"])[0].reshape(x.shape)
    if len(ins) > 1:
        y = y * ins[1].reshape(_cshape(x)) + ins[2].reshape(_cshape(x))
    return y


kernel("groupnorm")(_group_forward)
kernel("instancenorm")(_group_forward)


@kernel("groupnorm_grad_input")
def _gn_gi(xp, ins, a, ctx):
    dy, x = ins[0], ins[1]
    if len(ins) > 2:
        dy = dy * ins[2].reshape(_cshape(x))
    g = a["num_groups"]
    xhat, inv = _group_stats(xp, x, g, a["eps"])
    d = _grouped(dy, g)
    dx = inv * (d - d.mean(axis=-1, keepdims=True)
                - xhat * (d * xhat).mean(axis=-1, keepdims=True))
    return dx.reshape(x.shape)


@kernel("groupnorm_grad_weight")
def _gn_gw(xp, ins, a, ctx):
    dy, x = ins
    xhat = _group_stats(xp, x, a["num_groups"], a["eps"])[0].reshape(x.shape)
    p = dy * xhat
    return p.reshape(x.shape[0], x.shape[1], -1).sum(axis=(0, 2))


def _rows(x, axis):
    return x.reshape(x.shape[:axis % x.ndim] + (-1,))


def _rms_stats(xp, x, axis, eps):
    r = _rows(x, axis)
    inv = 1.0 / xp.sqrt((r * r).mean(axis=-1, keepdims=True) + eps)
    return r * inv, inv


@kernel("rmsnorm")
def _rmsnorm(xp, ins, a, ctx):
    x = ins[0]
    y = _rms_stats(xp, x, a["axis"], a["eps"])[0].reshape(x.shape)
    return y * ins[1] if len(ins) > 1 else y


@kernel("rmsnorm_grad_input")
def _rms_gi(xp, ins, a, ctx):
    dy, x = ins[0], ins[1]
    if len(ins) > 2:
        dy = dy * ins[2]
    xhat, inv = _rms_stats(xp, x, a["axis"], a["eps"])
    d = _rows(dy, a["axis"])
    return (inv * (d - xhat * (d * xhat).mean(axis=-1, keepdims=True))).reshape(x.shape)


@kernel("rmsnorm_grad_weight")
def _rms_gw(xp, ins, a, ctx):
    dy, x = ins
    ax = a["axis"] % x.ndim
    xhat = _rms_stats(xp, x, ax, a["eps"])[0]
    return (_rows(dy, ax) * xhat).reshape((-1,) + x.shape[ax:]).sum(axis=0)


# -- gradient rules ---------------------------------------------------------------------------
def _group_rule(n, b, gy):
    x = n.inputs[0]
    attrs = {"eps": n.attrs["eps"], "num_groups": n.attrs.get("num_groups", b.type(x).shape[1])}
    if not n.attrs["affine"]:
        return [b.emit("groupnorm_grad_input", [gy, x], attrs, tag="x")]
    w = n.inputs[1]
    return [b.emit("groupnorm_grad_input", [gy, x, w], attrs, tag="x"),
            b.emit("groupnorm_grad_weight", [gy, x], attrs, tag="weight"),
            b.emit("sum_except", [gy], {"axis": 1}, tag="bias")]


grad_rule("groupnorm")(_group_rule)
grad_rule("instancenorm")(_group_rule)


@grad_rule("rmsnorm")
def _rms_rule(n, b, gy):
    x = n.inputs[0]
    attrs = {"eps": n.attrs["eps"], "axis": n.attrs["axis"]}
    if not n.attrs["affine"]:
        return [b.emit("rmsnorm_grad_input", [gy, x], attrs, tag="x")]
    w = n.inputs[1]
    return [b.emit("rmsnorm_grad_input", [gy, x, w], attrs, tag="x"),
            b.emit("rmsnorm_grad_weight", [gy, x], attrs, tag="weight")]
