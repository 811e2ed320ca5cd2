"""Normalisation: batchnorm (over N and spatial dims) and layernorm (over the dims from
`axis` on: the last by default, ONNX LayerNormalization's `axis`).

Backward recomputes the batch statistics from x instead of keeping them: both ops retain
only their input and their scale (`weight`); the running statistics are never read.
Batchnorm's backward is the training-mode one (gradients through the batch statistics):
one `batchnorm_grad_stats` pass computes the batch mean and 1/std with the two
per-channel sums of the backward (the weight and bias gradients), and
`batchnorm_grad_from_stats` makes dx from them without recomputing anything.
"""
import math

from netdsl.errors import ShapeError
from netdsl.ir.opdef import (
    FUSED_LOOPS,
    GT0,
    Arg,
    OpDef,
    ParamSpec,
    Range,
    grad_rule,
    kernel,
    register,
)
from netdsl.ir.ops._util import (
    computable,
    fused_kernels,
    need_float,
    need_rank,
    norm_axis,
    scratch_rule,
)
from netdsl.ir.types import TensorType, accumulate_dtype


def _bn_shape(ins, a):
    (x,) = ins
    need_rank(x, "batchnorm", (2, 3, 4, 5))
    need_float(x, "batchnorm")
    return x


def _bn_params(ins, a):
    c = ins[0].shape[1]
    p = {}
    if a["affine"]:
        # zero_init: the scale starts at 0, so a residual branch ending here starts as
        # nothing and its block as the identity (Goyal et al. 2017; torchvision's
        # zero_init_residual) - what keeps thousands of blocks finite at initialisation
        p["weight"] = ParamSpec((c,), "zeros" if a.get("zero_init") else "ones")
        p["bias"] = ParamSpec((c,), "zeros")
    p["running_mean"] = ParamSpec((c,), "zeros", buffer=True)
    p["running_var"] = ParamSpec((c,), "ones", buffer=True)
    return p


def _ln_shape(ins, a):
    (x,) = ins
    need_float(x, "layernorm")
    if x.rank < 1:
        need_rank(x, "layernorm", (2, 3))
    ax = norm_axis(a["axis"], x.rank, "layernorm")
    if ax == 0:
        raise ShapeError("layernorm cannot normalise over the batch dimension (axis 0)")
    if any(not isinstance(d, int) for d in x.shape[ax:]):
        raise ShapeError(f"layernorm needs static normalised dims, but {{x}} is {x}")
    return x


def _ln_params(ins, a):
    x = ins[0]
    shape = tuple(x.shape[norm_axis(a["axis"], x.rank, "layernorm"):])
    if not a["affine"]:
        return {}
    return {"weight": ParamSpec(shape, "ones"), "bias": ParamSpec(shape, "zeros")}


def _bn_writes(node) -> tuple[int, ...]:
    """Training-mode batchnorm updates its running statistics (the last two inputs) in
    place - unless it is a recompute replay (`replay` attribute, set by the recompute
    rewrite): that one must not update them a second time, and does not read them, so
    it takes only x and the affine parameters as inputs."""
    if node.attrs.get("replay"):
        return ()
    n = len(node.inputs)
    return (n - 2, n - 1)


def _flops(ins, out, a):
    return 8 * out.numel()  # mean, var, normalise, scale and shift


register(OpDef(
    "batchnorm",
    (Arg("x", "tensor"), Arg("eps", "float", 1e-5, range=GT0),
     Arg("momentum", "float", 0.1, range=Range(0, 1)),
     Arg("affine", "bool", True), Arg("zero_init", "bool", False)),
    _bn_shape, "norm", _bn_params, _flops, retains=("inputs", "weight"), writes=_bn_writes,
    # a recompute copy neither reads nor writes the running stats; the kernel uses the
    # backend's fused kernels where it has them (the executor loads them up front)
    extra={"replay": True, "fused_kernels": ("batchnorm",)}, reads_reduced=FUSED_LOOPS,
    doc="batch normalisation over every dim but 1; running stats in buffers; "
        "zero_init=true starts the scale at 0 (zero_init_residual)"))

register(OpDef(
    "layernorm",
    (Arg("x", "tensor"), Arg("eps", "float", 1e-5, range=GT0), Arg("affine", "bool", True),
     Arg("axis", "axis", -1)),
    _ln_shape, "norm", _ln_params, _flops, scratch_rule(2.25), retains=("inputs", "weight"),
    doc="layer normalisation over the dims from `axis` on (the last by default); weight "
        "and bias have the shape of those dims", extra={"fused_kernels": ("layernorm",)}))


# -- backward operators -----------------------------------------------------------------------
def _gi_shape(ins, a):
    return TensorType(ins[1].shape, ins[0].dtype)


def _gw_shape(ins, a):
    x = ins[1]  # the weight has the normalised dims; a sum over the rows: f32 for 2 bytes
    return TensorType(tuple(x.shape[a["axis"] % x.rank:]), accumulate_dtype(ins[0].dtype))


# layernorm's backward (batchnorm's is the statistics pass below)
register(OpDef("layernorm_grad_input",
               (Arg("dy", "tensor"), Arg("x", "tensor"), Arg("weight", "tensor", None),
                Arg("eps", "float", 1e-5, range=GT0), Arg("axis", "axis", -1)),
               _gi_shape, "backward", flops=lambda ins, out, a: 10 * out.numel(),
               workspace=scratch_rule(4), differentiable=False,
               extra={"fused_kernels": ("layernorm",)},
               doc="dx of layernorm (statistics recomputed from x); weight optional"))
register(OpDef("layernorm_grad_weight",
               (Arg("dy", "tensor"), Arg("x", "tensor"), Arg("eps", "float", 1e-5, range=GT0),
                Arg("axis", "axis", -1)),
               _gw_shape, "backward", flops=lambda ins, out, a: 6 * ins[0].numel(),
               workspace=scratch_rule(2.25, of=1), differentiable=False,
               extra={"fused_kernels": ("layernorm",)},
               doc="d(weight) of layernorm: sum of dy * x_hat"))


# Batchnorm's backward: one statistics pass, then dx and the affine gradients from its rows
STAT_ROWS = ("weight", "bias", "mean", "inv")  # rows of batchnorm_grad_stats' result


def _stats_shape(ins, a):
    dy, x = ins[:2]
    need_rank(x, "batchnorm_grad_stats", (2, 3, 4, 5))
    # sums over the batch, its mean and 1/std: kept in f32 for 2-byte dy and x
    return TensorType((len(STAT_ROWS), x.shape[1]), accumulate_dtype(dy.dtype))


def _stats_workspace(ins, out, a):
    # the deviations x - mean besides the result; with relu also dy * mask (and with a cap
    # the bool z < cap)
    return (8 + (a.get("cap") is not None) if a["relu"] else 4) * ins[1].numel()


register(OpDef("batchnorm_grad_stats",
               (Arg("dy", "tensor"), Arg("x", "tensor"), Arg("weight", "tensor", None),
                Arg("bias", "tensor", None), Arg("eps", "float", 1e-5, range=GT0),
                Arg("relu", "bool", False), Arg("cap", "float", None)),
               _stats_shape, "backward",
               flops=lambda ins, out, a: (8 if a["relu"] else 7) * ins[1].numel(),
               workspace=_stats_workspace, differentiable=False,
               extra={"fused_kernels": ("batchnorm",)}, reads_reduced=FUSED_LOOPS,
               doc="batchnorm's backward statistics in one pass, rows: the weight gradient "
                   "sum(dy * x_hat), the bias gradient sum(dy), the batch mean, 1/std; "
                   "relu=true: of batchnorm_relu, dy masked where the output was 0 (or "
                   "`cap`: relu6's; the mask recomputed from x, weight and bias)"))
def _from_stats_shape(ins, a):
    if len(ins) > 5 and (ins[5].shape != ins[1].shape or ins[5].dtype != ins[0].dtype):
        raise ShapeError(f"batchnorm_grad_from_stats: the gradient to add {{acc}} is "
                         f"{ins[5]}, but x is {ins[1]}")
    return TensorType(ins[1].shape, ins[0].dtype)


register(OpDef("batchnorm_grad_from_stats",
               (Arg("dy", "tensor"), Arg("x", "tensor"), Arg("stats", "tensor"),
                Arg("weight", "tensor", None), Arg("bias", "tensor", None),
                Arg("acc", "tensor", None), Arg("relu", "bool", False),
                Arg("cap", "float", None)),
               _from_stats_shape, "backward",
               flops=lambda ins, out, a: (9 if len(ins) > 5 else 8) * out.numel(),
               workspace=lambda ins, out, a: (
                   4 + (a.get("cap") is not None) if a["relu"] else 0) * out.numel(),
               differentiable=False, extra={"fused_kernels": ("batchnorm",)},
               reads_reduced=FUSED_LOOPS,
               doc="dx of batchnorm (relu=true: of batchnorm_relu) from "
                   "batchnorm_grad_stats' rows (nothing recomputed); weight and bias "
                   "optional; `acc`, another gradient of x, is added to dx (an `add` of a "
                   "gradient sum folded in by the fuse_grads pass)"))
register(OpDef("batchnorm_grad_affine",
               (Arg("stats", "tensor"), Arg("row", "int", range=Range(0, 1))),
               lambda ins, a: TensorType((ins[0].shape[1],), ins[0].dtype), "backward",
               differentiable=False,
               doc="batchnorm's weight (row 0) or bias (row 1) gradient out of "
                   "batchnorm_grad_stats' result"))


# -- kernels ----------------------------------------------------------------------------------
# Batchnorm works on a (N, C, P) view of x (P = the product of the spatial dims; a view, no
# copy, for a contiguous x). With the backend's fused kernels (`backend.fused`: Numba loops,
# netdsl.backends.numpy_fused) each kernel is one or two passes over memory; without them
# these NumPy kernels are the reference: the per-channel sums are einsum reductions over
# axes 0 and 2 (one SIMD pass each, no temporaries, several times faster than
# ufunc.reduce over non-adjacent axes), and every elementwise step writes into one buffer
# in place. The variance stays two-pass (mean first, then the sum of squared deviations).
# Both compute the affine step as z = (x - mean) * (inv * w) + b in the data's dtype, so
# the relu mask the backward recomputes (z > 0) is exactly the forward's.
def _bn_axes(x):
    return (0,) + tuple(range(2, x.ndim))


def _bshape(x, c):
    return (1, c) + (1,) * (x.ndim - 2)


def _normalise(xp, x, axes, eps):
    mean = x.mean(axis=axes, keepdims=True)
    var = x.var(axis=axes, keepdims=True)  # biased, as used for normalisation
    inv = 1.0 / xp.sqrt(var + eps)
    return (x - mean) * inv, inv, mean, var


def _bn_stats(xp, x3, eps, out=None):
    """Per-channel mean, 1/sqrt(var + eps) and biased var of a (N, C, P) array, plus the
    deviations x - mean as a (N, C, P) array the caller may overwrite (`out` if given: the
    node's planned slot, viewed as (N, C, P))."""
    count = x3.shape[0] * x3.shape[2]
    x3 = computable(xp, x3)
    mean = xp.einsum("ncp->c", x3) / count
    d = xp.subtract(x3, mean[:, None], out=None if out is None else _view3(out))
    var = xp.einsum("ncp,ncp->c", d, d) / count
    inv = 1.0 / xp.sqrt(var + eps)
    return mean, inv, var, d


def _view3(x):
    return x.reshape(x.shape[0], x.shape[1], -1)


def affine_inputs(ins, at):
    """The weight and bias among a node's inputs from index `at` on (None, None where
    they are absent: no affine)."""
    return (list(ins[at:at + 2]) + [None, None])[:2]


def _affine_or_unit(xp, w, b, c, dtype):
    # (a bf16 x's unit affine is f32, as its parameters would be: the loops read it so)
    dtype = xp.float32 if dtype.itemsize == 2 else dtype
    return (xp.ones(c, dtype) if w is None else w), (xp.zeros(c, dtype) if b is None else b)


def bn_inputs(ins, a):
    """x, weight, bias, running mean, running var of a batchnorm(-relu) node's inputs
    (weight and bias None without affine; the running stats None in a replay)."""
    if a["affine"]:
        w, bias, rm, rv = (list(ins[1:5]) + [None, None])[:4]
    else:
        w = bias = None
        rm, rv = (list(ins[1:3]) + [None, None])[:2]
    return ins[0], w, bias, rm, rv


def _relu_in_place(xp, y, cap):
    """relu, or relu6's min(max(y, 0), cap) with a cap, in place (NaN stays NaN)."""
    xp.maximum(y, 0, out=y)
    if cap is not None:
        xp.minimum(y, cap, out=y)
    return y


def affine_in_place(xp, d, inv, w, b, relu, cap):
    """y = (x - mean) * (inv * w) + b (then relu, capped at `cap` if not None) in place in
    the deviations d = x - mean, (N, C, P): the NumPy reference's output pass."""
    d *= (inv if w is None else inv * w)[:, None]
    if b is not None:
        d += b[:, None]
    if relu:
        _relu_in_place(xp, d, cap)
    return d


def bn_forward(xp, ins, a, ctx, relu):
    """batchnorm's kernel, followed by relu with `relu` (batchnorm_relu's, capped at its
    `cap` if it has one)."""
    x, w, bias, rm, rv = bn_inputs(ins, a)
    x3 = _view3(x)
    cap = a.get("cap") if relu else None
    if not ctx.training:
        inv = 1.0 / xp.sqrt(rv + a["eps"])
        scale = inv if w is None else inv * w
        shift = -rm * scale if bias is None else bias - rm * scale
        y = x3 * scale[:, None]
        y += shift[:, None]
        return (_relu_in_place(xp, y, cap) if relu else y).reshape(x.shape)
    f = fused_kernels(ctx, x, ctx.out, cuda=True)
    if f is not None:
        y = xp.empty_like(x3) if ctx.out is None else _view3(ctx.out)
        moments = xp.empty((2, x3.shape[1]), xp.float64)
        f.bn_forward(x3, *_affine_or_unit(xp, w, bias, x3.shape[1], x.dtype), a["eps"],
                     relu, _no_cap(cap), y, moments, f.threads)
    else:
        mean, inv, var, y = _bn_stats(xp, x3, a["eps"], ctx.out)
        affine_in_place(xp, y, inv, w, bias, relu, cap)
        moments = (mean, var)
    if not a.get("replay"):  # a recompute replay must not update the statistics again
        move_running(xp, f, rm, rv, moments, a["momentum"], x3.shape[0] * x3.shape[2])
    return y.reshape(x.shape)


def move_running(xp, f, rm, rv, moments, momentum, count):
    """The running statistics' update from `moments` (rows: the mean and the biased
    variance of `count` values a channel): one launch where the fused kernels have one
    (a GPU's bn_running, which reads them in float64), else update_running."""
    if f is not None and hasattr(f, "bn_running") and f.accepts(rm, rv):
        f.bn_running(rm, rv, xp.ascontiguousarray(moments, dtype=xp.float64), momentum,
                     count)
        return rm
    return update_running(rm, rv, moments[0], moments[1], momentum, count)


def update_running(rm, rv, mean, var, momentum, count):
    """The running statistics in place from a batch's mean and biased variance over
    `count` values a channel (PyTorch's rule: the unbiased variance in the running var)."""
    rm *= 1.0 - momentum
    rm += (momentum * mean).astype(rm.dtype, copy=False)
    rv *= 1.0 - momentum
    rv += ((momentum * count / max(count - 1, 1)) * var).astype(rv.dtype, copy=False)
    return rm


@kernel("batchnorm")
def _batchnorm(xp, ins, a, ctx):
    return bn_forward(xp, ins, a, ctx, relu=False)


def _norm_grad_input(xp, dy, x, w, axes, wshape, eps):
    xhat, inv, _, _ = _normalise(xp, x, axes, eps)
    dxhat = dy if w is None else dy * w.reshape(wshape)
    return inv * (dxhat - dxhat.mean(axis=axes, keepdims=True)
                  - xhat * (dxhat * xhat).mean(axis=axes, keepdims=True))


def _no_cap(cap):
    """The fused kernels' cap: inf for none."""
    return float("inf") if cap is None else float(cap)


def _masked(xp, dy3, d, inv, w, b, cap):
    """dy where z = (x - mean) * (inv * w) + b > 0 (and z < cap with a cap; z as the forward
    computed it), else 0: one new array of dy's size (and a bool one with a cap)."""
    g = d * (inv if w is None else inv * w)[:, None]
    if b is not None:
        g += b[:, None]
    below = None if cap is None else xp.less(g, cap)
    xp.greater(g, 0, out=g)  # 1 or 0
    if below is not None:
        g *= below
    g *= dy3
    return g


@kernel("batchnorm_grad_stats")
def _bn_grad_stats(xp, ins, a, ctx):
    dy, x = ins[0], ins[1]
    w, b = affine_inputs(ins, 2)
    dy3, x3 = _view3(dy), _view3(x)
    # (f32 statistics for 2-byte data: the op's shape rule)
    out = xp.empty((len(STAT_ROWS), x3.shape[1]),
                   dtype=xp.float32 if dy3.dtype.itemsize == 2 else dy3.dtype)
    f = fused_kernels(ctx, dy, x, cuda=True)
    if f is not None:
        f.bn_grad_stats(dy3, x3, *_affine_or_unit(xp, w, b, x3.shape[1], x.dtype), a["eps"],
                        a["relu"], _no_cap(a.get("cap")), out, f.threads)
        return out
    mean, inv, _, d = _bn_stats(xp, x3, a["eps"])
    grad_sums(xp, computable(xp, dy3), d, inv, w, b, a["relu"], a.get("cap"), out)
    out[2] = mean
    out[3] = inv
    return out


def grad_sums(xp, dy3, d, inv, w, b, relu, cap, out):
    """out[0] = sum(g * x_hat), out[1] = sum(g) per channel (the weight's and the bias's
    gradients), g = dy (times the relu mask with `relu`), from the deviations d = x - mean
    (N, C, P) and inv = 1/std: the NumPy reference of the fused kernels' statistics."""
    if relu:
        dy3 = _masked(xp, dy3, d, inv, w, b, cap)
    out[0] = xp.einsum("ncp,ncp->c", dy3, d) * inv
    out[1] = xp.einsum("ncp->c", dy3)
    return out


@kernel("batchnorm_grad_from_stats")
def _bn_grad_from_stats(xp, ins, a, ctx):
    acc = ins[5] if len(ins) > 5 else None
    w, b = affine_inputs(ins, 3)
    return grad_from_stats(xp, ctx, ins[0], ins[1], ins[2], w, b, acc, a["relu"],
                           a.get("cap"))


def grad_from_stats(xp, ctx, dy, x, st, w, b, acc, relu, cap, count=None):
    """batchnorm's dx from STAT_ROWS' rows `st` (plus `acc`, another gradient of x):
    dx = w * inv * (g - sum(g) / M - (x - mean) * inv * sum(g * x_hat) / M), g = dy (times
    the relu mask with `relu`), M = `count` or the values a channel of x (a synchronised
    batchnorm's sums count every device's): as _norm_grad_input, with the sums known."""
    dy3 = _view3(dy)
    local = dy3.shape[0] * dy3.shape[2]
    count = local if count is None else count
    gw, sdy, mean, inv = st[0], st[1], st[2], st[3]
    f = fused_kernels(ctx, dy, x, acc, ctx.out, cuda=True)
    if f is not None:
        dx = xp.empty_like(dy3) if ctx.out is None else _view3(ctx.out)
        f.bn_grad_input(dy3, _view3(x), st, *_affine_or_unit(xp, w, b, st.shape[1], x.dtype),
                        relu, _no_cap(cap), dx if acc is None else _view3(acc),
                        acc is not None, dx, f.threads,
                        *(() if count == local else (count,)))
        return dx.reshape(x.shape)
    dx = xp.subtract(_view3(x), mean[:, None], out=None if ctx.out is None else _view3(ctx.out))
    if relu:
        dy3 = _masked(xp, dy3, dx, inv, w, b, cap)
    dx *= (-inv * gw / count)[:, None]
    dx += (-sdy / count)[:, None]
    dx += dy3
    dx *= (inv if w is None else inv * w)[:, None]
    if acc is not None:
        dx += _view3(acc)
    return dx.reshape(x.shape)


@kernel("batchnorm_grad_affine")
def _bn_grad_affine(xp, ins, a, ctx):
    return ins[0][a["row"]].copy()


def _rows(x, axis):
    """x as (rows, normalised elements): a view for contiguous x."""
    ax = axis % x.ndim
    return x.reshape(x.shape[:ax] + (-1,))


def _matrix(x, ax):
    """x as a 2-d (rows, normalised elements) view, for the fused row loops."""
    return x.reshape(-1, math.prod(x.shape[ax:]))


@kernel("layernorm")
def _layernorm(xp, ins, a, ctx):
    x = ins[0]
    ax = a["axis"] % x.ndim
    f = fused_kernels(ctx, *ins)
    if f is not None:
        x2 = _matrix(x, ax)
        w, b = ((ins[1].reshape(-1), ins[2].reshape(-1)) if len(ins) > 1 else
                (xp.ones(x2.shape[1], x.dtype), xp.zeros(x2.shape[1], x.dtype)))
        y = xp.empty_like(x)
        f.ln_forward(x2, w, b, a["eps"], _matrix(y, ax))
        return y
    xhat = _normalise(xp, _rows(x, ax), -1, a["eps"])[0].reshape(x.shape)
    if len(ins) > 1:
        return xhat * ins[1] + ins[2]
    return xhat


@kernel("layernorm_grad_input")
def _ln_gi(xp, ins, a, ctx):
    dy, x = ins[0], ins[1]
    w = ins[2] if len(ins) > 2 else None
    ax = a["axis"] % x.ndim
    f = fused_kernels(ctx, dy, x, w)
    if f is not None:
        x2 = _matrix(x, ax)
        dx = xp.empty_like(x)
        f.ln_grad_input(_matrix(dy, ax), x2, xp.ones(x2.shape[1], x.dtype) if w is None
                        else w.reshape(-1), a["eps"], _matrix(dx, ax))
        return dx
    if w is not None:
        dy = dy * w
    return _norm_grad_input(xp, _rows(dy, ax), _rows(x, ax), None, -1, None,
                            a["eps"]).reshape(x.shape)


@kernel("layernorm_grad_weight")
def _ln_gw(xp, ins, a, ctx):
    dy, x = ins
    ax = a["axis"] % x.ndim
    f = fused_kernels(ctx, dy, x)
    if f is not None:
        acc = xp.zeros(x.shape[ax:], xp.float64)
        f.ln_grad_weight(_matrix(dy, ax), _matrix(x, ax), a["eps"], acc.reshape(-1))
        return acc.astype(x.dtype)
    xhat = _normalise(xp, _rows(x, ax), -1, a["eps"])[0]
    return (_rows(dy, ax) * xhat).reshape((-1,) + x.shape[ax:]).sum(axis=0)


# -- gradient rules ---------------------------------------------------------------------------
def bn_rule(relu):
    """batchnorm's (relu=True: batchnorm_relu's) gradient rule: the statistics pass, dx
    from its rows, the weight and bias gradients as two of its rows."""
    def rule(n, b, gy):
        x = n.inputs[0]
        affine = list(n.inputs[1:3]) if n.attrs["affine"] else []
        # the relu mask needs weight and bias (z = x_hat * weight + bias); dx the weight
        mask_in, attrs = (affine, {"relu": True, "cap": n.attrs.get("cap")}) if relu \
            else ([], {})
        st = b.emit("batchnorm_grad_stats", [gy, x] + mask_in,
                    {"eps": n.attrs["eps"], **attrs}, tag="stats")
        out = [b.emit("batchnorm_grad_from_stats", [gy, x, st] + (mask_in or affine[:1]),
                      attrs, tag="x")]
        if affine:
            out += [b.emit("batchnorm_grad_affine", [st], {"row": 0}, tag="weight"),
                    b.emit("batchnorm_grad_affine", [st], {"row": 1}, tag="bias")]
        return out + [None] * (len(n.inputs) - len(out))  # no gradients for the buffers
    return rule


def _ln_rule(n, b, gy):
    x = n.inputs[0]
    eps = {"eps": n.attrs["eps"], "axis": n.attrs["axis"]}
    if not n.attrs["affine"]:
        return [b.emit("layernorm_grad_input", [gy, x], eps, tag="x")]
    w = n.inputs[1]
    if n.attrs["axis"] % n.type.rank != n.type.rank - 1:
        # the bias gradient: dy summed over the leading (not normalised) dims
        db = b.emit("sum_to", [gy], {"shape": b.type(w).shape}, tag="bias")
    else:
        db = b.emit("sum_except", [gy], {"axis": -1}, tag="bias")
    return [b.emit("layernorm_grad_input", [gy, x, w], eps, tag="x"),
            b.emit("layernorm_grad_weight", [gy, x], eps, tag="weight"), db]


grad_rule("batchnorm")(bn_rule(relu=False))
grad_rule("layernorm")(_ln_rule)
