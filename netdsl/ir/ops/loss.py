"""Softmax and the losses.

Losses reduce to a scalar by default (`reduction="mean"`); "sum" adds, "none" keeps one
value per position. The class-index losses (softmax_cross_entropy, nll) follow torch's
cross_entropy / nll_loss: class weights, `ignore_index` (those positions contribute
nothing and are not counted), label smoothing, and a weighted mean that divides by the
summed weights of the counted labels. The class axis is PyTorch's: dim 1 of [N, C] or
[N, C, d1, ...] scores, or `axis=` (e.g. -1 for a language model's [N, T, C]).
"""
from netdsl.errors import ShapeError
from netdsl.ir.opdef import NON_NEGATIVE, Arg, OpDef, Range, grad_rule, kernel, register
from netdsl.ir.ops._util import fused_kernels, need_float, norm_axis, scratch_rule
from netdsl.ir.types import TensorType


def _softmax_shape(ins, a):
    need_float(ins[0], "softmax")
    norm_axis(a["axis"], ins[0].rank, "softmax")
    return ins[0]


register(OpDef("softmax", (Arg("x", "tensor"), Arg("axis", "axis", -1)), _softmax_shape,
               "activation", flops=lambda ins, out, a: 5 * out.numel(), retains=("output",),
               workspace=scratch_rule(1.25), doc="softmax along an axis (the last by default)",
               extra={"fused_kernels": ("softmax",)}))
register(OpDef("log_softmax", (Arg("x", "tensor"), Arg("axis", "axis", -1)), _softmax_shape,
               "activation", flops=lambda ins, out, a: 5 * out.numel(), retains=("output",),
               doc="log of softmax along an axis, computed stably (x - logsumexp(x))"))


_REDUCTIONS = ("mean", "sum", "none")


def _class_loss_shape(op):
    def shape(ins, a):
        logits, labels = ins
        need_float(logits, op, "logits")
        if labels.dtype not in ("i32", "i64"):
            raise ShapeError(f"{op} expects integer class labels, but {{labels}} is {labels}")
        if logits.rank < 2:
            raise ShapeError(f"{op} expects scores with a class dimension, but {{logits}} is "
                             f"{logits}")
        ax = norm_axis(a["axis"], logits.rank, op)
        if labels.shape != logits.shape[:ax] + logits.shape[ax + 1:]:
            raise ShapeError(f"{op} expects labels shaped like the logits without the class "
                             f"dimension (axis {a['axis']}), but {{logits}} is {logits} and "
                             f"{{labels}} is {labels}; for [N, T, C] scores pass axis=-1")
        k = logits.shape[ax]
        if a["weight"] is not None and len(a["weight"]) != k:
            raise ShapeError(f"{op}: {len(a['weight'])} class weights for {k} classes")
        if not 0.0 <= a.get("label_smoothing", 0.0) <= 1.0:
            raise ShapeError(f"{op}: label_smoothing must be in [0, 1], not "
                             f"{a['label_smoothing']}")
        if a["reduction"] == "none":
            return TensorType(labels.shape, logits.dtype)
        return TensorType((), logits.dtype)
    return shape


_CLASS_ARGS = (Arg("weight", "floats", None), Arg("ignore_index", "int", -100),
               Arg("reduction", "str", "mean", choices=_REDUCTIONS), Arg("axis", "axis", 1))
register(OpDef("softmax_cross_entropy",
               (Arg("logits", "tensor"), Arg("labels", "tensor")) + _CLASS_ARGS
               + (Arg("label_smoothing", "float", 0.0, range=Range(0, 1)),),
               _class_loss_shape("softmax_cross_entropy"), "loss",
               flops=lambda ins, out, a: 6 * ins[0].numel(), retains=("inputs",),
               # the scores with the class axis last (a copy unless it is), the log
               # softmax's two passes, the class coefficients and their product
               workspace=scratch_rule(4, of=0),
               doc="-log softmax(logits)[label] per position, reduced (torch's cross_entropy "
                   "with class weights, ignore_index and label_smoothing)",
               extra={"fused_kernels": ("loss",)}, precision="f32"))
register(OpDef("nll", (Arg("logp", "tensor"), Arg("labels", "tensor")) + _CLASS_ARGS,
               _class_loss_shape("nll"), "loss",
               flops=lambda ins, out, a: 2 * ins[0].numel(), retains=("input1",),
               doc="negative log-likelihood -logp[label] of log-probabilities (torch's "
                   "nll_loss), reduced", precision="f32"))


def _pair_loss_shape(op):
    def shape(ins, a):
        p, t = ins
        need_float(p, op, "pred")
        if p.shape != t.shape or p.dtype != t.dtype:
            raise ShapeError(f"{op} expects prediction and target of one type, but {{pred}} "
                             f"is {p} and {{target}} is {t}")
        if a.get("beta", 1.0) < 0:
            raise ShapeError(f"{op}: beta must not be negative")
        return p if a["reduction"] == "none" else TensorType((), p.dtype)
    return shape


_RED = Arg("reduction", "str", "mean", choices=_REDUCTIONS)
for _name, _extra, _doc in (
        ("l1", (), "absolute error |pred - target|, reduced"),
        ("smooth_l1", (Arg("beta", "float", 1.0, range=NON_NEGATIVE),),
         "Huber-style error: 0.5 d^2 / beta where |d| < beta, else |d| - 0.5 beta; reduced"),
        ("bce_with_logits", (),
         "binary cross-entropy of sigmoid(pred) against target probabilities, computed "
         "stably from the logits; reduced")):
    register(OpDef(_name, (Arg("pred", "tensor"), Arg("target", "tensor")) + _extra + (_RED,),
                   _pair_loss_shape(_name), "loss",
                   flops=lambda ins, out, a: 4 * ins[0].numel(), retains=("inputs",),
                   doc=_doc, precision="f32"))
    register(OpDef(f"{_name}_grad",
                   (Arg("dy", "tensor"), Arg("pred", "tensor"), Arg("target", "tensor"))
                   + _extra + (_RED, Arg("wrt", "int", 0)),
                   lambda ins, a: ins[1], "backward",
                   flops=lambda ins, out, a: 4 * out.numel(), differentiable=False,
                   doc=f"d {_name} / d pred (wrt=0) or d target (wrt=1)"))


register(OpDef("mse", (Arg("pred", "tensor"), Arg("target", "tensor"),
                       Arg("reduction", "str", "mean", choices=_REDUCTIONS)),
               _pair_loss_shape("mse"), "loss",
               flops=lambda ins, out, a: 3 * ins[0].numel(), retains=("inputs",),
               doc="squared error (pred - target)^2, reduced (the mean by default)",
               precision="f32"))


# -- backward operators -----------------------------------------------------------------------
register(OpDef("softmax_grad", (Arg("dy", "tensor"), Arg("y", "tensor"), Arg("axis", "axis", -1)),
               lambda ins, a: ins[1], "backward", flops=lambda ins, out, a: 4 * out.numel(),
               workspace=scratch_rule(1), differentiable=False,
               doc="dx = y * (dy - sum(dy * y)) along the axis",
               extra={"fused_kernels": ("softmax",)}))
register(OpDef("log_softmax_grad",
               (Arg("dy", "tensor"), Arg("y", "tensor"), Arg("axis", "axis", -1)),
               lambda ins, a: ins[1], "backward", flops=lambda ins, out, a: 4 * out.numel(),
               differentiable=False, doc="dx = dy - exp(y) * sum(dy) along the axis"))
register(OpDef("softmax_cross_entropy_grad",
               (Arg("dy", "tensor"), Arg("logits", "tensor"), Arg("labels", "tensor"))
               + _CLASS_ARGS + (Arg("label_smoothing", "float", 0.0),),
               lambda ins, a: ins[1], "backward", flops=lambda ins, out, a: 6 * out.numel(),
               differentiable=False,
               # the moved scores, the softmax's two passes, the coefficients, their product
               workspace=scratch_rule(5),
               doc="d(logits) = dy * (sum(c) softmax(logits) - c) / denominator, c the "
                   "per-class coefficients (one-hot, smoothed, weighted)",
               extra={"fused_kernels": ("loss",)}))
register(OpDef("nll_grad", (Arg("dy", "tensor"), Arg("labels", "tensor"),
                            Arg("shape", "shape")) + _CLASS_ARGS,
               lambda ins, a: TensorType(tuple(a["shape"]), ins[0].dtype), "backward",
               flops=lambda ins, out, a: out.numel(), differentiable=False,
               doc="d(logp) = -dy * weight[label] * onehot / denominator"))
register(OpDef("mse_grad", (Arg("dy", "tensor"), Arg("pred", "tensor"), Arg("target", "tensor"),
                            Arg("reduction", "str", "mean", choices=_REDUCTIONS)),
               lambda ins, a: ins[1], "backward", flops=lambda ins, out, a: 3 * out.numel(),
               differentiable=False, doc="d(pred) = dy * 2 (pred - target) (/ numel for mean)"))


# -- kernels ----------------------------------------------------------------------------------
def _softmax_fn(xp, x, axis):
    e = xp.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _last_axis(x, axis) -> bool:
    return axis % x.ndim == x.ndim - 1


@kernel("softmax")
def _softmax(xp, ins, a, ctx):
    x = ins[0]
    f = fused_kernels(ctx, x)
    if f is not None and _last_axis(x, a["axis"]):  # rows in one pass each (Numba)
        y = xp.empty_like(x)
        f.softmax_rows(x.reshape(-1, x.shape[-1]), y.reshape(-1, x.shape[-1]))
        return y
    return _softmax_fn(xp, x, a["axis"])


@kernel("softmax_grad")
def _softmax_grad(xp, ins, a, ctx):
    dy, y = ins
    f = fused_kernels(ctx, dy, y)
    if f is not None and _last_axis(y, a["axis"]):
        dx = xp.empty_like(y)
        d = y.shape[-1]
        f.softmax_grad_rows(dy.reshape(-1, d), y.reshape(-1, d), dx.reshape(-1, d))
        return dx
    return y * (dy - (dy * y).sum(axis=a["axis"], keepdims=True))


def log_softmax_fn(xp, x, axis):
    m = x.max(axis=axis, keepdims=True)
    z = x - m
    return z - xp.log(xp.exp(z).sum(axis=axis, keepdims=True))


@kernel("log_softmax")
def _log_softmax(xp, ins, a, ctx):
    return log_softmax_fn(xp, ins[0], a["axis"])


@kernel("log_softmax_grad")
def _log_softmax_grad(xp, ins, a, ctx):
    dy, y = ins
    return dy - xp.exp(y) * dy.sum(axis=a["axis"], keepdims=True)


def _flat(xp, logits, labels, axis):
    """Scores as [positions, classes] (the class axis moved last) and labels as [positions]."""
    z = xp.moveaxis(logits, axis, -1)
    return z.reshape(-1, z.shape[-1]), labels.reshape(-1)


def _unflat(xp, g, shape, axis):
    """A [positions, classes] gradient back in the scores' layout."""
    ax = axis % len(shape)
    moved = shape[:ax] + shape[ax + 1:] + (shape[ax],)
    return xp.ascontiguousarray(xp.moveaxis(g.reshape(moved), -1, ax))


def _coefficients(xp, t, k, a, dtype, smoothing):
    """Per-position class coefficients c [M, K] with loss_i = -sum_c c[i, c] logp[i, c],
    and the mean's denominator (the summed weights of the counted labels)."""
    valid = t != a["ignore_index"]
    tc = xp.where(valid, t, 0).astype(xp.int64)
    w = xp.ones(k, dtype=dtype) if a["weight"] is None else xp.asarray(a["weight"], dtype=dtype)
    wy = w[tc] * valid.astype(dtype)
    c = xp.zeros((t.shape[0], k), dtype=dtype)
    c[xp.arange(t.shape[0]), tc] = (1.0 - smoothing) * wy
    if smoothing:
        c += (smoothing / k) * w[None, :] * valid.astype(dtype)[:, None]
    return c, wy.sum()


def _check_labels(xp, t, k, a, ctx):
    if getattr(ctx, "capturing", False):  # a recorded step reads nothing back: the labels
        return  # were checked on its first, unrecorded run
    bad = (t != a["ignore_index"]) & ((t < 0) | (t >= k))
    if bool(bad.any()):
        from netdsl.errors import NetdslError
        n = ctx.node
        v = int(t[bad][0])
        raise NetdslError(f"{n.op} %{n.name}: label {v} is out of range for {k} classes "
                          f"(valid: 0 to {k - 1}, or ignore_index {a['ignore_index']})",
                          loc=n.loc, stack=n.stack)


def _reduce(xp, per, denom, a, shape):
    if a["reduction"] == "none":
        return per.reshape(shape)
    total = per.sum()
    return total / denom if a["reduction"] == "mean" else total


def _scale(xp, dy, denom, a, m):
    """dy as a per-position [M, 1] factor of the gradient."""
    if a["reduction"] == "none":
        return dy.reshape(m, 1)
    if a["reduction"] == "mean":
        return xp.full((m, 1), 1.0, dtype=dy.dtype) * (dy / denom)
    return xp.full((m, 1), 1.0, dtype=dy.dtype) * dy


def _unweighted(a) -> bool:
    """No class weights and no label smoothing: each label's position counts once."""
    return a["weight"] is None and not a["label_smoothing"]


def _fused_sce(ctx, z, t, a):
    """The fused kernels for the plain case (unweighted, a mean or a sum;
    netdsl.backends.numpy_fused_loss), where they take these scores and labels."""
    if not _unweighted(a) or a["reduction"] == "none":
        return None
    f = fused_kernels(ctx, z)
    return f if f is not None and t.dtype == "int64" and t.flags.c_contiguous else None


@kernel("softmax_cross_entropy")
def _sce(xp, ins, a, ctx):
    z, t = _flat(xp, *ins, a["axis"])
    f = _fused_sce(ctx, z, t, a)
    if f is not None:
        total, status = f.sce_forward(z, t, a["ignore_index"])
        if status == 0:  # (else ignored labels, or a bad one, which is raised below)
            return xp.asarray(total / z.shape[0] if a["reduction"] == "mean" else total,
                              dtype=z.dtype)
    _check_labels(xp, t, z.shape[1], a, ctx)
    if _plain(xp, t, a, ctx):  # log-sum-exp minus the pick
        m = z.max(axis=1, keepdims=True)
        lse = xp.log(xp.exp(z - m).sum(axis=1)) + m[:, 0]
        picked = xp.take_along_axis(z, t[:, None].astype(xp.int64), axis=1)[:, 0]
        per = lse - picked
        return per.mean() if a["reduction"] == "mean" else _reduce(xp, per, 0, a, ins[1].shape)
    logp = log_softmax_fn(xp, z, 1)
    c, denom = _coefficients(xp, t, z.shape[1], a, z.dtype, a["label_smoothing"])
    return _reduce(xp, -(c * logp).sum(axis=1), denom, a, ins[1].shape)


@kernel("softmax_cross_entropy_grad")
def _sce_grad(xp, ins, a, ctx):
    dy, logits, labels = ins
    z, t = _flat(xp, logits, labels, a["axis"])
    f = _fused_sce(ctx, z, t, a)
    if f is not None:
        g = xp.empty_like(z)
        scale = float(dy) / (z.shape[0] if a["reduction"] == "mean" else 1)
        if f.sce_grad(z, t, a["ignore_index"], scale, g) == 0:
            return _unflat(xp, g, logits.shape, a["axis"])
    p = _softmax_fn(xp, z, 1)
    if _plain(xp, t, a, ctx):  # softmax minus the one-hot label: the forward's plain case
        m = z.shape[0]
        p[xp.arange(m), t] -= 1
        return _unflat(xp, p * _scale(xp, dy, m, a, m), logits.shape, a["axis"])
    c, denom = _coefficients(xp, t, z.shape[1], a, z.dtype, a["label_smoothing"])
    g = p * c.sum(axis=1, keepdims=True) - c
    return _unflat(xp, g * _scale(xp, dy, denom, a, z.shape[0]), logits.shape, a["axis"])


def _plain(xp, t, a, ctx) -> bool:
    """No class weights, no smoothing and no ignored label: every position counts once.
    (A recorded step cannot look at the labels: it takes the general path, the same sums.)"""
    return (_unweighted(a) and not getattr(ctx, "capturing", False)
            and not bool((t == a["ignore_index"]).any()))


@kernel("nll")
def _nll(xp, ins, a, ctx):
    lp, t = _flat(xp, *ins, a["axis"])
    _check_labels(xp, t, lp.shape[1], a, ctx)
    c, denom = _coefficients(xp, t, lp.shape[1], a, lp.dtype, 0.0)
    return _reduce(xp, -(c * lp).sum(axis=1), denom, a, ins[1].shape)


@kernel("nll_grad")
def _nll_grad(xp, ins, a, ctx):
    dy, labels = ins
    shape = tuple(int(d) for d in a["shape"])
    t = labels.reshape(-1)
    c, denom = _coefficients(xp, t, shape[a["axis"]], a, dy.dtype, 0.0)
    return _unflat(xp, -c * _scale(xp, dy, denom, a, t.shape[0]), shape, a["axis"])


def _pair_reduce(xp, per, a):
    if a["reduction"] == "none":
        return per
    return per.mean() if a["reduction"] == "mean" else per.sum()


def _pair_scale(dy, a, n):
    return dy * (1.0 / n) if a["reduction"] == "mean" else dy


def _smooth(xp, d, beta):
    ad = xp.abs(d)
    if beta == 0:
        return ad
    return xp.where(ad < beta, 0.5 * d * d / beta, ad - 0.5 * beta)


def _smooth_grad(xp, d, beta):
    if beta == 0:
        return xp.sign(d)
    return xp.where(xp.abs(d) < beta, d / beta, xp.sign(d))


def _log_sigmoid(xp, x):
    return -xp.logaddexp(0.0, -x)


@kernel("l1")
def _l1(xp, ins, a, ctx):
    return _pair_reduce(xp, xp.abs(ins[0] - ins[1]), a)


@kernel("smooth_l1")
def _smooth_l1(xp, ins, a, ctx):
    return _pair_reduce(xp, _smooth(xp, ins[0] - ins[1], a["beta"]), a)


@kernel("bce_with_logits")
def _bce(xp, ins, a, ctx):
    x, t = ins  # -(t log s(x) + (1 - t) log(1 - s(x))) = (1 - t) x - log s(x)
    return _pair_reduce(xp, (1.0 - t) * x - _log_sigmoid(xp, x), a)


@kernel("l1_grad")
def _l1_grad(xp, ins, a, ctx):
    dy, p, t = ins
    g = xp.sign(p - t) * _pair_scale(dy, a, p.size)
    return g if a["wrt"] == 0 else -g


@kernel("smooth_l1_grad")
def _smooth_l1_grad(xp, ins, a, ctx):
    dy, p, t = ins
    g = _smooth_grad(xp, p - t, a["beta"]) * _pair_scale(dy, a, p.size)
    return g if a["wrt"] == 0 else -g


@kernel("bce_with_logits_grad")
def _bce_grad(xp, ins, a, ctx):
    dy, x, t = ins
    s = xp.exp(_log_sigmoid(xp, x))
    g = (s - t) if a["wrt"] == 0 else -x
    return g * _pair_scale(dy, a, x.size)


@kernel("mse")
def _mse(xp, ins, a, ctx):
    d = ins[0] - ins[1]
    return _pair_reduce(xp, d * d, a)


@kernel("mse_grad")
def _mse_grad(xp, ins, a, ctx):
    dy, p, t = ins
    if a["reduction"] == "mean":
        return (p - t) * (dy * (2.0 / p.size))
    return (p - t) * (dy * 2.0)


# -- gradient rules ---------------------------------------------------------------------------
@grad_rule("softmax")
def _softmax_rule(n, b, gy):
    return [b.emit("softmax_grad", [gy, n.name], {"axis": n.attrs["axis"]})]


@grad_rule("log_softmax")
def _log_softmax_rule(n, b, gy):
    return [b.emit("log_softmax_grad", [gy, n.name], {"axis": n.attrs["axis"]})]


@grad_rule("softmax_cross_entropy")
def _sce_rule(n, b, gy):
    return [b.emit("softmax_cross_entropy_grad", [gy, n.inputs[0], n.inputs[1]],
                   dict(n.attrs)), None]


@grad_rule("nll")
def _nll_rule(n, b, gy):
    return [b.emit("nll_grad", [gy, n.inputs[1]], {"shape": b.type(n.inputs[0]).shape,
                                                   **n.attrs}), None]


def _pair_rule(op):
    def rule(n, b, gy):
        p, t = n.inputs
        return [b.emit(f"{op}_grad", [gy, p, t], {**n.attrs, "wrt": k}, tag=("pred", "target")[k])
                for k in (0, 1)]
    return rule


for _name in ("l1", "smooth_l1", "bce_with_logits"):
    grad_rule(_name)(_pair_rule(_name))


@grad_rule("mse")
def _mse_rule(n, b, gy):
    dp = b.emit("mse_grad", [gy, n.inputs[0], n.inputs[1]],
                {"reduction": n.attrs["reduction"]}, tag="pred")
    return [dp, b.emit("scale", [dp], {"factor": -1.0}, tag="target")]
