"""The f16 loss scale's two operators (the `loss_scale` pass, netdsl.passes.precision):

- `found_inf(grads...)`: 1.0 where any element of the gradients is inf or NaN, else 0.0
  (an f32 scalar), as torch.amp.GradScaler's `_amp_foreach_non_finite_check_and_unscale_`
  finds them. Each gradient's max and min are read (NaN propagates through both), so no
  temporary the gradient's size is made; a split sums the devices' flags with an
  all_reduce.
- `unscale(grad, scale, found_inf)`: grad * (1 / scale) in the gradient's type (f32).
  It reads the flag only so that it runs after every gradient has been checked: the
  optimizer's updates read the unscaled gradients, so no schedule (the planner's eager
  updates included) can update a parameter before the step is known to be kept. The
  updates themselves are skipped by the executor where the flag is set (`meta["gate"]`).
"""
from netdsl.errors import ShapeError
from netdsl.ir.opdef import Arg, OpDef, kernel, register
from netdsl.ir.types import TensorType


def _found_inf_shape(ins, a):
    if not ins:
        raise ShapeError("found_inf: no gradients")
    return TensorType((), "f32")


def _unscale_shape(ins, a):
    g, scale, flag = ins
    if scale.shape != () or flag.shape != ():
        raise ShapeError(f"unscale expects a scalar scale and flag, got {scale} and {flag}")
    return g


register(OpDef(
    "found_inf", (Arg("grads", "tensors"),), _found_inf_shape, "optimizer",
    flops=lambda ins, out, a: 2 * sum(t.numel() for t in ins), differentiable=False,
    doc="1 where any gradient element is inf or NaN, else 0 (the f16 loss scale's check)"))
register(OpDef(
    "unscale", (Arg("grad", "tensor"), Arg("scale", "tensor"), Arg("found_inf", "tensor")),
    _unscale_shape, "optimizer", flops=lambda ins, out, a: ins[0].numel(),
    differentiable=False,
    doc="grad / scale, after the step's found_inf (the f16 loss scale's unscaling)"))


@kernel("found_inf")
def _found_inf(xp, ins, a, ctx):
    bad = xp.zeros((), xp.float32)  # (kept on the device: no host read inside a step)
    for g in ins:
        if g.size:
            ok = xp.logical_and(xp.isfinite(g.max()), xp.isfinite(g.min()))
            bad = xp.maximum(bad, xp.logical_not(ok))
    return bad.astype(xp.float32)


@kernel("unscale")
def _unscale(xp, ins, a, ctx):
    g, scale = ins[0], ins[1]
    # the reciprocal of a power of two in f32, as GradScaler's inv_scale: exact
    inv = (xp.asarray(1.0, xp.float64) / scale.astype(xp.float64)).astype(g.dtype)
    return ctx.into(xp.multiply, g, inv)
