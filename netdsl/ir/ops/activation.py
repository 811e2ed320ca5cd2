"""Element-wise activations and dropout: shape rules, kernels, gradient rules.

Kernels follow the xp pattern (`xp` is numpy or cupy); gradient rules emit ordinary IR
nodes through the autodiff builder (see netdsl.passes.autodiff).

Dropout's mask is an explicit graph value. `autodiff` lowers every `dropout(x)` into
`dropout_mask(x)` (0 or 1/(1-p) per element, drawn from the run's seeded RNG in training,
all ones in evaluation) followed by `mul(x, mask)`; the backward pass is then mul's, which
reads only the mask. A forward-only graph keeps the fused `dropout` kernel.
"""
import math

from netdsl.errors import ShapeError
from netdsl.ir.opdef import (
    FUSED_LOOPS,
    PROBABILITY,
    Arg,
    OpDef,
    grad_rule,
    kernel,
    register,
)
from netdsl.ir.ops._util import fused_kernels, grad_shape, need_float, scratch_rule


def _same(op):
    def shape(ins, a):
        need_float(ins[0], op)
        return ins[0]
    return shape


def _per_elem(k):
    return lambda ins, out, a: k * out.numel()


# name, FLOPs per element, what backward retains, extra attributes
_ACTS = (
    ("relu", 1, ("output",), ()),
    ("leaky_relu", 2, ("inputs",), (Arg("slope", "float", 0.01),)),
    # exact erf form by default (torch's approximate="none"); cost is nominal
    ("gelu", 20, ("inputs",), (Arg("approximate", "str", "none", choices=("none", "tanh")),)),
    ("sigmoid", 4, ("output",), ()),
    ("tanh", 4, ("output",), ()),
)
# the NumPy kernels' temporaries, in float32 copies of the result (_util.scratch_rule)
_SCRATCH = {"leaky_relu": 1.25, "gelu": 2, "sigmoid": 3.25, "leaky_relu_grad": 1.25,
            "gelu_grad": 3, "sigmoid_grad": 2, "tanh_grad": 1}
for _name, _k, _ret, _extra in _ACTS:
    register(OpDef(_name, (Arg("x", "tensor"),) + _extra, _same(_name), "activation",
                   flops=_per_elem(_k), workspace=scratch_rule(_SCRATCH.get(_name, 0)),
                   retains=_ret, doc=f"element-wise {_name}",
                   extra={"fused_kernels": ("gelu",) if _name == "gelu" else ()}))


def _add_relu_shape(ins, a):
    x, y = ins
    need_float(x, "add_relu", "a")
    if x != y:
        raise ShapeError(f"add_relu adds tensors of one type, but {{a}} is {x} and {{b}} is {y}")
    return x


register(OpDef(
    "add_relu", (Arg("a", "tensor"), Arg("b", "tensor")), _add_relu_shape, "activation",
    flops=_per_elem(2), retains=("output",), extra={"fused_kernels": ("elementwise",)},
    reads_reduced=FUSED_LOOPS,
    doc="relu(a + b) in one kernel (made by the `fuse` pass from an add of two tensors of "
        "one type read only by a relu: a post-activation residual block's output)"))


def _dropout_shape(ins, a):
    if not 0.0 <= a["p"] <= 1.0:
        raise ShapeError(f"dropout probability p must be in [0, 1], not {a['p']}")
    return _same("dropout")(ins, a)


# scratch: the mask's bool array (one byte an element), and for `dropout` the mask itself
register(OpDef(
    "dropout", (Arg("x", "tensor"), Arg("p", "float", 0.5, range=PROBABILITY)),
    _dropout_shape, "dropout",
    flops=_per_elem(2), workspace=scratch_rule(1.25),
    retains=("mask",), random=True,
    doc="inverted dropout: zero with probability p in training, identity in evaluation"))

register(OpDef(
    "dropout_mask", (Arg("x", "tensor"), Arg("p", "float", 0.5, range=PROBABILITY)),
    _same("dropout_mask"),
    "dropout", flops=_per_elem(1), workspace=scratch_rule(0.25),
    differentiable=False, random=True,
    doc="dropout's explicit mask: 0 or 1/(1-p) in training, 1 in evaluation"))


# -- backward operators: (dy, y) or (dy, x) -> dx -------------------------------------------
def _relu_grad_shape(ins, a):
    if len(ins) > 2 and ins[2] != ins[0]:
        raise ShapeError(f"relu_grad: the gradient {ins[0]} and the sum's other term "
                         f"{ins[2]} differ")
    return grad_shape("relu_grad")(ins[:2], a)


register(OpDef("relu_grad", (Arg("dy", "tensor"), Arg("v", "tensor"), Arg("acc", "tensor", None)),
               _relu_grad_shape, "backward", flops=_per_elem(1), differentiable=False,
               # NumPy's: the mask (and the sum with acc); the fused kernel's: none
               workspace=lambda ins, out, a: int((1.5 if len(ins) > 2 else 0.5) * 4 * out.numel()),
               extra={"fused_kernels": ("elementwise",)}, reads_reduced=FUSED_LOOPS,
               doc="backward of relu: (dy + acc) where the output v is positive, else 0 (acc, "
                   "the other term of a gradient sum, folded in by the fuse_grads pass)"))
for _name, _k, _extra in (("leaky_relu_grad", 2, (Arg("slope", "float"),)),
                          ("gelu_grad", 12, (Arg("approximate", "str", "none",
                                                 choices=("none", "tanh")),)),
                          ("sigmoid_grad", 3, ()), ("tanh_grad", 3, ())):
    register(OpDef(_name, (Arg("dy", "tensor"), Arg("v", "tensor")) + _extra,
                   grad_shape(_name), "backward", flops=_per_elem(_k), differentiable=False,
                   workspace=scratch_rule(_SCRATCH[_name]),
                   doc=f"backward of {_name[:-5]}",
                   extra={"fused_kernels": ("gelu",) if _name == "gelu_grad" else ()}))


# -- kernels --------------------------------------------------------------------------------
@kernel("relu")
def _relu(xp, ins, a, ctx):
    return ctx.into(xp.maximum, ins[0], 0)


@kernel("add_relu")
def _add_relu(xp, ins, a, ctx):
    x, y = ins
    f = fused_kernels(ctx, x, y)
    if f is not None and x.dtype == y.dtype:  # one pass
        out = ctx.out_like(x)
        f.add(x.reshape(-1), y.reshape(-1), True, out.reshape(-1))
        return out
    out = ctx.into(xp.add, x, y)
    return xp.maximum(out, 0, out=out)


@kernel("relu_grad")
def _relu_grad(xp, ins, a, ctx):
    dy, y = ins[0], ins[1]
    acc = ins[2] if len(ins) > 2 else None
    f = fused_kernels(ctx, dy, y, acc)
    if f is not None and dy.dtype == y.dtype and (acc is None or acc.dtype == dy.dtype):
        # one pass, bit for bit the code below (a product with the 0/1 mask, not a select)
        out = ctx.out_like(dy)
        f.relu_grad(dy.reshape(-1), y.reshape(-1),
                    (dy if acc is None else acc).reshape(-1), acc is not None,
                    out.reshape(-1))
        return out
    if acc is not None:
        dy = dy + acc
    return ctx.into(xp.multiply, dy, y > 0)


@kernel("leaky_relu")
def _leaky(xp, ins, a, ctx):
    x = ins[0]
    return xp.where(x > 0, x, x * a["slope"])


@kernel("leaky_relu_grad")
def _leaky_grad(xp, ins, a, ctx):
    dy, x = ins
    return xp.where(x > 0, dy, dy * a["slope"])


_SQRT1_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


_SQRT_2_PI = math.sqrt(2.0 / math.pi)


@kernel("gelu")
def _gelu(xp, ins, a, ctx):
    x = ins[0]
    if a["approximate"] == "tanh":  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        return 0.5 * x * (1.0 + xp.tanh(_SQRT_2_PI * (x + 0.044715 * x * x * x)))
    f = fused_kernels(ctx, x)  # float32: a vectorised loop (numpy_fused_activation)
    y = f.gelu(x) if f is not None else None
    return y if y is not None else 0.5 * x * (1.0 + ctx.erf(x * _SQRT1_2))  # x * Phi(x)


@kernel("gelu_grad")
def _gelu_grad(xp, ins, a, ctx):
    dy, x = ins
    if a["approximate"] == "tanh":
        t = xp.tanh(_SQRT_2_PI * (x + 0.044715 * x * x * x))
        dt = (1.0 - t * t) * _SQRT_2_PI * (1.0 + 3 * 0.044715 * x * x)
        return dy * (0.5 * (1.0 + t) + 0.5 * x * dt)
    f = fused_kernels(ctx, dy, x)
    dx = f.gelu_grad(dy, x) if f is not None else None
    if dx is not None:
        return dx
    # d/dx x*Phi(x) = Phi(x) + x*phi(x)
    cdf = 0.5 * (1.0 + ctx.erf(x * _SQRT1_2))
    pdf = xp.exp(-0.5 * x * x) * _INV_SQRT_2PI
    return dy * (cdf + x * pdf)


@kernel("sigmoid")
def _sigmoid(xp, ins, a, ctx):
    x = ins[0]  # stable for large |x|: exp only ever sees -|x|
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@kernel("sigmoid_grad")
def _sigmoid_grad(xp, ins, a, ctx):
    dy, y = ins
    return dy * y * (1.0 - y)


@kernel("tanh")
def _tanh(xp, ins, a, ctx):
    return xp.tanh(ins[0])


@kernel("tanh_grad")
def _tanh_grad(xp, ins, a, ctx):
    dy, y = ins
    return dy * (1.0 - y * y)


def _mask(xp, x, p, ctx):
    if not ctx.training or p == 0.0:
        return xp.ones_like(x)
    if p >= 1.0:
        return xp.zeros_like(x)
    rows = ctx.node.meta.get("rng_rows")
    if rows is None:
        u = ctx.rng_for(ctx.node).random(x.shape, x.dtype)
    else:  # a split graph's part of the batch draws its rows of the whole batch's mask
        lo, hi, batch = rows
        u = xp.array(ctx.rng_for(ctx.node).random((batch,) + x.shape[1:], x.dtype)[lo:hi])
    # the mask goes into the uniform numbers' array: the bool array is the only scratch
    return xp.multiply(u >= p, x.dtype.type(1.0 / (1.0 - p)), out=u)


@kernel("dropout_mask")
def _dropout_mask(xp, ins, a, ctx):
    return _mask(xp, ins[0], a["p"], ctx)


@kernel("dropout")
def _dropout(xp, ins, a, ctx):
    x = ins[0]
    if not ctx.training or a["p"] == 0.0:
        return x
    return x * _mask(xp, x, a["p"], ctx)


# -- gradient rules -------------------------------------------------------------------------
@grad_rule("relu")
def _relu_rule(n, b, gy):
    return [b.emit("relu_grad", [gy, n.name])]


@grad_rule("add_relu")
def _add_relu_rule(n, b, gy):
    g = b.emit("relu_grad", [gy, n.name])
    return [g, g]


@grad_rule("leaky_relu")
def _leaky_rule(n, b, gy):
    return [b.emit("leaky_relu_grad", [gy, n.inputs[0]], {"slope": n.attrs["slope"]})]


@grad_rule("gelu")
def _gelu_rule(n, b, gy):
    return [b.emit("gelu_grad", [gy, n.inputs[0]], {"approximate": n.attrs["approximate"]})]


@grad_rule("sigmoid")
def _sigmoid_rule(n, b, gy):
    return [b.emit("sigmoid_grad", [gy, n.name])]


@grad_rule("tanh")
def _tanh_rule(n, b, gy):
    return [b.emit("tanh_grad", [gy, n.name])]
