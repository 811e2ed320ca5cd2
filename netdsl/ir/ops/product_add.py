"""conv2d_add and linear_add: a convolution or linear layer with a tensor added to its
output, which the `fuse` pass makes out of an `add` of two tensors of one type one of
whose terms is a conv2d or linear read by nothing else (a pre-activation ResNet block's
last 1x1 convolution plus its shortcut; a transformer layer's output projection or
second MLP layer plus its residual stream).

Same arguments, parameters and gradients as conv2d and linear; the residual's gradient
is the output's. With the backend's fused kernels, a 1x1 convolution's or a linear
layer's GEMM tasks add the residual to their block of the result while it is in cache
(netdsl.backends.numpy_fused_gemm), where the product and a separate add wrote the
result, read it back with the residual and wrote the sum; other paths add it after. The
sums are the unfused pair's: the product (plus its bias), then the residual.
"""
from netdsl.errors import ShapeError
from netdsl.ir.opdef import GPU_LIBRARIES, OPS, Arg, OpDef, grad_rule, kernel, register
from netdsl.ir.ops import conv, dense
from netdsl.ir.ops._util import fused_kernels


def _with_residual(op: str, shape):
    """The shape rule of `op` over x, with the residual checked against its result."""
    def rule(ins, a):
        x, r = ins
        y = shape((x,), a)
        if r != y:
            raise ShapeError(f"{op}: the tensor to add {{residual}} is {r}, but the "
                             f"{op.removesuffix('_add')} gives {y}")
        return y
    return rule


def _x_only(rule):
    """A conv2d or linear rule over (input types, ...) given x alone (the residual is not
    the layer's input: not in its parameters' fan-in, FLOPs or workspace)."""
    return lambda ins, *rest: rule(ins[:1], *rest)


def _plus_one_add(flops):
    return lambda ins, out, a: flops(ins[:1], out, a) + out.numel()


_CONV = conv.CONV2D_ARGS
register(OpDef(
    "conv2d_add", (_CONV[0], Arg("residual", "tensor")) + _CONV[1:],
    _with_residual("conv2d_add", conv.conv2d_shape), "conv", _x_only(conv.conv2d_params),
    _plus_one_add(conv.conv2d_flops), _x_only(conv.forward_workspace),
    retains=("input0", "weight"),
    doc="conv2d(x) + residual in one kernel (made by the `fuse` pass from an add of two "
        "tensors of one type one of which is a conv2d read only by the add); arguments and "
        "parameters as conv2d's",
    extra={"spatial": 2, "fused_kernels": conv.kernel_groups, "gpu_variant": True},
    precision="reduced"))

register(OpDef(
    "linear_add", (dense.LINEAR_ARGS[0], Arg("residual", "tensor")) + dense.LINEAR_ARGS[1:],
    _with_residual("linear_add", dense.linear_shape), "linear",
    _x_only(dense.linear_params), _plus_one_add(dense.linear_flops),
    retains=("input0", "weight"),
    doc="linear(x) + residual in one kernel (made by the `fuse` pass from an add of two "
        "tensors of one type one of which is a linear read only by the add); arguments and "
        "parameters as linear's",
    extra={"fused_kernels": ("gemm",)}, precision="reduced"))


@kernel("conv2d_add")
def _conv2d_add(xp, ins, a, ctx):
    x, r, w = ins[0], ins[1], ins[2]
    bias = ins[3] if len(ins) > 3 else None
    # (the fused kernels asked for x and w as conv2d asks; the GEMM tasks check r)
    y = conv.conv2d_forward(xp, x, w, a, ctx.out, conv.conv_fast(ctx, a, x, w),
                            conv.conv_dnn(ctx, a), residual=r if bias is None else None)
    if bias is not None:  # the bias first, then the residual: the unfused pair's sums
        y += bias.reshape(1, w.shape[0], 1, 1)
        y += r
    return y


@kernel("linear_add")
def _linear_add(xp, ins, a, ctx):
    x, r, w = ins[0], ins[1], ins[2]
    return dense.rows_times(xp, x, w.T, fused_kernels(ctx, x, w),
                            ins[3] if len(ins) > 3 else None, residual=r)


def _rule(layer_rule):
    """The layer's gradient rule over the node without its residual, whose gradient is
    the output's own."""
    def rule(n, b, gy):
        grads = layer_rule(_Layer(n), b, gy)
        return grads[:1] + [gy] + grads[1:]
    return rule


class _Layer:
    """A conv2d_add or linear_add node seen as its conv2d or linear (the inputs less the
    residual), for that op's gradient rule."""

    def __init__(self, n):
        self.inputs = n.inputs[:1] + n.inputs[2:]
        self.attrs = n.attrs


grad_rule("conv2d_add")(_rule(conv.conv2d_rule))
grad_rule("linear_add")(_rule(dense.linear_rule))

# on a GPU, cuBLAS and cuDNN read and write f16 themselves (mixed precision)
for _name in ("conv2d_add", "linear_add"):
    OPS[_name].reads_reduced = GPU_LIBRARIES
