"""Element-wise activations given by a function and its derivative (registered through
`_unary.unary`): relu6, clip, hardswish, hardsigmoid, silu, mish, elu, selu, softplus; and
prelu, whose slope is learnt (one per channel, or one shared).

Semantics and boundary conventions follow PyTorch: relu6 and hardsigmoid pass no gradient
at their kinks (hardtanh's strict inequalities), clip passes it at its bounds (clamp's).
"""
from netdsl.errors import ShapeError
from netdsl.ir.opdef import GT0, POSITIVE, Arg, OpDef, ParamSpec, grad_rule, kernel, register
from netdsl.ir.ops._unary import unary
from netdsl.ir.ops._util import need_float
from netdsl.ir.ops.elementwise import unbroadcast
from netdsl.ir.types import TensorType

_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def _sigmoid(xp, x):
    e = xp.exp(-xp.abs(x))  # stable: exp only sees -|x|
    return xp.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _softplus(xp, x):
    return xp.logaddexp(0.0, x)


def _mask(cond, like):
    return cond.astype(like.dtype)


unary("relu6", lambda xp, x, a: xp.clip(x, 0.0, 6.0),
      lambda xp, x, a: _mask((x > 0) & (x < 6), x), scratch=(0, 1), doc="min(max(x, 0), 6)",
      window=lambda a: (0.0, 6.0, False))


def _bounds(a):
    lo = -float("inf") if a["min"] is None else a["min"]
    hi = float("inf") if a["max"] is None else a["max"]
    return lo, hi


def _clip_check(x, a):
    if a["min"] is None and a["max"] is None:
        raise ShapeError("clip needs `min`, `max` or both")


unary("clip", lambda xp, x, a: xp.clip(x, *_bounds(a)),
      lambda xp, x, a: _mask((x >= _bounds(a)[0]) & (x <= _bounds(a)[1]), x),
      attrs=(Arg("min", "float", None), Arg("max", "float", None)), check=_clip_check,
      scratch=(0, 1), window=lambda a: (*_bounds(a), True), output_attrs=("min", "max"),
      doc="clamp into [min, max] (either bound may be omitted)")
unary("hardswish", lambda xp, x, a: x * xp.clip(x + 3.0, 0.0, 6.0) * (1.0 / 6.0),
      lambda xp, x, a: xp.where(x < -3.0, 0.0, xp.where(x <= 3.0, x / 3.0 + 0.5, 1.0)),
      flops=4, scratch=(1, 1.5), doc="x * relu6(x + 3) / 6 (MobileNetV3)")
unary("hardsigmoid", lambda xp, x, a: xp.clip(x + 3.0, 0.0, 6.0) * (1.0 / 6.0),
      lambda xp, x, a: _mask((x > -3.0) & (x < 3.0), x) * (1.0 / 6.0),
      flops=3, scratch=(1, 1), doc="relu6(x + 3) / 6")


def _silu_grad(xp, x, a):
    s = _sigmoid(xp, x)
    return s * (1.0 + x * (1.0 - s))


unary("silu", lambda xp, x, a: x * _sigmoid(xp, x), _silu_grad, flops=5, scratch=(3.25, 3.25),
      doc="x * sigmoid(x) (also called swish)")


def _mish_grad(xp, x, a):
    t = xp.tanh(_softplus(xp, x))
    return t + x * (1.0 - t * t) * _sigmoid(xp, x)


unary("mish", lambda xp, x, a: x * xp.tanh(_softplus(xp, x)), _mish_grad, flops=8,
      scratch=(1, 5.25),
      doc="x * tanh(softplus(x))")
unary("elu", lambda xp, x, a: xp.where(x > 0, x, a["alpha"] * xp.expm1(xp.minimum(x, 0.0))),
      lambda xp, x, a: xp.where(x > 0, 1.0, a["alpha"] * xp.exp(xp.minimum(x, 0.0))),
      attrs=(Arg("alpha", "float", 1.0),), flops=4, scratch=(1.25, 1.25),
      doc="x if x > 0 else alpha (e^x - 1)")
unary("selu", lambda xp, x, a: _SELU_SCALE * xp.where(
          x > 0, x, _SELU_ALPHA * xp.expm1(xp.minimum(x, 0.0))),
      lambda xp, x, a: _SELU_SCALE * xp.where(
          x > 0, 1.0, _SELU_ALPHA * xp.exp(xp.minimum(x, 0.0))),
      flops=5, scratch=(1.25, 1.25),
      doc="scale * elu(x, alpha) with the self-normalising constants")


def _softplus_fwd(xp, x, a):
    bx = a["beta"] * x
    return xp.where(bx > a["threshold"], x, _softplus(xp, bx) / a["beta"])


def _softplus_grad(xp, x, a):
    bx = a["beta"] * x
    return xp.where(bx > a["threshold"], 1.0, _sigmoid(xp, bx))


def _softplus_check(x, a):
    if a["beta"] <= 0:
        raise ShapeError(f"softplus: beta must be positive, not {a['beta']}")


unary("softplus", _softplus_fwd, _softplus_grad, check=_softplus_check,
      attrs=(Arg("beta", "float", 1.0, range=GT0), Arg("threshold", "float", 20.0)), flops=4,
      scratch=(2.25, 4.5),
      doc="log(1 + e^(beta x)) / beta; x itself where beta x > threshold")


# -- prelu: a learnt slope for the negative part -------------------------------------------
def _prelu_shape(ins, a):
    (x,) = ins
    need_float(x, "prelu")
    k = a["num_parameters"]
    if k != 1 and (x.rank < 2 or x.shape[1] != k):
        raise ShapeError(f"prelu with num_parameters={k} needs {k} channels (dimension 1), "
                         f"but {{x}} is {x}; use 1 for one shared slope")
    if k < 1:
        raise ShapeError("prelu: num_parameters must be positive")
    return x


register(OpDef(
    "prelu", (Arg("x", "tensor"), Arg("num_parameters", "int", 1, range=POSITIVE)), _prelu_shape,
    "activation",
    # torch starts the slope at 0.25; the executor has no constant init yet, so 0 (a relu)
    lambda ins, a: {"weight": ParamSpec((a["num_parameters"],), "constant", value=0.25)},
    lambda ins, out, a: 2 * out.numel(), retains=("inputs", "weight"),
    doc="x if x > 0 else weight * x; weight [num_parameters] starts at 0.25 as in torch, "
        "one slope per channel (dimension 1) or one shared"))


def _slope_shape(x, k):
    """The weight's shape broadcast against x: [1, C, 1, ...] or [1]."""
    return (1, k) + (1,) * (len(x) - 2) if k > 1 else (1,)


register(OpDef("prelu_grad_input", (Arg("dy", "tensor"), Arg("x", "tensor"),
                                    Arg("weight", "tensor")),
               lambda ins, a: ins[1], "backward", flops=lambda ins, out, a: 2 * out.numel(),
               differentiable=False, doc="dy where x > 0, else dy * weight"))
register(OpDef("prelu_grad_weight", (Arg("dy", "tensor"), Arg("x", "tensor")),
               lambda ins, a: TensorType(ins[1].shape, ins[0].dtype), "backward",
               flops=lambda ins, out, a: 2 * out.numel(), differentiable=False,
               doc="dy * x where x <= 0, else 0 (summed to the weight's shape after)"))


@kernel("prelu")
def _prelu(xp, ins, a, ctx):
    x, w = ins
    return xp.where(x > 0, x, x * w.reshape(_slope_shape(x.shape, w.size)))


@kernel("prelu_grad_input")
def _prelu_gi(xp, ins, a, ctx):
    dy, x, w = ins
    return xp.where(x > 0, dy, dy * w.reshape(_slope_shape(x.shape, w.size)))


@kernel("prelu_grad_weight")
def _prelu_gw(xp, ins, a, ctx):
    dy, x = ins
    return xp.where(x > 0, 0.0, dy * x).astype(dy.dtype)


@grad_rule("prelu")
def _prelu_rule(n, b, gy):
    x, w = n.inputs
    gw = b.emit("prelu_grad_weight", [gy, x], tag="w")
    if n.attrs["num_parameters"] > 1:
        gw = b.emit("sum_except", [gw], {"axis": 1}, tag="weight")
    else:
        gw = unbroadcast(b, b.emit("reshape", [gw], {"shape": (-1,)}, tag="flat"), w)
    return [b.emit("prelu_grad_input", [gy, x, w], tag="x"), gw]
