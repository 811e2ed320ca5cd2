"""2-d convolution (NCHW, weights OIHW).

Padding is an int or (ph, pw) (both sides alike), a 4-tuple (top, left, bottom, right)
(ONNX's pads order: all begins, then all ends), "valid" (none) or "same" (stride 1 only;
total d*(k-1) per dim, the odd one at the end, as torch). `explicit_padding` gives the
(begins, ends) of any form. The kernels run on symmetric padding; the asymmetric excess is
zero-padded onto x first (and cropped off dx).
"""
import functools

from netdsl.errors import ShapeError
from netdsl.ir.opdef import (
    GPU_LIBRARIES,
    NON_NEGATIVE,
    OPS,
    POSITIVE,
    Arg,
    OpDef,
    ParamSpec,
    grad_rule,
    kernel,
    register,
)
from netdsl.ir.ops import conv_winograd as winograd
from netdsl.ir.ops._util import fused_kernels, matmul, need_float, need_rank, out_size, pair
from netdsl.ir.types import TensorType


def explicit_padding(a, d: int = 2) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(begins, ends) per spatial dim of a convolution's `padding` attribute."""
    p = a["padding"]
    if p == "valid":
        return (0,) * d, (0,) * d
    if p == "same":
        k = _dims(a["kernel"], d)
        dil = _dims(a["dilation"], d)
        total = tuple(di * (ki - 1) for ki, di in zip(k, dil))
        return tuple(t // 2 for t in total), tuple(t - t // 2 for t in total)
    t = tuple(p) if isinstance(p, (tuple, list)) else (p,)
    if len(t) == 1:
        t = t * d
    if len(t) == d:
        return tuple(t), tuple(t)
    if len(t) == 2 * d:
        return tuple(t[:d]), tuple(t[d:])
    raise ShapeError(f"padding {p} needs 1, {d} or {2 * d} values, \"same\" or \"valid\"")


def _dims(v, d):
    t = tuple(v) if isinstance(v, (tuple, list)) else (v,)
    return t * d if len(t) == 1 else t


def _split(a):
    """The symmetric part of the padding (attrs for the kernels) and the excess per side."""
    begins, ends = explicit_padding(a)
    sym = tuple(min(b, e) for b, e in zip(begins, ends))
    extra = tuple(b - m for b, m in zip(begins, sym)), tuple(e - m for e, m in zip(ends, sym))
    return {**a, "padding": sym}, extra


def _pad_extra(xp, x, extra):
    (bh, bw), (eh, ew) = extra
    if not (bh or bw or eh or ew):
        return x
    n, c, h, w = x.shape
    out = xp.zeros((n, c, h + bh + eh, w + bw + ew), dtype=x.dtype)
    out[:, :, bh:bh + h, bw:bw + w] = x
    return out


def _geometry(x: TensorType, a):
    kh, kw = pair(a["kernel"])
    sh, sw = pair(a["stride"])
    ph, pw = pair(a["padding"])
    dh, dw = pair(a["dilation"])
    return kh, kw, sh, sw, ph, pw, dh, dw


def conv2d_shape(ins, a):
    (x,) = ins
    need_rank(x, "conv2d", (4,))
    need_float(x, "conv2d")
    c = x.shape[1]
    g, o = a["groups"], a["out_channels"]
    if o < 1 or g < 1:
        raise ShapeError("conv2d: out_channels and groups must be positive")
    if min(pair(a["kernel"]) + pair(a["stride"]) + pair(a["dilation"])) < 1:
        raise ShapeError("conv2d: kernel, stride and dilation must be positive")
    begins, ends = explicit_padding(a)
    if min(begins + ends) < 0:
        raise ShapeError("conv2d: padding must not be negative")
    if a["padding"] == "same" and pair(a["stride"]) != (1, 1):
        raise ShapeError("conv2d: padding=\"same\" needs stride 1 (as in torch)")
    if c % g or o % g:
        raise ShapeError(f"conv2d with groups={g} needs input and output channels divisible "
                         f"by {g}, but {{x}} has {c} channels and out_channels is {o}")
    return TensorType((x.shape[0], o) + conv_out(x, a, "conv2d"), x.dtype)


def conv_out(x: TensorType, a, op: str) -> tuple[int, int]:
    """Output height and width of a 2-d convolution of x (any padding form)."""
    kh, kw = pair(a["kernel"])
    sh, sw = pair(a["stride"])
    dh, dw = pair(a["dilation"])
    (bh, bw), (eh, ew) = explicit_padding(a)
    # out_size takes symmetric padding: feed it the input grown by the excess of one side
    ho = out_size(_grow(x.shape[2], bh, eh), kh, sh, min(bh, eh), dh, op, "height")
    wo = out_size(_grow(x.shape[3], bw, ew), kw, sw, min(bw, ew), dw, op, "width")
    return ho, wo


def _grow(size, b, e):
    return size + abs(b - e) if isinstance(size, int) else size


def conv2d_params(ins, a):
    (x,) = ins
    kh, kw = pair(a["kernel"])
    cg = x.shape[1] // a["groups"]
    fan_in = cg * kh * kw
    p = {"weight": ParamSpec((a["out_channels"], cg, kh, kw), "kaiming_normal", fan_in)}
    if a["bias"]:
        p["bias"] = ParamSpec((a["out_channels"],), "uniform_fan_in", fan_in)
    return p


def conv2d_flops(ins, out, a):
    kh, kw = pair(a["kernel"])
    cg = ins[0].shape[1] // a["groups"]
    return 2 * out.numel() * cg * kh * kw


def _scratch_elems(kind: str, x_shape, o: int, a) -> int:
    """Elements of scratch the kernel of `kind` (forward | grad_input | grad_weight) takes
    besides its inputs and result, path by path as the kernels below allocate it: padded
    copies, flat-shift accumulators, im2col columns. The memory plan reserves the largest
    of these as the shared workspace region, so this must follow the kernels."""
    sym, ((bh, bw), (eh, ew)) = _split(a)
    kh, kw, sh, sw, ph, pw, dh, dw = _geometry(None, sym)
    n, c, h, w = x_shape
    h, w = h + bh + eh, w + bw + ew
    extra = n * c * h * w if (bh or bw or eh or ew) else 0  # the asymmetric pad's copy
    g = a["groups"]
    og = o // g
    hp, wp = h + 2 * ph, w + 2 * pw
    ho = (hp - dh * (kh - 1) - 1) // sh + 1
    wo = (wp - dw * (kw - 1) - 1) // sw + 1
    pointwise = (kh, kw, sh, sw, ph, pw, g) == (1, 1, 1, 1, 0, 0, 1)
    gpu = on_gpu(a)

    if kind == "forward":
        return extra + _forward_scratch(n, c, o, (kh, kw, sh, sw, ph, pw, dh, dw), g, h, w,
                                        gpu)
    if kind == "grad_input":
        if pointwise:
            return extra
        qh, qw = (kh - 1) * dh - ph, (kw - 1) * dw - pw
        if (sh, sw) == (1, 1) and qh >= 0 and qw >= 0:  # dy convolved with the flipped w
            return extra + c * og * kh * kw + _forward_scratch(
                n, o, c, (kh, kw, 1, 1, qh, qw, dh, dw), g, ho, wo, gpu)
        return extra + n * c * kh * kw * ho * wo + n * c * hp * wp
    if pointwise:  # grad_weight: the per-sample products before their sum, or the
        return min(n * o * c, n * ho * wo * (o + c))  # transposed copies, the smaller
    if gpu:
        return extra + _folded_gw_scratch(n, c, o, (kh, kw, sh, sw, ph, pw, dh, dw), hp, wp,
                                          ho, wo)
    flat = _flat_shift_gw_scratch(n, c, o, (kh, kw, dh, dw), g, hp, wp, ho)
    if winograd.applies((kh, kw, sh, sw, ph, pw, dh, dw), g, n, c, o, ho, wo):
        return extra + max(flat, winograd.chunk(n, c, o, ho, wo)[1])
    return extra + _gw_scratch(n, c, o, (kh, kw, sh, sw, ph, pw, dh, dw), g, hp, wp, ho, wo)


def _gw_scratch(n, c, o, geom, g, hp, wp, ho, wo) -> int:
    """Scratch elements of _conv2d_gw's flat shift (stride 1, 256+ output pixels) or
    folded columns; the fused kernels' image tasks, which may run instead, fit in it."""
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    if (sh, sw) == (1, 1) and ho * wo >= 256:
        return _flat_shift_gw_scratch(n, c, o, (kh, kw, dh, dw), g, hp, wp, ho)
    return _folded_gw_scratch(n, c, o, geom, hp, wp, ho, wo)


def _folded_gw_scratch(n, c, o, geom, hp, wp, ho, wo) -> int:
    """Scratch elements of _conv2d_gw's folded columns (one GEMM a group over N*Ho*Wo):
    the padded x, the columns and dy's transposed copy."""
    kh, kw, _sh, _sw, ph, pw, _dh, _dw = geom
    return (n * c * hp * wp if ph or pw else 0) + n * c * kh * kw * ho * wo + n * o * ho * wo


def _flat_shift_scratch(n, cin, cout, kernel, g, hp, wp, ho) -> int:
    kh, kw, _dh, dw = kernel
    return n * cin * (hp * wp + (kw - 1) * dw) + kh * kw * cout * (cin // g) \
        + 2 * n * cout * ho * wp


def _flat_shift_gw_scratch(n, c, o, kernel, g, hp, wp, ho) -> int:
    """Scratch of _conv2d_gw's stride-1 flat shift: the padded x, the padded dy and the
    per-sample products of one offset."""
    _kh, kw, _dh, dw = kernel
    return n * c * (hp * wp + (kw - 1) * dw) + n * o * ho * wp + n * o * (c // g)


# Below this many output pixels per image, a GEMM per image is too small to run well; the
# batch is folded into one GEMM where that GEMM is big enough to pay for the column copy
# (>= 128 channels each way) or the per-offset GEMMs are worse still (C*kh*kw <= 64), as
# in digits-cnn's first convolution and ResNet-50's 7x7 stage (bench/bench_kernels.py
# --conv); 64 channels at 8x8 (ResNet-164's last stage) measured slower folded, so it
# keeps the flat shift.
_FOLD_MAX_PIXELS = 196


def _forward_path(n, cin, cout, geom, g, h, w, fast: bool, gpu: bool = False) -> str:
    """Which of _conv_forward's paths runs on an [n, cin, h, w] input (`fast`: with the
    backend's fused kernels; `gpu`: a node the `device` pass marked for a GPU):
    pointwise | winograd | folded | flat | im2col."""
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    ho = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if (kh, kw, sh, sw, ph, pw, g) == (1, 1, 1, 1, 0, 0, 1):
        return "pointwise"
    if gpu:
        # the columns and one batched GEMM: a GPU is held back by launches, not bytes, and
        # the flat shift is kh*kw GEMMs and adds (docs/benchmarks.md, "The GPU")
        return "im2col"
    if fast and _is_depthwise(cin, g):
        return "depthwise"
    if fast and winograd.applies(geom, g, n, cin, cout, ho, wo) \
            and not _image_tasks_beat_winograd(n, cin, cout, g, ho, wo):
        return "winograd"
    if g == 1 and ho * wo <= _FOLD_MAX_PIXELS and (cin * kh * kw <= 64 or min(cin, cout) >= 128):
        return "folded"
    return "flat" if (sh, sw) == (1, 1) else "im2col"


def _image_tasks_beat_winograd(n, cin, cout, g, ho, wo) -> bool:
    """Where the flat shift, an image a task (numpy_fused_gemm.shifted_conv_tasks), is
    faster than Winograd for a forward or input gradient: up to 64 channels each way from
    14x14 to 56x56, two images or more; at 8x8, and at 128 channels and more, Winograd
    stays ahead (measured: docs/benchmarks.md). At 224x224 (VGG-16's first convolutions)
    each task's buffers are far out of any cache, and VGG-16's step came out slower, so
    Winograd keeps those.
    It does not depend on the threads, so neither do a step's numbers: with fewer images
    than threads the flat shift runs as `shifted`, the same sums."""
    return g == 1 and n >= 2 and max(cin, cout) <= 64 and 196 <= ho * wo <= 56 * 56


def _forward_scratch(n, cin, cout, geom, g, h, w, gpu: bool = False) -> int:
    """Scratch elements of _conv_forward on an [n, cin, h, w] input: the larger of its
    paths with and without the fused kernels (the plan does not know which will run), or
    the GPU's path for a node marked for one."""
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    hp, wp = h + 2 * ph, w + 2 * pw
    ho = (hp - dh * (kh - 1) - 1) // sh + 1
    wo = (wp - dw * (kw - 1) - 1) // sw + 1
    padded = n * cin * hp * wp if ph or pw else 0
    flat = _flat_shift_scratch(n, cin, cout, (kh, kw, dh, dw), g, hp, wp, ho)
    sizes = {
        "pointwise": 0,
        # a stack of scratch planes a task, as many tasks as the other path's scratch holds (the
        # kernel is handed this rule's value as its budget)
        "depthwise": 0,
        "winograd": max(flat, winograd.chunk(n, cin, cout, ho, wo)[1]),
        # the padded copy, the columns, the GEMM's [O, N*Ho*Wo] result
        "folded": padded + n * cin * kh * kw * ho * wo + n * cout * ho * wo,
        "flat": flat,
        "im2col": padded + n * cin * kh * kw * ho * wo,
    }
    if gpu:
        return sizes[_forward_path(n, cin, cout, geom, g, h, w, False, True)]
    return max(sizes[_forward_path(n, cin, cout, geom, g, h, w, fast)]
               for fast in (False, True))


def _workspace(kind: str):
    """The workspace rule (bytes, float32) of the conv2d kernel of `kind`."""
    def rule(ins, out, a):
        if kind == "forward":
            x, o = ins[0].shape, out.shape[1]
        elif kind == "grad_input":
            x, o = out.shape, ins[0].shape[1]
        else:
            x, o = ins[1].shape, ins[0].shape[1]
        return 4 * _scratch_elems(kind, x, o, a)
    return rule


def kernel_groups(n, ins) -> tuple[str, ...]:
    """The fused kernel groups (netdsl.backends.numpy_fused.KERNEL_GROUPS) convolution
    node `n` (its inputs' types `ins`) may call, loaded when an executor is made: the
    depthwise loops only where it is grouped, Winograd's only where conv_winograd.applies
    (a stride-1 dx is dy convolved into x's shape with the flipped kernel)."""
    a = n.attrs
    groups = ("gemm", "im2col")
    if a.get("groups", 1) > 1:
        return groups + ("depthwise",)
    if n.op == "conv2d_grad_input":
        src, dst = ins[0].shape, tuple(a["shape"])
    elif n.op == "conv2d_grad_weight":
        src, dst = ins[1].shape, ins[0].shape
    else:  # conv2d, conv2d_add: x into y
        src, dst = ins[0].shape, n.type.shape
    # (not the padding, which applies does not ask: a spatial split's parts have four)
    geom = (*pair(a["kernel"]), *pair(a["stride"]), 0, 0, *pair(a["dilation"]))
    if winograd.applies(geom, 1, src[0], src[1], dst[1], dst[2], dst[3]):
        return groups + ("winograd",)
    return groups


CONV2D_ARGS = (
    Arg("x", "tensor"), Arg("out_channels", "int", range=POSITIVE),
    Arg("kernel", "pair", 1, range=POSITIVE), Arg("stride", "pair", 1, range=POSITIVE),
    Arg("padding", "padding", 0, range=NON_NEGATIVE), Arg("dilation", "pair", 1, range=POSITIVE),
    Arg("groups", "int", 1, range=POSITIVE), Arg("bias", "bool", True))
forward_workspace = _workspace("forward")
register(OpDef(
    "conv2d", CONV2D_ARGS,
    conv2d_shape, "conv", conv2d_params, conv2d_flops, forward_workspace,
    retains=("inputs", "weight"),
    doc="2-d convolution over NCHW input; weight [out, in/groups, kh, kw]; padding an int, "
        "(ph, pw), (top, left, bottom, right), \"same\" or \"valid\"",
    extra={"spatial": 2, "fused_kernels": kernel_groups, "gpu_variant": True}, precision="reduced"))


# -- backward operators -----------------------------------------------------------------------
_GEOM = (Arg("kernel", "pair", 1, range=POSITIVE), Arg("stride", "pair", 1, range=POSITIVE),
         Arg("padding", "padding", 0, range=NON_NEGATIVE),
         Arg("dilation", "pair", 1, range=POSITIVE), Arg("groups", "int", 1, range=POSITIVE))


def _to_shape(ins, a):
    return TensorType(tuple(a["shape"]), ins[0].dtype)


register(OpDef("conv2d_grad_input", (Arg("dy", "tensor"), Arg("weight", "tensor"),
                                     Arg("shape", "shape")) + _GEOM,
               _to_shape, "backward", differentiable=False,
               flops=lambda ins, out, a: conv2d_flops([out], ins[0], a),
               workspace=_workspace("grad_input"),
               doc="dx of conv2d: GEMM of dy with the weight, then col2im; `shape` is x's",
               extra={"spatial": 2, "fused_kernels": kernel_groups, "gpu_variant": True},
               precision="reduced"))
register(OpDef("conv2d_grad_weight", (Arg("dy", "tensor"), Arg("x", "tensor"),
                                      Arg("shape", "shape")) + _GEOM,
               _to_shape, "backward", differentiable=False,
               flops=lambda ins, out, a: conv2d_flops([ins[1]], ins[0], a),
               workspace=_workspace("grad_weight"),
               doc="dW of conv2d: GEMM of dy with im2col(x); `shape` is the weight's",
               extra={"spatial": 2, "fused_kernels": kernel_groups, "gpu_variant": True},
               precision="reduced"))


# -- kernels ----------------------------------------------------------------------------------
# Layouts are chosen so that every GEMM lands directly in its result's layout (no transposed
# copy of an output): im2col columns are [N, G, C/G*kh*kw, Ho*Wo], so W @ cols is already
# [N, G, O/G, Ho*Wo] = NCHW. Stride-1 convolutions need no im2col ("flat shift": in a
# zero-padded image flattened to Hp*Wp, kernel offset (i, j) is a contiguous slice starting
# at i*dh*Wp + j*dw, so each offset is one batched GEMM against a strided view, with Wp - Wo
# junk columns per output row that are cropped, or that meet zeros in a padded dy), and
# their input gradient is the forward convolution of dy with the flipped, transposed kernel.
def windows(xp, xpad, kh, kw, sh, sw, dh, dw, ho, wo):
    """A zero-copy [N, C, Ho, Wo, kh, kw] view of the sliding windows of padded NCHW input."""
    s0, s1, s2, s3 = xpad.strides
    return xp.lib.stride_tricks.as_strided(
        xpad, (xpad.shape[0], xpad.shape[1], ho, wo, kh, kw),
        (s0, s1, s2 * sh, s3 * sw, s2 * dh, s3 * dw))


def pad2d(xp, x, ph, pw, value=0.0):
    if ph == 0 and pw == 0:
        return xp.ascontiguousarray(x)
    n, c, h, w = x.shape
    out = xp.full((n, c, h + 2 * ph, w + 2 * pw), value, dtype=x.dtype)
    out[:, :, ph:ph + h, pw:pw + w] = x
    return out


def col2im_add(xp, dxpad, dcols, sh, sw, dh, dw, fast=None):
    """Scatter-add `dcols` [N, C, kh, kw, Ho, Wo] onto the padded input gradient `dxpad`
    [N, C, Hp, Wp] in place (the adjoint of `windows`): one strided add per kernel offset,
    or with `fast` (the fused kernels) one Numba pass per plane, the same sums."""
    n, c, kh, kw, ho, wo = dcols.shape
    if fast is not None and fast.accepts(dxpad, dcols):
        fast.col2im_add(dxpad.reshape(n * c, *dxpad.shape[2:]),
                        dcols.reshape(n * c, kh, kw, ho, wo), sh, sw, dh, dw)
        return
    for i in range(kh):
        for j in range(kw):
            r, q = i * dh, j * dw
            dxpad[:, :, r:r + sh * (ho - 1) + 1:sh, q:q + sw * (wo - 1) + 1:sw] += \
                dcols[:, :, i, j]


def on_gpu(a) -> bool:
    """Whether the `device` pass marked this node for a GPU (netdsl.passes.device): its
    kernel takes the columns' paths, and its workspace rule counts those."""
    return a.get("target") == "gpu"


def _is_depthwise(c, g) -> bool:
    """Every group one input channel (MobileNet's depthwise convolutions): the fused
    kernels' direct loops (numpy_fused_depthwise) take it, not grouped GEMMs."""
    return g > 1 and c == g


def _is_pointwise(a):
    """A 1x1, stride-1, unpadded, ungrouped convolution: a plain matmul over (N, C, H*W)."""
    return (pair(a["kernel"]) == (1, 1) and pair(a["stride"]) == (1, 1)
            and pair(a["padding"]) == (0, 0) and a["groups"] == 1)


def _im2col(xp, x, geom, g, ho, wo):
    """[N, G, C/G*kh*kw, Ho*Wo] columns (one copy of the strided windows view)."""
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    n, c = x.shape[0], x.shape[1]
    win = windows(xp, pad2d(xp, x, ph, pw), kh, kw, sh, sw, dh, dw, ho, wo)
    win = win.reshape(n, g, c // g, ho, wo, kh, kw).transpose(0, 1, 2, 5, 6, 3, 4)
    return xp.ascontiguousarray(win).reshape(n, g, (c // g) * kh * kw, ho * wo)


def _folded_columns(xp, x, geom, ho, wo, fast):
    """[C*kh*kw, N*Ho*Wo] columns of x, the batch folded into one GEMM: a copy of the
    strided windows of the padded x, or with `fast` (the fused kernels) one Numba pass
    per row that reads x unpadded, the same values."""
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    n, c = x.shape[:2]
    if fast is not None:
        cols = xp.empty((c * kh * kw, n * ho * wo), x.dtype)
        fast.im2col_rows(x, kh, kw, sh, sw, ph, pw, dh, dw, cols)
        return cols
    win = windows(xp, pad2d(xp, x, ph, pw), kh, kw, sh, sw, dh, dw, ho, wo)
    return xp.ascontiguousarray(win.transpose(1, 4, 5, 0, 2, 3)).reshape(c * kh * kw, -1)


def _flat_padded(xp, x, ph, pw, extra):
    """x zero-padded to [N, C, Hp*Wp + extra] (each padded image flattened, `extra` zeros
    after it so that the last kernel offset's slice stays in bounds)."""
    n, c, h, w = x.shape
    hp, wp = h + 2 * ph, w + 2 * pw
    buf = xp.zeros((n, c, hp * wp + extra), dtype=x.dtype)
    buf[:, :, :hp * wp].reshape(n, c, hp, wp)[:, :, ph:ph + h, pw:pw + w] = x
    return buf


def _conv_forward(xp, x, w, geom, g, out=None, fast=None, gpu=False, residual=None):
    """y = conv2d(x, w), plus `residual` (of y's shape) if given; `fast`: the backend's
    fused kernels, for Winograd where it applies (conv_winograd.applies); `out`: the
    node's planned slot, where a path can write it; `gpu`: the node is marked for a GPU
    (the columns' path). A 1x1 convolution's GEMM tasks add the residual to their blocks
    while those are in cache (conv2d_add: a pre-activation ResNet block's last
    convolution and its shortcut); the other paths add it after."""
    if residual is not None and geom[:6] == (1, 1, 1, 1, 0, 0) and g == 1:
        return _pointwise(xp, x, w, out, fast, residual)
    y = _conv_by_path(xp, x, w, geom, g, out, fast, gpu)
    if residual is not None:
        y += residual
    return y


def _pointwise(xp, x, w, out, fast, residual=None):
    """A 1x1, stride-1, unpadded, ungrouped convolution: one GEMM per image (folding the
    batch into one GEMM needs two transposing copies in NCHW, which cost more than they
    save), straight into `out`."""
    n, c, h, wd = x.shape
    o = w.shape[0]
    r = None if residual is None else residual.reshape(n, o, -1)
    return matmul(xp, w.reshape(o, -1), x.reshape(n, c, -1), _flat_out(out, n, o), fast,
                  residual=r).reshape(n, o, h, wd)


def _conv_by_path(xp, x, w, geom, g, out=None, fast=None, gpu=False):
    """y = conv2d(x, w) by the path _forward_path picks (_conv_forward's arguments)."""
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    n, o = x.shape[0], w.shape[0]
    ho = (x.shape[2] + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (x.shape[3] + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    path = _forward_path(n, x.shape[1], o, geom, g, x.shape[2], x.shape[3], fast is not None,
                         gpu)
    if path == "depthwise":
        y = fast.depthwise.conv(x, w, geom, fast.threads, _forward_scratch(
            n, x.shape[1], o, geom, g, x.shape[2], x.shape[3]), out)
        if y is not None:
            return y
        path = _forward_path(n, x.shape[1], o, geom, g, x.shape[2], x.shape[3], False)
    if path == "winograd":
        return winograd.conv(fast, x, w, ph, pw, out)
    if path == "pointwise":
        return _pointwise(xp, x, w, out, fast)
    if path == "folded":
        # small images: the batch folded into one GEMM over [C*kh*kw, N*Ho*Wo] columns (a
        # GEMM per image would be too small), its [O, N, Ho, Wo] result transposed to NCHW
        cols = _folded_columns(xp, x, geom, ho, wo, fast)
        y = matmul(xp, w.reshape(o, -1), cols, fast=fast).reshape(o, n, ho, wo)
        del cols
        if out is None:
            return xp.ascontiguousarray(y.transpose(1, 0, 2, 3))
        out[...] = y.transpose(1, 0, 2, 3)
        return out
    if path == "flat":
        # flat shift: one batched GEMM per kernel offset against a strided slice of the
        # flattened padded x, accumulated in place; no im2col buffer (kh*kw times the input)
        c = x.shape[1]
        og, cg = o // g, c // g
        wp = x.shape[3] + 2 * pw
        length = ho * wp
        wt = xp.ascontiguousarray(w.reshape(g, og, cg, kh * kw).transpose(3, 0, 1, 2))
        if g == 1 and fast is not None:
            # an image a task: padding, products and cropping in the thread's cache
            y = fast.shifted_conv(x, wt[:, 0], kh, kw, ph, pw, dh, dw, out)
            if y is not None:
                return y
        buf = _flat_padded(xp, x, ph, pw, (kw - 1) * dw).reshape(n, g, cg, -1)
        y = None
        if g == 1:  # 3-d operands, which the fused kernels' GEMMs take
            buf, wt = buf[:, 0], wt[:, 0]
            if fast is not None:  # every offset in one parallel call, where it takes them
                y = fast.shifted_matmul(
                    wt, buf, [i * dh * wp + j * dw for i in range(kh) for j in range(kw)],
                    length)
            if y is not None:
                return xp.ascontiguousarray(y.reshape(n, o, ho, wp)[..., :wo])
        for i in range(kh):
            for j in range(kw):
                off = i * dh * wp + j * dw
                part = buf[..., off:off + length]
                # the later offsets add into y (inside the GEMM where the fused kernels
                # run it, else through a temporary)
                y = matmul(xp, wt[i * kw + j], part, y, fast, accumulate=y is not None)
        return xp.ascontiguousarray(y.reshape(n, o, ho, wp)[..., :wo])
    if g == 1 and fast is not None:
        # columns one image at a time (the fused kernels' parallel copy), each image's GEMM
        # straight into its rows of y: one image's columns in memory, not the batch's (the
        # path of large images such as ResNet-50's 7x7/2 stem)
        y = xp.empty((n, o, ho * wo), x.dtype) if out is None else _flat_out(out, n, o)
        cols = xp.empty((x.shape[1] * kh * kw, ho * wo), x.dtype)
        w2 = w.reshape(o, -1)
        for i in range(n):
            fast.im2col_rows(x[i:i + 1], kh, kw, sh, sw, ph, pw, dh, dw, cols)
            matmul(xp, w2, cols, y[i], fast)
        return y.reshape(n, o, ho, wo)
    cols = _im2col(xp, x, geom, g, ho, wo)
    if g == 1:
        return matmul(xp, w.reshape(o, -1), cols[:, 0], fast=fast).reshape(n, o, ho, wo)
    return xp.matmul(w.reshape(g, o // g, -1), cols).reshape(n, o, ho, wo)


def _flat_out(out, n, c):
    """The node's planned slot (arena runs; None otherwise) as the [N, C, H*W] array a
    batched GEMM writes into."""
    return None if out is None else out.reshape(n, c, -1)


def conv2d_forward(xp, x, w, a, out=None, fast=None, dnn=None, residual=None):
    """y = conv2d(x, w) for the attributes `a` (any padding form; no bias), plus
    `residual` if given; a 1x1 convolution writes into `out` (the node's planned slot)
    when given; `fast`: the backend's fused kernels (Winograd), or None; `dnn`: cuDNN's
    convolutions (a node marked for a GPU, where the backend has them), or None."""
    sym, extra = _split(a)
    xe = _pad_extra(xp, x, extra)
    geom = _geometry(None, sym)
    if dnn is not None:
        y = dnn.forward(xe, w, geom, sym["groups"], out, _dnn_limit(
            "forward", xe.shape, w.shape[0], geom, sym["groups"], x.itemsize))
        if y is not None:
            if residual is not None:
                y += residual
            return y
    return _conv_forward(xp, xe, w, geom, sym["groups"], out, fast, on_gpu(sym), residual)


def conv2d_grad_input(xp, dy, w, shape, a, out=None, fast=None, dnn=None):
    """dx of conv2d, for x of `shape`; a 1x1 convolution's writes into `out` if given."""
    sym, ((bh, bw), (eh, ew)) = _split(a)
    n, c, h, wd = shape
    grown = bool(bh or bw or eh or ew)  # dx is cropped from a larger one: not into `out`
    big = (n, c, h + bh + eh, wd + bw + ew)
    dx = None
    if dnn is not None:
        geom = _geometry(None, sym)
        dx = dnn.grad_input(dy, w, big, geom, sym["groups"], None if grown else out,
                            _dnn_limit("grad_input", big, dy.shape[1], geom, sym["groups"],
                                       dy.itemsize))
    if dx is None:
        dx = _conv2d_gi(xp, [dy, w], {**sym, "shape": big}, None if grown else out, fast)
    if grown:
        dx = xp.ascontiguousarray(dx[:, :, bh:bh + h, bw:bw + wd])
    return dx


def conv2d_grad_weight(xp, dy, x, shape, a, fast=None, dnn=None):
    sym, extra = _split(a)
    xe = _pad_extra(xp, x, extra)
    if dnn is not None:
        geom = _geometry(None, sym)
        gw = dnn.grad_weight(dy, xe, tuple(shape), geom, sym["groups"],
                             _dnn_limit("grad_weight", xe.shape, dy.shape[1], geom,
                                        sym["groups"], x.itemsize))
        if gw is not None:
            return gw
    return _conv2d_gw(xp, [dy, xe], {**sym, "shape": shape}, fast)


@functools.lru_cache(maxsize=1024)
def _dnn_limit(kind: str, x_shape: tuple, o: int, geom: tuple, groups: int,
               itemsize: int) -> int:
    """The workspace bytes cuDNN may take for a node: what the node's workspace rule grants
    (the GPU path's) past the padded input's copy the kernel already holds (x_shape is
    that padded shape; dx's before its crop), so the step stays within its plan. It
    depends on the symmetric geometry alone: computed once per shape, not per call (a
    few microseconds each, which a host-bound GPU step pays per convolution)."""
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    a = {"kernel": (kh, kw), "stride": (sh, sw), "padding": (ph, pw),
         "dilation": (dh, dw), "groups": groups, "target": "gpu"}
    return _scratch_elems(kind, x_shape, o, a) * itemsize


def conv_fast(ctx, a, *arrays):
    """The fused kernels for a convolution node, but none for one marked for a GPU: it
    takes cuDNN's or the columns' paths, which its workspace rule counts."""
    return None if on_gpu(a) else fused_kernels(ctx, *arrays)


def conv_dnn(ctx, a):
    """cuDNN's convolutions for a node marked for a GPU, where the backend has them."""
    return getattr(ctx.backend, "cudnn", None) if on_gpu(a) else None


@kernel("conv2d")
def _conv2d(xp, ins, a, ctx):
    x, w = ins[0], ins[1]
    y = conv2d_forward(xp, x, w, a, ctx.out, conv_fast(ctx, a, x, w), conv_dnn(ctx, a))
    if len(ins) > 2:
        y += ins[2].reshape(1, w.shape[0], 1, 1)
    return y


@kernel("conv2d_grad_weight")
def _conv2d_gw_kernel(xp, ins, a, ctx):
    return conv2d_grad_weight(xp, ins[0], ins[1], tuple(a["shape"]), a,
                              conv_fast(ctx, a, ins[0], ins[1]), conv_dnn(ctx, a))


@kernel("conv2d_grad_input")
def _conv2d_gi_kernel(xp, ins, a, ctx):
    return conv2d_grad_input(xp, ins[0], ins[1], tuple(int(d) for d in a["shape"]), a,
                             ctx.out, conv_fast(ctx, a, ins[0], ins[1]), conv_dnn(ctx, a))


def _conv2d_gw(xp, ins, a, fast):
    """dW of a 2-D convolution: the first path that applies, from the fused kernels' own
    loops to the folded GEMM that takes any geometry."""
    dy, x = ins
    n, o, ho, wo = dy.shape
    c = x.shape[1]
    g = a["groups"]
    geom = _geometry(None, a)
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    if fast is not None and _is_depthwise(c, g):
        gw = fast.depthwise.grad_weight(dy, x, tuple(a["shape"]), geom, fast.threads,
                                        _scratch_elems("grad_weight", x.shape, o, a))
        if gw is not None:
            return gw
    if _is_pointwise(a):
        return _gw_pointwise(xp, dy, x, a, fast)
    if fast is not None and winograd.applies(geom, g, n, c, o, ho, wo):
        return winograd.grad_weight(fast, dy, x, ph, pw)
    if (sh, sw) == (1, 1) and g == 1 and fast is not None:
        # an image a task: its shifted rows and padded dy in the thread's cache, one GEMM;
        # as many tasks at once as the scratch the plan reserves for the paths below holds
        hp, wp = x.shape[2] + 2 * ph, x.shape[3] + 2 * pw
        gw = fast.shifted_conv_grad_weight(dy, x, kh, kw, ph, pw, dh, dw, _gw_scratch(
            n, c, o, geom, 1, hp, wp, ho, wo))
        if gw is not None:
            return gw
    if (sh, sw) == (1, 1) and ho * wo >= 256 and not on_gpu(a):
        return _gw_flat_shift(xp, dy, x, a, fast)
    if g == 1 and fast is not None and ho * wo >= 256:
        return _gw_image_columns(xp, dy, x, a, fast)
    return _gw_folded_columns(xp, dy, x, a, fast)


def _gw_pointwise(xp, dy, x, a, fast):
    """dW of a 1x1 convolution: products of dy and x as they lie, no columns."""
    n, o, ho, wo = dy.shape
    c = x.shape[1]
    p = ho * wo
    if o * c > p * (o + c):
        # small images: the batch folded into one GEMM (K = N*H*W) costs two
        # transposing copies of dy and x, less than N products of [O, C] to sum
        d = xp.ascontiguousarray(dy.reshape(n, o, p).transpose(1, 0, 2)).reshape(o, -1)
        xt = xp.ascontiguousarray(x.reshape(n, c, p).transpose(1, 0, 2)).reshape(c, -1)
        return matmul(xp, d, xt.T, fast=fast).reshape(tuple(a["shape"]))
    # sum over n of dy[n] @ x[n]^T (a transposed view: no copy). With fewer output than
    # input channels, the transposed products x[n] @ dy[n]^T and one transposing copy of
    # their [C, O] sum: OpenBLAS multiplies [C, K] @ [K, O] faster than [O, K] @ [K, C]
    # for O < C, with the same bits (ResNet-164's 16 <- 64 at 32x32; bench_kernels.py
    # --conv-only 1x1). Not for the folded GEMM above, where ResNet-50's 512 <- 2048 came
    # out slower so.
    dy3, x3 = dy.reshape(n, o, -1), x.reshape(n, c, -1)
    if o < c:
        gw = matmul(xp, x3, dy3.transpose(0, 2, 1), fast=fast).sum(axis=0)
        return xp.ascontiguousarray(gw.T).reshape(tuple(a["shape"]))
    return matmul(xp, dy3, x3.transpose(0, 2, 1), fast=fast).sum(axis=0).reshape(
        tuple(a["shape"]))


def _gw_flat_shift(xp, dy, x, a, fast):
    """dW at stride 1: per kernel offset, one batched GEMM of the padded dy with a
    strided slice of the flattened padded x; no im2col buffer."""
    n, o, ho, wo = dy.shape
    g = a["groups"]
    og, cg = o // g, x.shape[1] // g
    kh, kw, _, _, ph, pw, dh, dw = _geometry(None, a)
    wp = x.shape[3] + 2 * pw
    length = ho * wp
    buf = _flat_padded(xp, x, ph, pw, (kw - 1) * dw).reshape(n, g, cg, -1)
    dyp = xp.zeros((n, g, og, ho, wp), dtype=dy.dtype)
    dyp[..., :wo] = dy.reshape(n, g, og, ho, wo)
    dyp = dyp.reshape(n, g, og, length)
    if g == 1:  # 3-d operands, which the fused kernels' GEMMs take
        buf, dyp = buf[:, 0], dyp[:, 0]
    gw = xp.empty((g, og, cg, kh, kw), dtype=dy.dtype)
    for i in range(kh):
        for j in range(kw):
            off = i * dh * wp + j * dw
            prods = matmul(xp, dyp, buf[..., off:off + length].swapaxes(-1, -2),
                           fast=fast)
            gw[:, :, :, i, j] = prods.sum(axis=0).reshape(g, og, cg)
    return gw.reshape(tuple(a["shape"]))


def _gw_image_columns(xp, dy, x, a, fast):
    """dW of an ungrouped convolution on large images: one image's columns at a time (no
    transposed copy of dy), the images' products added in their order (not inside the
    GEMM, whose K blocks would round otherwise with its threads than NumPy's matmul does
    on one): one image's columns in memory, not the batch's (ResNet-50's 7x7/2 stem)."""
    n, o, ho, wo = dy.shape
    c = x.shape[1]
    kh, kw, sh, sw, ph, pw, dh, dw = _geometry(None, a)
    gw = xp.zeros((o, c * kh * kw), dy.dtype)
    prod = xp.empty_like(gw)
    cols = xp.empty((c * kh * kw, ho * wo), x.dtype)
    for i in range(n):
        fast.im2col_rows(x[i:i + 1], kh, kw, sh, sw, ph, pw, dh, dw, cols)
        gw += matmul(xp, dy[i].reshape(o, -1), cols.T, prod, fast)
    return gw.reshape(tuple(a["shape"]))


def _gw_folded_columns(xp, dy, x, a, fast):
    """dW as one GEMM per group over all N*Ho*Wo: columns as [G, C/G*kh*kw, N*Ho*Wo]."""
    n, o, ho, wo = dy.shape
    g = a["groups"]
    og, cg = o // g, x.shape[1] // g
    geom = _geometry(None, a)
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    if g == 1:
        cols = _folded_columns(xp, x, geom, ho, wo, fast)[None]
    else:
        win = windows(xp, pad2d(xp, x, ph, pw), kh, kw, sh, sw, dh, dw, ho, wo)
        win = win.reshape(n, g, cg, ho, wo, kh, kw).transpose(1, 2, 5, 6, 0, 3, 4)
        cols = xp.ascontiguousarray(win).reshape(g, cg * kh * kw, n * ho * wo)
    dym = xp.ascontiguousarray(dy.reshape(n, g, og, ho * wo).transpose(1, 2, 0, 3))
    return matmul(xp, dym.reshape(g, og, -1), cols.transpose(0, 2, 1),
                  fast=fast).reshape(tuple(a["shape"]))


def _conv2d_gi(xp, ins, a, out, fast):
    dy, w = ins
    n, o, ho, wo = dy.shape
    g = a["groups"]
    _, c, h, wd = a["shape"]
    og, cg = o // g, c // g
    kh, kw, sh, sw, ph, pw, dh, dw = _geometry(None, a)
    if fast is not None and _is_depthwise(c, g):
        dx = fast.depthwise.grad_input(dy, w, (n, c, h, wd), _geometry(None, a), fast.threads,
                                       _scratch_elems("grad_input", (n, c, h, wd), o, a), out)
        if dx is not None:
            return dx
    if _is_pointwise(a):
        return matmul(xp, w.reshape(o, -1).T, dy.reshape(n, o, -1), _flat_out(out, n, c),
                      fast).reshape(n, c, h, wd)
    qh, qw = (kh - 1) * dh - ph, (kw - 1) * dw - pw
    if (sh, sw) == (1, 1) and qh >= 0 and qw >= 0:
        # stride 1: dx is dy convolved with the flipped kernel, in/out channels swapped
        wt = w.reshape(g, og, cg, kh, kw).transpose(0, 2, 1, 3, 4)[..., ::-1, ::-1]
        wt = xp.ascontiguousarray(wt).reshape(c, og, kh, kw)
        return _conv_forward(xp, dy, wt, (kh, kw, 1, 1, qh, qw, dh, dw), g, fast=fast,
                             gpu=on_gpu(a))
    # columns [N, G, C/G, kh, kw, Ho, Wo] (W^T @ dy per group, straight from NCHW dy), then
    # one strided add per kernel offset into the padded dx
    wt = w.reshape(g, og, -1).transpose(0, 2, 1)  # [G, C/G*kh*kw, O/G]
    if g == 1:
        dcols = matmul(xp, wt[0], dy.reshape(n, og, ho * wo), fast=fast)
    else:
        dcols = xp.matmul(wt, dy.reshape(n, g, og, ho * wo))
    dcols = dcols.reshape(n, c, kh, kw, ho, wo)
    dxpad = xp.zeros((n, c, h + 2 * ph, wd + 2 * pw), dtype=dy.dtype)
    col2im_add(xp, dxpad, dcols, sh, sw, dh, dw, fast)
    return xp.ascontiguousarray(dxpad[:, :, ph:ph + h, pw:pw + wd])


# -- gradient rule ----------------------------------------------------------------------------
@grad_rule("conv2d")
def conv2d_rule(n, b, gy):
    x, w = n.inputs[0], n.inputs[1]
    geom = {k: n.attrs[k] for k in ("kernel", "stride", "padding", "dilation", "groups")}
    out = [b.emit("conv2d_grad_input", [gy, w], {"shape": b.type(x).shape, **geom}, tag="x"),
           b.emit("conv2d_grad_weight", [gy, x], {"shape": b.type(w).shape, **geom},
                  tag="weight")]
    if len(n.inputs) > 2:
        out.append(b.emit("sum_except", [gy], {"axis": 1}, tag="bias"))
    return out

# on a GPU, cuBLAS and cuDNN read and write f16 themselves (mixed precision)
for _name in ("conv2d", "conv2d_grad_input", "conv2d_grad_weight"):
    OPS[_name].reads_reduced = GPU_LIBRARIES
