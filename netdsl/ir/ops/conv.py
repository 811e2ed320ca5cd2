"""2-d convolution (NCHW, weights OIHW)."""
from netdsl.errors import ShapeError
from netdsl.ir.ops._util import need_float, need_rank, out_size, pair
from netdsl.ir.registry import Arg, OpDef, ParamSpec, grad_rule, kernel, register
from netdsl.ir.types import TensorType


def _geometry(x: TensorType, a):
    kh, kw = pair(a["kernel"])
    sh, sw = pair(a["stride"])
    ph, pw = pair(a["padding"])
    dh, dw = pair(a["dilation"])
    return kh, kw, sh, sw, ph, pw, dh, dw


def _shape(ins, a):
    (x,) = ins
    need_rank(x, "conv2d", (4,))
    need_float(x, "conv2d")
    c = x.shape[1]
    g, o = a["groups"], a["out_channels"]
    if o < 1 or g < 1:
        raise ShapeError("conv2d: out_channels and groups must be positive")
    if min(pair(a["kernel"]) + pair(a["stride"]) + pair(a["dilation"])) < 1:
        raise ShapeError("conv2d: kernel, stride and dilation must be positive")
    if min(pair(a["padding"])) < 0:
        raise ShapeError("conv2d: padding must not be negative")
    if c % g or o % g:
        raise ShapeError(f"conv2d with groups={g} needs input and output channels divisible "
                         f"by {g}, but {{x}} has {c} channels and out_channels is {o}")
    kh, kw, sh, sw, ph, pw, dh, dw = _geometry(x, a)
    ho = out_size(x.shape[2], kh, sh, ph, dh, "conv2d", "height")
    wo = out_size(x.shape[3], kw, sw, pw, dw, "conv2d", "width")
    return TensorType((x.shape[0], o, ho, wo), x.dtype)


def _params(ins, a):
    (x,) = ins
    kh, kw = pair(a["kernel"])
    cg = x.shape[1] // a["groups"]
    fan_in = cg * kh * kw
    p = {"weight": ParamSpec((a["out_channels"], cg, kh, kw), "kaiming_normal", fan_in)}
    if a["bias"]:
        p["bias"] = ParamSpec((a["out_channels"],), "uniform_fan_in", fan_in)
    return p


def _flops(ins, out, a):
    kh, kw = pair(a["kernel"])
    cg = ins[0].shape[1] // a["groups"]
    return 2 * out.numel() * cg * kh * kw


def _workspace(ins, out, a):
    # im2col buffer: one column of C/g*kh*kw values per output pixel; none for a 1x1/1 conv
    kh, kw = pair(a["kernel"])
    if (kh, kw) == (1, 1) and pair(a["stride"]) == (1, 1) and pair(a["padding"]) == (0, 0):
        return 0
    n, o, ho, wo = out.shape
    return n * ins[0].shape[1] * kh * kw * ho * wo * 4


register(OpDef(
    "conv2d",
    (Arg("x", "tensor"), Arg("out_channels", "int"), Arg("kernel", "pair", 1),
     Arg("stride", "pair", 1), Arg("padding", "pair", 0), Arg("dilation", "pair", 1),
     Arg("groups", "int", 1), Arg("bias", "bool", True)),
    _shape, "conv", _params, _flops, _workspace, retains=("inputs", "weight"),
    doc="2-d convolution over NCHW input; weight [out, in/groups, kh, kw]"))


# -- backward operators -----------------------------------------------------------------------
_GEOM = (Arg("kernel", "pair", 1), Arg("stride", "pair", 1), Arg("padding", "pair", 0),
         Arg("dilation", "pair", 1), Arg("groups", "int", 1))


def _to_shape(ins, a):
    return TensorType(tuple(a["shape"]), ins[0].dtype)


register(OpDef("conv2d_grad_input", (Arg("dy", "tensor"), Arg("weight", "tensor"),
                                     Arg("shape", "shape")) + _GEOM,
               _to_shape, "backward", differentiable=False,
               flops=lambda ins, out, a: _flops([out], ins[0], a),
               workspace=lambda ins, out, a: _workspace([out], ins[0], a),
               doc="dx of conv2d: GEMM of dy with the weight, then col2im; `shape` is x's"))
register(OpDef("conv2d_grad_weight", (Arg("dy", "tensor"), Arg("x", "tensor"),
                                      Arg("shape", "shape")) + _GEOM,
               _to_shape, "backward", differentiable=False,
               flops=lambda ins, out, a: _flops([ins[1]], ins[0], a),
               workspace=lambda ins, out, a: _workspace([ins[1]], ins[0], a),
               doc="dW of conv2d: GEMM of dy with im2col(x); `shape` is the weight's"))


# -- kernels ----------------------------------------------------------------------------------
def windows(xp, xpad, kh, kw, sh, sw, dh, dw, ho, wo):
    """A zero-copy [N, C, Ho, Wo, kh, kw] view of the sliding windows of padded NCHW input."""
    s0, s1, s2, s3 = xpad.strides
    return xp.lib.stride_tricks.as_strided(
        xpad, (xpad.shape[0], xpad.shape[1], ho, wo, kh, kw),
        (s0, s1, s2 * sh, s3 * sw, s2 * dh, s3 * dw))


def pad2d(xp, x, ph, pw, value=0.0):
    if ph == 0 and pw == 0:
        return xp.ascontiguousarray(x)
    return xp.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=value)


def col2im_add(xp, dxpad, cols, kh, kw, sh, sw, dh, dw):
    """Scatter-add `cols` [N, C, Ho, Wo, kh, kw] back onto padded input `dxpad` in place:
    one strided add per kernel offset (the adjoint of `windows`)."""
    ho, wo = cols.shape[2], cols.shape[3]
    for i in range(kh):
        for j in range(kw):
            r, c = i * dh, j * dw
            dxpad[:, :, r:r + sh * (ho - 1) + 1:sh, c:c + sw * (wo - 1) + 1:sw] += cols[..., i, j]


def _im2col(xp, x, a, ho, wo):
    """[G, N*Ho*Wo, C/G*kh*kw] columns (a copy: the GEMM needs them contiguous)."""
    kh, kw, sh, sw, ph, pw, dh, dw = _geometry(None, a)
    g = a["groups"]
    n, c = x.shape[0], x.shape[1]
    win = windows(xp, pad2d(xp, x, ph, pw), kh, kw, sh, sw, dh, dw, ho, wo)
    win = win.reshape(n, g, c // g, ho, wo, kh, kw).transpose(1, 0, 3, 4, 2, 5, 6)
    return win.reshape(g, n * ho * wo, (c // g) * kh * kw)


@kernel("conv2d")
def _conv2d(xp, ins, a, ctx):
    x, w = ins[0], ins[1]
    n = x.shape[0]
    o, g = w.shape[0], a["groups"]
    kh, kw, sh, sw, ph, pw, dh, dw = _geometry(None, a)
    ho = (x.shape[2] + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (x.shape[3] + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if (kh, kw, sh, sw, ph, pw, g) == (1, 1, 1, 1, 0, 0, 1):
        y = xp.matmul(w.reshape(o, -1), x.reshape(n, x.shape[1], -1)).reshape(n, o, ho, wo)
    else:
        cols = _im2col(xp, x, a, ho, wo)
        wm = w.reshape(g, o // g, -1)
        y = xp.matmul(cols, wm.transpose(0, 2, 1))  # [G, N*Ho*Wo, O/G]
        y = y.reshape(g, n, ho, wo, o // g).transpose(1, 0, 4, 2, 3).reshape(n, o, ho, wo)
        y = xp.ascontiguousarray(y)
    if len(ins) > 2:
        y += ins[2].reshape(1, o, 1, 1)
    return y


@kernel("conv2d_grad_weight")
def _conv2d_gw(xp, ins, a, ctx):
    dy, x = ins
    n, o, ho, wo = dy.shape
    g = a["groups"]
    dym = dy.reshape(n, g, o // g, ho * wo).transpose(1, 2, 0, 3).reshape(g, o // g, -1)
    cols = _im2col(xp, x, a, ho, wo)
    return xp.matmul(dym, cols).reshape(tuple(a["shape"]))


@kernel("conv2d_grad_input")
def _conv2d_gi(xp, ins, a, ctx):
    dy, w = ins
    n, o, ho, wo = dy.shape
    g = a["groups"]
    _, c, h, wd = a["shape"]
    kh, kw, sh, sw, ph, pw, dh, dw = _geometry(None, a)
    if (kh, kw, sh, sw, ph, pw, g) == (1, 1, 1, 1, 0, 0, 1):
        return xp.matmul(w.reshape(o, -1).T, dy.reshape(n, o, -1)).reshape(n, c, h, wd)
    # columns laid out [G, C/G, kh, kw, N, Ho, Wo] so each kernel offset's slab is contiguous
    dym = dy.reshape(n, g, o // g, ho * wo).transpose(1, 2, 0, 3).reshape(g, o // g, -1)
    wt = w.reshape(g, o // g, -1).transpose(0, 2, 1)  # [G, C/G*kh*kw, O/G]
    dcols = xp.matmul(wt, dym).reshape(g, c // g, kh, kw, n, ho, wo)
    dxpad = xp.zeros((n, g, c // g, h + 2 * ph, wd + 2 * pw), dtype=dy.dtype)
    for i in range(kh):
        for j in range(kw):
            r, q = i * dh, j * dw
            dxpad[:, :, :, r:r + sh * (ho - 1) + 1:sh, q:q + sw * (wo - 1) + 1:sw] += \
                dcols[:, :, i, j].transpose(2, 0, 1, 3, 4)
    dxpad = dxpad.reshape(n, c, h + 2 * ph, wd + 2 * pw)
    return xp.ascontiguousarray(dxpad[:, :, ph:ph + h, pw:pw + wd])


# -- gradient rule ----------------------------------------------------------------------------
@grad_rule("conv2d")
def _conv2d_rule(n, b, gy):
    x, w = n.inputs[0], n.inputs[1]
    geom = {k: n.attrs[k] for k in ("kernel", "stride", "padding", "dilation", "groups")}
    out = [b.emit("conv2d_grad_input", [gy, w], {"shape": b.type(x).shape, **geom}, tag="x"),
           b.emit("conv2d_grad_weight", [gy, x], {"shape": b.type(w).shape, **geom},
                  tag="weight")]
    if len(n.inputs) > 2:
        out.append(b.emit("sum_except", [gy], {"axis": 1}, tag="bias"))
    return out
