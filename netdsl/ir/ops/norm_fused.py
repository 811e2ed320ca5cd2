"""batchnorm_relu: relu(batchnorm(x)) as one operator, which the `fuse` pass makes out of a
batchnorm whose only reader is a relu (pre-activation ResNets, DenseNets, and most
post-activation blocks), or a relu6 (MobileNets: `cap=6`, the output clamped to [0, 6]
and the backward's mask 0 < z < 6, relu6's).

Same arguments, parameters, buffers and running-statistics updates as batchnorm. Its
backward is batchnorm's two backward nodes with `relu=true`: the relu mask (z > 0, z the
affine output) is recomputed from x, weight and bias inside the statistics and dx passes,
so neither the pre-activation value nor a mask is kept. With the backend's fused kernels
the forward is one pass over x (statistics per channel while the channel is in cache,
then y), each backward node one more.
"""
from netdsl.ir.opdef import FUSED_LOOPS, GT0, Arg, OpDef, Range, grad_rule, kernel, register
from netdsl.ir.ops.norm import _bn_params, _bn_shape, _bn_writes, bn_forward, bn_rule

register(OpDef(
    "batchnorm_relu",
    (Arg("x", "tensor"), Arg("eps", "float", 1e-5, range=GT0),
     Arg("momentum", "float", 0.1, range=Range(0, 1)),
     Arg("affine", "bool", True), Arg("zero_init", "bool", False),
     Arg("cap", "float", None, range=GT0)),
    _bn_shape, "norm", _bn_params, lambda ins, out, a: 9 * out.numel(),
    retains=("inputs", "weight", "bias"), writes=_bn_writes,
    extra={"replay": True, "fused_kernels": ("batchnorm",)}, reads_reduced=FUSED_LOOPS,
    doc="relu(batchnorm(x)) in one kernel (made by the `fuse` pass from a batchnorm read "
        "only by a relu), min(relu(batchnorm(x)), cap) with a cap (from relu6: cap=6); "
        "arguments, parameters and buffers as batchnorm's"))


@kernel("batchnorm_relu")
def _batchnorm_relu(xp, ins, a, ctx):
    return bn_forward(xp, ins, a, ctx, relu=True)


grad_rule("batchnorm_relu")(bn_rule(relu=True))
