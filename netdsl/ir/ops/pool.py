"""Pooling over NCHW tensors."""
from netdsl.errors import ShapeError
from netdsl.ir.ops._util import need_float, need_rank, out_size, pair
from netdsl.ir.ops.conv import col2im_add, pad2d, windows
from netdsl.ir.registry import NON_NEGATIVE, POSITIVE, Arg, OpDef, grad_rule, kernel, register
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


_POOL_SIG = (Arg("x", "tensor"), Arg("kernel", "pair", range=POSITIVE),
             Arg("stride", "pair", None, range=POSITIVE),
             Arg("padding", "pair", 0, range=NON_NEGATIVE))
# maxpool's backward recomputes the argmax from x, so it keeps x but not its output
register(OpDef("maxpool", _POOL_SIG, _pool_shape("maxpool"), "pool", flops=_pool_flops,
               retains=("inputs",), doc="max pooling; stride defaults to kernel",
               extra={"default_from": {"stride": "kernel"}}))
register(OpDef("avgpool", _POOL_SIG, _pool_shape("avgpool"), "pool", flops=_pool_flops,
               doc="average pooling (padding counts as zeros); stride defaults to kernel",
               extra={"default_from": {"stride": "kernel"}}))


def _gap_shape(ins, a):
    (x,) = ins
    need_rank(x, "global_avgpool", (4,))
    need_float(x, "global_avgpool")
    return TensorType((x.shape[0], x.shape[1], 1, 1), x.dtype)


register(OpDef("global_avgpool", (Arg("x", "tensor"),), _gap_shape, "pool",
               flops=lambda ins, out, a: ins[0].numel(),
               doc="mean over height and width: [N, C, H, W] -> [N, C, 1, 1]"))


# -- backward operators -----------------------------------------------------------------------
def _to_shape(ins, a):
    return TensorType(tuple(a["shape"]), ins[0].dtype)


register(OpDef("maxpool_grad", (Arg("dy", "tensor"), Arg("x", "tensor")) + _POOL_SIG[1:],
               lambda ins, a: ins[1], "backward", flops=_pool_flops, differentiable=False,
               doc="route dy to the first maximum of each window (argmax recomputed from x)"))
register(OpDef("avgpool_grad", (Arg("dy", "tensor"), Arg("shape", "shape")) + _POOL_SIG[1:],
               _to_shape, "backward", flops=_pool_flops, differentiable=False,
               doc="spread dy evenly over each window (padding included in the count)"))
register(OpDef("global_avgpool_grad", (Arg("dy", "tensor"), Arg("shape", "shape")), _to_shape,
               "backward", flops=lambda ins, out, a: out.numel(), differentiable=False,
               doc="spread dy evenly over height and width"))


# -- kernels ----------------------------------------------------------------------------------
def _geom(x_shape, a):
    kh, kw = pair(a["kernel"])
    sh, sw = pair(a["stride"] if a["stride"] is not None else a["kernel"])
    ph, pw = pair(a["padding"])
    ho = (x_shape[2] + 2 * ph - kh) // sh + 1
    wo = (x_shape[3] + 2 * pw - kw) // sw + 1
    return kh, kw, sh, sw, ph, pw, ho, wo


def _max_windows(xp, x, a):
    kh, kw, sh, sw, ph, pw, ho, wo = _geom(x.shape, a)
    xpad = pad2d(xp, x, ph, pw, value=-xp.inf)
    return windows(xp, xpad, kh, kw, sh, sw, 1, 1, ho, wo)


@kernel("maxpool")
def _maxpool(xp, ins, a, ctx):
    return _max_windows(xp, ins[0], a).max(axis=(4, 5))


@kernel("maxpool_grad")
def _maxpool_grad(xp, ins, a, ctx):
    dy, x = ins
    kh, kw, sh, sw, ph, pw, ho, wo = _geom(x.shape, a)
    win = _max_windows(xp, x, a)
    n, c = x.shape[:2]
    arg = win.reshape(n, c, ho, wo, kh * kw).argmax(axis=-1)  # first maximum, like torch
    cols = (arg[..., None] == xp.arange(kh * kw)).astype(dy.dtype) * dy[..., None]
    dxpad = xp.zeros((n, c, x.shape[2] + 2 * ph, x.shape[3] + 2 * pw), dtype=dy.dtype)
    col2im_add(xp, dxpad, cols.reshape(n, c, ho, wo, kh, kw), kh, kw, sh, sw, 1, 1)
    return xp.ascontiguousarray(dxpad[:, :, ph:ph + x.shape[2], pw:pw + x.shape[3]])


@kernel("avgpool")
def _avgpool(xp, ins, a, ctx):
    x = ins[0]
    kh, kw, sh, sw, ph, pw, ho, wo = _geom(x.shape, a)
    win = windows(xp, pad2d(xp, x, ph, pw), kh, kw, sh, sw, 1, 1, ho, wo)
    return win.sum(axis=(4, 5)) * (1.0 / (kh * kw))  # count_include_pad, like torch


@kernel("avgpool_grad")
def _avgpool_grad(xp, ins, a, ctx):
    dy = ins[0]
    shape = tuple(a["shape"])
    kh, kw, sh, sw, ph, pw, ho, wo = _geom(shape, a)
    n, c, h, w = dy.shape[0], shape[1], shape[2], shape[3]
    cols = xp.broadcast_to((dy * (1.0 / (kh * kw)))[..., None, None], (n, c, ho, wo, kh, kw))
    dxpad = xp.zeros((n, c, h + 2 * ph, w + 2 * pw), dtype=dy.dtype)
    col2im_add(xp, dxpad, cols, kh, kw, sh, sw, 1, 1)
    return xp.ascontiguousarray(dxpad[:, :, ph:ph + h, pw:pw + w])


@kernel("global_avgpool")
def _gap(xp, ins, a, ctx):
    return ins[0].mean(axis=(2, 3), keepdims=True)


@kernel("global_avgpool_grad")
def _gap_grad(xp, ins, a, ctx):
    dy = ins[0]
    shape = tuple(a["shape"])
    return xp.ascontiguousarray(xp.broadcast_to(dy * (1.0 / (shape[2] * shape[3])),
                                                (dy.shape[0],) + shape[1:]))


# -- gradient rules ---------------------------------------------------------------------------
def _pool_attrs(n):
    return {k: n.attrs[k] for k in ("kernel", "stride", "padding")}


@grad_rule("maxpool")
def _maxpool_rule(n, b, gy):
    return [b.emit("maxpool_grad", [gy, n.inputs[0]], _pool_attrs(n))]


@grad_rule("avgpool")
def _avgpool_rule(n, b, gy):
    return [b.emit("avgpool_grad", [gy], {"shape": b.type(n.inputs[0]).shape, **_pool_attrs(n)})]


@grad_rule("global_avgpool")
def _gap_rule(n, b, gy):
    return [b.emit("global_avgpool_grad", [gy], {"shape": b.type(n.inputs[0]).shape})]
