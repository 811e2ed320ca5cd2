"""The running-statistics update of a batchnorm (a state update emitted by a pass, like the
optimizer's, so not callable from the language) whose batch statistics were computed
elsewhere in the graph (synchronised batchnorm across devices: see
netdsl/parallel/syncbn.py). It writes the running mean and variance in place, as
training-mode `batchnorm` does, with PyTorch's rule (unbiased variance in the running var).
"""
from netdsl.errors import ShapeError
from netdsl.ir.registry import Arg, OpDef, Range, grad_rule, kernel, register
from netdsl.ir.types import TensorType


def _first(ins, a):
    return ins[0]


register(OpDef(
    "bn_running_update",
    (Arg("running_mean", "tensor"), Arg("running_var", "tensor"), Arg("mean", "tensor"),
     Arg("var", "tensor"), Arg("momentum", "float", 0.1, range=Range(0, 1)),
     Arg("count", "int", 1, range=Range(1))),
    _first, "optimizer", flops=lambda ins, out, a: 6 * out.numel(), differentiable=False,
    writes=(0, 1), view_of=0,
    doc="update batchnorm running statistics in place from a batch mean and (biased) var"))


@kernel("bn_running_update")
def _bn_running_update(xp, ins, a, ctx):
    rm, rv, mean, var = ins
    m, count = a["momentum"], a["count"]
    rm *= 1.0 - m
    rm += m * mean
    rv *= 1.0 - m
    rv += (m * count / max(count - 1, 1)) * var
    return rm


# -- the element-wise parts of a synchronised batchnorm ---------------------------------------
# syncbn.py computes the statistics over every device (sums, all_reduce) and normalises
# with these: one pass over x each, instead of the sub, mul, sum and add nodes (and their
# gradients) that spelled them out. `center`, `scale` and `bias` are per-channel values
# shaped to broadcast against x ([1, C, 1, 1]); passes emit them, so they are internal.
def _per_channel(name):
    def shape(ins, a):
        x, c = ins[0], ins[1]
        for t in ins[1:]:
            if (t.shape != c.shape or len(t.shape) != len(x.shape)
                    or any(s not in (1, xs) for s, xs in zip(t.shape, x.shape, strict=True))):
                raise ShapeError(f"{name}: {t} does not broadcast per channel against {x}, "
                                 f"or differs from the centre {c}")
        return TensorType(x.shape if name == "centered_affine" else c.shape, x.dtype)
    return shape


def _three_passes(ins, out, a):
    return 3 * ins[0].numel()


def _deviations(ins, out, a):
    return 4 * ins[-2].numel()  # x - center beside the result (rules count float32)


register(OpDef(
    "centered_affine",
    (Arg("x", "tensor"), Arg("center", "tensor"), Arg("scale", "tensor"),
     Arg("bias", "tensor", None)),
    _per_channel("centered_affine"), "norm", flops=_three_passes,
    retains=("input0", "input1", "input2"),  # (not the bias)
    extra={"internal": True},
    doc="(x - center) * scale + bias, per channel: a synchronised batchnorm's normalising "
        "pass with statistics computed over every device"))
register(OpDef(
    "centered_sq_sum", (Arg("x", "tensor"), Arg("center", "tensor")),
    _per_channel("centered_sq_sum"), "norm", flops=_three_passes, workspace=_deviations,
    retains=("inputs",), extra={"internal": True},
    doc="sum((x - center)^2) over the axes center has as 1: a synchronised batchnorm's "
        "second statistics pass (the two-pass variance)"))
register(OpDef(
    "centered_dot", (Arg("g", "tensor"), Arg("x", "tensor"), Arg("center", "tensor")),
    lambda ins, a: _per_channel("centered_dot")(ins[1:], a), "backward",
    flops=_three_passes, workspace=_deviations, differentiable=False,
    doc="sum(g * (x - center)) over the axes center has as 1: the scale's gradient of "
        "centered_affine"))


def _channel_dot(xp, u, v, shape):
    """sum(u * v) over the axes `shape` has as 1 (an einsum: one pass, no temporary)."""
    letters = "abcdefghij"[:u.ndim]
    keep = "".join(x for x, s in zip(letters, shape, strict=True) if s != 1)
    return xp.einsum(f"{letters},{letters}->{keep}", u, v).reshape(shape)


@kernel("centered_affine")
def _centered_affine(xp, ins, a, ctx):
    x, c, k = ins[0], ins[1], ins[2]
    y = ctx.out_like(x)
    xp.subtract(x, c, out=y)
    y *= k
    if len(ins) > 3:
        y += ins[3]
    return y


@kernel("centered_sq_sum")
def _centered_sq_sum(xp, ins, a, ctx):
    x, c = ins
    d = x - c
    return _channel_dot(xp, d, d, c.shape)


@kernel("centered_dot")
def _centered_dot(xp, ins, a, ctx):
    g, x, c = ins
    return _channel_dot(xp, g, x - c, c.shape)


@grad_rule("centered_affine")
def _centered_affine_rule(n, b, gy):
    x, c, k = n.inputs[:3]
    per = b.type(c).shape
    total = b.emit("sum_to", [gy], {"shape": per}, tag="sum")  # sum(gy) per channel
    out = [b.emit("mul", [gy, k], tag="x"),
           b.emit("scale", [b.emit("mul", [total, k], tag="c")], {"factor": -1.0},
                  tag="center"),
           b.emit("centered_dot", [gy, x, c], tag="scale")]
    return out + ([total] if len(n.inputs) > 3 else [])


@grad_rule("centered_sq_sum")
def _centered_sq_sum_rule(n, b, gy):
    x, c = n.inputs
    twice = b.emit("scale", [gy], {"factor": 2.0}, tag="twice")
    dx = b.emit("centered_affine", [x, c, twice], tag="x")  # 2 (x - c) g
    return [dx, b.emit("scale", [b.emit("sum_to", [dx], {"shape": b.type(c).shape},
                                        tag="sum")], {"factor": -1.0}, tag="center")]
