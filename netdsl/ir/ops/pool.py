"""Pooling over NCHW tensors."""
from netdsl.errors import ShapeError
from netdsl.ir.ops._util import need_float, need_rank, out_size, pair
from netdsl.ir.registry import Arg, OpDef, register
from netdsl.ir.types import TensorType


def _pool_shape(op):
    def shape(ins, a):
        (x,) = ins
        need_rank(x, op, (4,))
        need_float(x, op)
        kh, kw = pair(a["kernel"])
        sh, sw = pair(a["stride"] if a["stride"] is not None else a["kernel"])
        ph, pw = pair(a["padding"])
        if min(kh, kw, sh, sw) < 1 or min(ph, pw) < 0:
            raise ShapeError(f"{op}: kernel and stride must be positive, padding >= 0")
        if ph > kh // 2 or pw > kw // 2:
            raise ShapeError(f"{op}: padding {a['padding']} is more than half the kernel "
                             f"{a['kernel']}")
        ho = out_size(x.shape[2], kh, sh, ph, 1, op, "height")
        wo = out_size(x.shape[3], kw, sw, pw, 1, op, "width")
        return TensorType((x.shape[0], x.shape[1], ho, wo), x.dtype)
    return shape


def _pool_flops(ins, out, a):
    kh, kw = pair(a["kernel"])
    return out.numel() * kh * kw


_POOL_SIG = (Arg("x", "tensor"), Arg("kernel", "pair"), Arg("stride", "pair", None),
             Arg("padding", "pair", 0))
register(OpDef("maxpool", _POOL_SIG, _pool_shape("maxpool"), "pool", flops=_pool_flops,
               retains=("inputs", "output"), doc="max pooling; stride defaults to kernel"))
register(OpDef("avgpool", _POOL_SIG, _pool_shape("avgpool"), "pool", flops=_pool_flops,
               doc="average pooling (padding counts as zeros); stride defaults to kernel"))


def _gap_shape(ins, a):
    (x,) = ins
    need_rank(x, "global_avgpool", (4,))
    need_float(x, "global_avgpool")
    return TensorType((x.shape[0], x.shape[1], 1, 1), x.dtype)


register(OpDef("global_avgpool", (Arg("x", "tensor"),), _gap_shape, "pool",
               flops=lambda ins, out, a: ins[0].numel(),
               doc="mean over height and width: [N, C, H, W] -> [N, C, 1, 1]"))
