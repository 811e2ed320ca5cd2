"""2-d convolution (NCHW, weights OIHW)."""
from netdsl.errors import ShapeError
from netdsl.ir.ops._util import need_float, need_rank, out_size, pair
from netdsl.ir.registry import Arg, OpDef, ParamSpec, register
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
    _shape, "conv", _params, _flops, _workspace, retains=("inputs", "params"),
    doc="2-d convolution over NCHW input; weight [out, in/groups, kh, kw]"))
