"""conv1d, conv3d and conv_transpose2d, computed with conv2d's kernels.

- conv1d is a conv2d over a height of 1.
- conv3d is a sum over the kernel's depth offsets of conv2d's over depth slices: for offset
  i, the input slices at depths o*s + i*d (o = 0..Do-1) are stacked into the batch, so
  each offset is one conv2d of batch N*Do; dx and dW follow the same way.
- conv_transpose2d is conv2d's input gradient as a forward pass (weight [in, out/groups,
  kh, kw], torch's layout), cropped by the padding; its input gradient is a conv2d and
  its weight gradient is conv2d's weight gradient with the roles of x and dy exchanged.

Padding of conv1d and conv3d takes the same forms as conv2d's (int, one value per dim,
begins then ends, "same", "valid").
"""
from __future__ import annotations

from netdsl.errors import ShapeError
from netdsl.ir.opdef import (
    NON_NEGATIVE,
    POSITIVE,
    Arg,
    OpDef,
    ParamSpec,
    grad_rule,
    kernel,
    register,
)
from netdsl.ir.ops._util import need_float, need_rank, out_size, pair
from netdsl.ir.ops.conv import (
    _scratch_elems,
    conv2d_forward,
    conv2d_grad_input,
    conv2d_grad_weight,
    explicit_padding,
)
from netdsl.ir.ops.pool import spatial
from netdsl.ir.types import TensorType


def _geom(a, d, op):
    k = spatial(a["kernel"], d, "kernel", op)
    s = spatial(a["stride"], d, "stride", op)
    dil = spatial(a["dilation"], d, "dilation", op)
    begins, ends = explicit_padding({**a, "kernel": k, "dilation": dil}, d)
    return k, s, dil, begins, ends


def _conv_shape(op, d):
    def shape(ins, a):
        (x,) = ins
        need_rank(x, op, (d + 2,))
        need_float(x, op)
        c, g, o = x.shape[1], a["groups"], a["out_channels"]
        if o < 1 or g < 1:
            raise ShapeError(f"{op}: out_channels and groups must be positive")
        k, s, dil, begins, ends = _geom(a, d, op)
        if min(k + s + dil) < 1:
            raise ShapeError(f"{op}: kernel, stride and dilation must be positive")
        if min(begins + ends) < 0:
            raise ShapeError(f"{op}: padding must not be negative")
        if a["padding"] == "same" and max(s) != 1:
            raise ShapeError(f"{op}: padding=\"same\" needs stride 1 (as in torch)")
        if c % g or o % g:
            raise ShapeError(f"{op} with groups={g} needs input and output channels "
                             f"divisible by {g}, but {{x}} has {c} channels and out_channels "
                             f"is {o}")
        out = []
        for i, n in enumerate(x.shape[2:]):
            grown = n + abs(begins[i] - ends[i]) if isinstance(n, int) else n
            out.append(out_size(grown, k[i], s[i], min(begins[i], ends[i]), dil[i], op,
                                f"spatial dimension {i}"))
        return TensorType((x.shape[0], o) + tuple(out), x.dtype)
    return shape


def _conv_params(d, op):
    def params(ins, a):
        k = spatial(a["kernel"], d, "kernel", op)
        cg = ins[0].shape[1] // a["groups"]
        fan_in = cg
        for ki in k:
            fan_in *= ki
        p = {"weight": ParamSpec((a["out_channels"], cg) + k, "kaiming_normal", fan_in)}
        if a["bias"]:
            p["bias"] = ParamSpec((a["out_channels"],), "uniform_fan_in", fan_in)
        return p
    return params


def _conv_flops(d, op):
    def flops(ins, out, a):
        n = ins[0].shape[1] // a["groups"]
        for ki in spatial(a["kernel"], d, "kernel", op):
            n *= ki
        return 2 * out.numel() * n
    return flops


def _sig(kind):
    return (Arg("kernel", kind, 1, range=POSITIVE), Arg("stride", kind, 1, range=POSITIVE),
            Arg("padding", "padding", 0, range=NON_NEGATIVE),
            Arg("dilation", kind, 1, range=POSITIVE), Arg("groups", "int", 1, range=POSITIVE))


def _to_shape(ins, a):
    return TensorType(tuple(a["shape"]), ins[0].dtype)


for _op, _d in (("conv1d", 1), ("conv3d", 3)):
    _what = {1: "(N, C, L); weight [out, in/groups, k]",
             3: "(N, C, D, H, W); weight [out, in/groups, kd, kh, kw]"}[_d]
    register(OpDef(_op, (Arg("x", "tensor"), Arg("out_channels", "int", range=POSITIVE))
                   + _sig("ints") + (Arg("bias", "bool", True),),
                   _conv_shape(_op, _d), "conv", _conv_params(_d, _op), _conv_flops(_d, _op),
                   retains=("inputs", "weight"),
                   doc=f"{_d}-d convolution over {_what}; padding as conv2d's",
                   extra={"spatial": _d}, precision="reduced"))
    register(OpDef(f"{_op}_grad_input", (Arg("dy", "tensor"), Arg("weight", "tensor"),
                                         Arg("shape", "shape")) + _sig("ints"),
                   _to_shape, "backward", differentiable=False,
                   flops=lambda ins, out, a, _d=_d, _op=_op: _conv_flops(_d, _op)(
                       [out], ins[0], a),
                   doc=f"dx of {_op}", extra={"spatial": _d}, precision="reduced"))
    register(OpDef(f"{_op}_grad_weight", (Arg("dy", "tensor"), Arg("x", "tensor"),
                                          Arg("shape", "shape")) + _sig("ints"),
                   _to_shape, "backward", differentiable=False,
                   flops=lambda ins, out, a, _d=_d, _op=_op: _conv_flops(_d, _op)(
                       [ins[1]], ins[0], a),
                   doc=f"dW of {_op}", extra={"spatial": _d}, precision="reduced"))


# -- conv1d: conv2d over a height of 1 -----------------------------------------------------
def _attrs_1d(a):
    k, s, dil, (b,), (e,) = _geom(a, 1, "conv1d")
    return {"kernel": (1, k[0]), "stride": (1, s[0]), "dilation": (1, dil[0]),
            "padding": (0, b, 0, e), "groups": a["groups"]}


@kernel("conv1d")
def _conv1d(xp, ins, a, ctx):
    x, w = ins[0], ins[1]
    y = conv2d_forward(xp, x[:, :, None, :], w[:, :, None, :], _attrs_1d(a))[:, :, 0, :]
    if len(ins) > 2:
        y = y + ins[2].reshape(1, -1, 1)
    return xp.ascontiguousarray(y)


@kernel("conv1d_grad_input")
def _conv1d_gi(xp, ins, a, ctx):
    dy, w = ins
    n, c, length = (int(v) for v in a["shape"])
    return conv2d_grad_input(xp, dy[:, :, None, :], w[:, :, None, :], (n, c, 1, length),
                             _attrs_1d(a))[:, :, 0, :]


@kernel("conv1d_grad_weight")
def _conv1d_gw(xp, ins, a, ctx):
    dy, x = ins
    o, cg, k = (int(v) for v in a["shape"])
    return conv2d_grad_weight(xp, dy[:, :, None, :], x[:, :, None, :], (o, cg, 1, k),
                              _attrs_1d(a))[:, :, 0, :]


# -- conv3d: conv2d's over depth slices -------------------------------------------------------
def _attrs_3d(a, x_shape):
    k, s, dil, b, e = _geom(a, 3, "conv3d")
    a2 = {"kernel": k[1:], "stride": s[1:], "dilation": dil[1:],
          "padding": (b[1], b[2], e[1], e[2]), "groups": a["groups"]}
    depth = x_shape[2] + b[0] + e[0]
    do = (depth - dil[0] * (k[0] - 1) - 1) // s[0] + 1
    return a2, k[0], s[0], dil[0], b[0], e[0], do


def _depth_slices(xp, xd, i, s0, d0, do):
    """[N*Do, C, H, W]: the depth slices that kernel depth offset i reads."""
    sl = xd[:, :, i * d0:i * d0 + s0 * (do - 1) + 1:s0]
    n, c, _, h, w = sl.shape
    return xp.ascontiguousarray(sl.transpose(0, 2, 1, 3, 4)).reshape(n * do, c, h, w)


def _pad_depth(xp, x, b, e):
    if not (b or e):
        return x
    n, c, d, h, w = x.shape
    out = xp.zeros((n, c, d + b + e, h, w), dtype=x.dtype)
    out[:, :, b:b + d] = x
    return out


def _batched_dy(xp, dy):
    n, o, do, ho, wo = dy.shape
    return xp.ascontiguousarray(dy.transpose(0, 2, 1, 3, 4)).reshape(n * do, o, ho, wo)


@kernel("conv3d")
def _conv3d(xp, ins, a, ctx):
    x, w = ins[0], ins[1]
    a2, kd, s0, d0, b0, e0, do = _attrs_3d(a, x.shape)
    xd = _pad_depth(xp, x, b0, e0)
    y = None
    for i in range(kd):
        part = conv2d_forward(xp, _depth_slices(xp, xd, i, s0, d0, do), w[:, :, i], a2)
        y = part if y is None else y + part
    n = x.shape[0]
    y = y.reshape((n, do) + y.shape[1:]).transpose(0, 2, 1, 3, 4)
    if len(ins) > 2:
        y = y + ins[2].reshape(1, -1, 1, 1, 1)
    return xp.ascontiguousarray(y)


@kernel("conv3d_grad_input")
def _conv3d_gi(xp, ins, a, ctx):
    dy, w = ins
    shape = tuple(int(v) for v in a["shape"])
    n, c, d, h, wd = shape
    a2, kd, s0, d0, b0, e0, do = _attrs_3d(a, shape)
    dyb = _batched_dy(xp, dy)
    dxd = xp.zeros((n, c, d + b0 + e0, h, wd), dtype=dy.dtype)
    for i in range(kd):
        part = conv2d_grad_input(xp, dyb, w[:, :, i], (n * do, c, h, wd), a2)
        dxd[:, :, i * d0:i * d0 + s0 * (do - 1) + 1:s0] += \
            part.reshape(n, do, c, h, wd).transpose(0, 2, 1, 3, 4)
    return xp.ascontiguousarray(dxd[:, :, b0:b0 + d])


@kernel("conv3d_grad_weight")
def _conv3d_gw(xp, ins, a, ctx):
    dy, x = ins
    shape = tuple(int(v) for v in a["shape"])
    a2, kd, s0, d0, b0, e0, do = _attrs_3d(a, x.shape)
    xd = _pad_depth(xp, x, b0, e0)
    dyb = _batched_dy(xp, dy)
    gw = xp.empty(shape, dtype=dy.dtype)
    for i in range(kd):
        gw[:, :, i] = conv2d_grad_weight(xp, dyb, _depth_slices(xp, xd, i, s0, d0, do),
                                         shape[:2] + shape[3:], a2)
    return gw


def _conv_rule(op):
    def rule(n, b, gy):
        x, w = n.inputs[0], n.inputs[1]
        geom = {k: n.attrs[k] for k in ("kernel", "stride", "padding", "dilation", "groups")}
        out = [b.emit(f"{op}_grad_input", [gy, w], {"shape": b.type(x).shape, **geom},
                      tag="x"),
               b.emit(f"{op}_grad_weight", [gy, x], {"shape": b.type(w).shape, **geom},
                      tag="weight")]
        if len(n.inputs) > 2:
            out.append(b.emit("sum_except", [gy], {"axis": 1}, tag="bias"))
        return out
    return rule


grad_rule("conv1d")(_conv_rule("conv1d"))
grad_rule("conv3d")(_conv_rule("conv3d"))


# -- conv_transpose2d -------------------------------------------------------------------------
def _ct_shape(ins, a):
    (x,) = ins
    op = "conv_transpose2d"
    need_rank(x, op, (4,))
    need_float(x, op)
    c, g, o = x.shape[1], a["groups"], a["out_channels"]
    if o < 1 or g < 1:
        raise ShapeError(f"{op}: out_channels and groups must be positive")
    if c % g or o % g:
        raise ShapeError(f"{op} with groups={g} needs input and output channels divisible "
                         f"by {g}, but {{x}} has {c} channels and out_channels is {o}")
    k, s, p, dil, op_ = (pair(a[n]) for n in ("kernel", "stride", "padding", "dilation",
                                               "output_padding"))
    if min(k + s + dil) < 1 or min(p + op_) < 0:
        raise ShapeError(f"{op}: kernel, stride and dilation must be positive, padding and "
                         "output_padding >= 0")
    out = []
    for i, n in enumerate(x.shape[2:]):
        if op_[i] >= max(s[i], dil[i]):
            raise ShapeError(f"{op}: output_padding {op_[i]} must be smaller than the stride "
                             f"or the dilation")
        if not isinstance(n, int):
            raise ShapeError(f"{op}: spatial dims must be static, but {{x}} is {x}")
        size = (n - 1) * s[i] - 2 * p[i] + dil[i] * (k[i] - 1) + op_[i] + 1
        if size < 1:
            raise ShapeError(f"{op}: {{x}} ({x}) would give an empty output")
        out.append(size)
    return TensorType((x.shape[0], o) + tuple(out), x.dtype)


def _ct_params(ins, a):
    kh, kw = pair(a["kernel"])
    og = a["out_channels"] // a["groups"]
    fan_in = og * kh * kw  # torch's fan-in of a [in, out/groups, kh, kw] weight
    p = {"weight": ParamSpec((ins[0].shape[1], og, kh, kw), "kaiming_uniform", fan_in)}
    if a["bias"]:
        p["bias"] = ParamSpec((a["out_channels"],), "uniform_fan_in", fan_in)
    return p


def _ct_flops(ins, out, a):
    # out channels from the output type: the backward ops (which reuse this rule) carry
    # no out_channels attribute
    kh, kw = pair(a["kernel"])
    return 2 * ins[0].numel() * (out.shape[1] // a["groups"]) * kh * kw


_CT_GEOM = (Arg("kernel", "pair", 1, range=POSITIVE), Arg("stride", "pair", 1, range=POSITIVE),
            Arg("padding", "pair", 0, range=NON_NEGATIVE),
            Arg("output_padding", "pair", 0, range=NON_NEGATIVE),
            Arg("dilation", "pair", 1, range=POSITIVE), Arg("groups", "int", 1, range=POSITIVE))
def _ct_workspace(kind: str):
    """Float32 bytes of scratch: the full output (below) and the scratch of the conv2d
    kernel each runs on it (conv2d's rule: forward of the full dy for the input
    gradient, input gradient into the full output for the forward)."""
    def rule(ins, out, a):
        x = out if kind == "grad_input" else (ins[1] if kind == "grad_weight" else ins[0])
        n, cin = x.shape[0], x.shape[1]
        o = (ins[0].shape[1] if kind != "forward" else a["out_channels"])
        (fh, fw), conv = _full(a, x.shape[2:])
        full = (n, o, fh, fw)
        conv_kind = {"forward": "grad_input", "grad_input": "forward",
                     "grad_weight": "grad_weight"}[kind]
        return 4 * (n * o * fh * fw + _scratch_elems(conv_kind, full, cin, conv))
    return rule


register(OpDef("conv_transpose2d",
               (Arg("x", "tensor"), Arg("out_channels", "int", range=POSITIVE)) + _CT_GEOM
               + (Arg("bias", "bool", True),),
               _ct_shape, "conv", _ct_params, _ct_flops, _ct_workspace("forward"),
               retains=("inputs", "weight"),
               doc="transposed 2-d convolution (the adjoint of conv2d); weight [in, "
                   "out/groups, kh, kw]; output_padding adds to one side of the output",
                   precision="reduced"))
register(OpDef("conv_transpose2d_grad_input",
               (Arg("dy", "tensor"), Arg("weight", "tensor"), Arg("shape", "shape")) + _CT_GEOM,
               _to_shape, "backward", differentiable=False,
               flops=lambda ins, out, a: _ct_flops([out], ins[0], a),
               workspace=_ct_workspace("grad_input"),
               doc="dx of conv_transpose2d: a conv2d of dy", precision="reduced"))
register(OpDef("conv_transpose2d_grad_weight",
               (Arg("dy", "tensor"), Arg("x", "tensor"), Arg("shape", "shape")) + _CT_GEOM,
               _to_shape, "backward", differentiable=False,
               flops=lambda ins, out, a: _ct_flops([ins[1]], ins[0], a),
               workspace=_ct_workspace("grad_weight"),
               doc="dW of conv_transpose2d: conv2d's weight gradient with x and dy exchanged",
               precision="reduced"))


# Transposed convolution goes through the "full" output: the adjoint of an unpadded conv2d,
# of size (H - 1) * s + d * (k - 1) + 1, from which rows [p, p + Ho) are the result (those
# beyond the full output, which output_padding can ask for, are zero before the bias).
def _full(a, in_hw):
    """(full output height, width) and conv2d attributes without padding."""
    size = tuple((n - 1) * s + d * (k - 1) + 1 for n, s, d, k in
                 zip(in_hw, pair(a["stride"]), pair(a["dilation"]), pair(a["kernel"])))
    attrs = {k: a[k] for k in ("kernel", "stride", "dilation", "groups")}
    return size, {**attrs, "padding": (0, 0)}


def _crop_or_pad(xp, y, start, size):
    """y[:, :, start:start + size] per spatial dim, zeros where that runs past y's end."""
    n, c = y.shape[:2]
    out = xp.zeros((n, c) + tuple(size), dtype=y.dtype)
    h = min(size[0], y.shape[2] - start[0])
    w = min(size[1], y.shape[3] - start[1])
    out[:, :, :h, :w] = y[:, :, start[0]:start[0] + h, start[1]:start[1] + w]
    return out


@kernel("conv_transpose2d")
def _ct(xp, ins, a, ctx):
    x, w = ins[0], ins[1]
    n = x.shape[0]
    (fh, fw), conv = _full(a, x.shape[2:])
    o = w.shape[1] * a["groups"]
    full = conv2d_grad_input(xp, x, w, (n, o, fh, fw), conv)
    ph, pw = pair(a["padding"])
    oph, opw = pair(a["output_padding"])
    y = _crop_or_pad(xp, full, (ph, pw), (fh - 2 * ph + oph, fw - 2 * pw + opw))
    if len(ins) > 2:
        y += ins[2].reshape(1, -1, 1, 1)
    return y


def _dy_full(xp, dy, a, x_hw):
    """dy placed back into the full output (the adjoint of the crop)."""
    (fh, fw), conv = _full(a, x_hw)
    ph, pw = pair(a["padding"])
    full = xp.zeros(dy.shape[:2] + (fh, fw), dtype=dy.dtype)
    h, w = min(dy.shape[2], fh - ph), min(dy.shape[3], fw - pw)
    full[:, :, ph:ph + h, pw:pw + w] = dy[:, :, :h, :w]
    return full, conv


@kernel("conv_transpose2d_grad_input")
def _ct_gi(xp, ins, a, ctx):
    dy, w = ins
    full, conv = _dy_full(xp, dy, a, tuple(int(v) for v in a["shape"][2:]))
    return conv2d_forward(xp, full, w, conv)


@kernel("conv_transpose2d_grad_weight")
def _ct_gw(xp, ins, a, ctx):
    dy, x = ins
    full, conv = _dy_full(xp, dy, a, x.shape[2:])
    return conv2d_grad_weight(xp, x, full, tuple(int(v) for v in a["shape"]), conv)


@grad_rule("conv_transpose2d")
def _ct_rule(n, b, gy):
    x, w = n.inputs[0], n.inputs[1]
    geom = {k: n.attrs[k] for k in ("kernel", "stride", "padding", "output_padding",
                                    "dilation", "groups")}
    out = [b.emit("conv_transpose2d_grad_input", [gy, w], {"shape": b.type(x).shape, **geom},
                  tag="x"),
           b.emit("conv_transpose2d_grad_weight", [gy, x], {"shape": b.type(w).shape, **geom},
                  tag="weight")]
    if len(n.inputs) > 2:
        out.append(b.emit("sum_except", [gy], {"axis": 1}, tag="bias"))
    return out
