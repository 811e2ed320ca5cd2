"""The operators of a synchronised batchnorm: a batchnorm whose copies on several devices
normalise with the statistics of the whole batch (netdsl/parallel/syncbn.py emits them;
they are internal, not callable from the language). Per copy, with the data's dtype:

    m = bn_moments(x)                         [2, C]: this copy's mean and biased variance
    s = bn_combine(all_gather(m, every copy's), counts)   [2, C]: the whole batch's
    y = sync_batchnorm(x, s, weight, bias)    (x - mean) * w / sqrt(var + eps) + b (+ relu)
    bn_running_update(running_mean, running_var, s)

A micro-batch alone on its device normalises with its own moments (s = m, no collective),
and a device's micro-batches update its running statistics once a step, from all their
statistics combined (netdsl/parallel/syncbn.defer_running_stats).

The combination is Chan et al.'s (the mean of the means, and of the variances plus each
copy's squared distance to the mean, weighted by the counts, in float64): exact, and the
same bits on every device. `sync_batchnorm`'s gradient rule writes the backward of every
copy at once, PyTorch's SyncBatchNorm's: each copy's sums sum(g * x_hat) and sum(g) (its
weight and bias gradients, g = dy times the relu mask), one all_reduce of them, and dx
from the totals. Its rule gives x the whole gradient, the paths through the statistics
included, so the statistics (computed by ops that are not differentiable) get none.

With the backend's fused kernels (Numba, netdsl.backends.numpy_fused_norm; on a GPU the
CUDA ones, netdsl.backends.cupy_fused) bn_moments, sync_batchnorm and each backward node
are one pass over x; the NumPy kernels here are their reference.
"""
from __future__ import annotations

import numpy as np

from netdsl.errors import NetdslError, ShapeError
from netdsl.ir.opdef import GT0, Arg, OpDef, Range, grad_rule, kernel, register
from netdsl.ir.ops._util import fused_kernels, need_rank
from netdsl.ir.ops.norm import (
    _affine_or_unit,
    _no_cap,
    _stats_workspace,
    _view3,
    affine_in_place,
    affine_inputs,
    grad_from_stats,
    grad_sums,
    move_running,
)
from netdsl.ir.types import TensorType, accumulate_dtype

_FUSED = {"internal": True, "fused_kernels": ("batchnorm",)}
# per-channel statistics: kept by memory plans, never recomputed (netdsl.memory.simulate)
_SUMMARY = {"summary": True}
_BN_ARGS = (Arg("eps", "float", 1e-5, range=GT0), Arg("relu", "bool", False),
            Arg("cap", "float", None, range=GT0))


def _two_rows(x: TensorType) -> TensorType:
    # per-channel sums and moments: f32 for 2-byte x (mixed precision)
    return TensorType((2, x.shape[1]), accumulate_dtype(x.dtype))


def _need_stats(op: str, x: TensorType, stats: TensorType, what: str = "stats") -> None:
    if stats.shape != (2, x.shape[1]):
        raise ShapeError(f"{op}: {what} {stats} must be [2, {x.shape[1]}] for x {x}")


def _moments_shape(ins, a):
    need_rank(ins[0], "bn_moments", (2, 3, 4, 5))
    return _two_rows(ins[0])


def _combine_shape(ins, a):
    m, counts = ins[0], a["counts"]
    if m.rank != 2 or m.shape[0] != 2 * len(counts) or min(counts, default=0) < 1:
        raise ShapeError(f"bn_combine: {m} must hold a mean and a variance row for each "
                         f"of the {len(counts)} counts {counts}")
    return TensorType((2, m.shape[1]), m.dtype)


def _apply_shape(ins, a):
    x = ins[0]
    need_rank(x, "sync_batchnorm", (2, 3, 4, 5))
    _need_stats("sync_batchnorm", x, ins[1])
    return x


def _sums_shape(ins, a):
    _need_stats("sync_batchnorm_grad_sums", ins[1], ins[2])
    return _two_rows(ins[1])


def _input_shape(ins, a):
    x = ins[1]
    _need_stats("sync_batchnorm_grad_input", x, ins[2])
    _need_stats("sync_batchnorm_grad_input", x, ins[3], "total")
    if len(ins) > 6 and ins[6] != TensorType(x.shape, ins[0].dtype):
        raise ShapeError(f"sync_batchnorm_grad_input: the gradient to add {ins[6]} differs "
                         f"from x {x}")
    return TensorType(x.shape, ins[0].dtype)


def _per_value(k):
    return lambda ins, out, a: k * ins[0].numel()


register(OpDef(
    "bn_moments", (Arg("x", "tensor"),), _moments_shape, "norm", flops=_per_value(3),
    workspace=_per_value(4),  # (the NumPy kernel's deviations; rules count float32)
    differentiable=False, extra={**_FUSED, **_SUMMARY},
    doc="rows: the mean and the biased variance of x over every dim but 1 (a synchronised "
        "batchnorm's local statistics)"))
register(OpDef(
    "bn_combine", (Arg("moments", "tensor"), Arg("counts", "ints")), _combine_shape, "norm",
    flops=lambda ins, out, a: 8 * ins[0].numel(), differentiable=False,
    extra={**_FUSED, **_SUMMARY},
    doc="the mean and biased variance of a whole batch from its parts' (all_gather'ed "
        "bn_moments rows, part k of counts[k] values a channel)"))
register(OpDef(
    "sync_batchnorm",
    (Arg("x", "tensor"), Arg("stats", "tensor"), Arg("weight", "tensor", None),
     Arg("bias", "tensor", None)) + _BN_ARGS,
    _apply_shape, "norm", flops=lambda ins, out, a: (5 + a["relu"]) * out.numel(),
    retains=("inputs",), extra={**_FUSED, "mixed_floats": True},
    doc="(x - mean) * weight / sqrt(var + eps) + bias (then relu, capped at `cap`) with "
        "stats = bn_combine's rows: a synchronised batchnorm's output; its gradient rule "
        "differentiates through the statistics (see the module docstring)"))
register(OpDef(
    "sync_batchnorm_grad_sums",
    (Arg("dy", "tensor"), Arg("x", "tensor"), Arg("stats", "tensor"),
     Arg("weight", "tensor", None), Arg("bias", "tensor", None)) + _BN_ARGS,
    _sums_shape, "backward", flops=lambda ins, out, a: (6 + a["relu"]) * ins[1].numel(),
    workspace=_stats_workspace, differentiable=False, extra=_FUSED,
    doc="rows: sum(g * x_hat) and sum(g) over this copy (its weight and bias gradients), "
        "g = dy (masked as the relu's with relu=true)"))
register(OpDef(
    "sync_batchnorm_grad_input",
    (Arg("dy", "tensor"), Arg("x", "tensor"), Arg("stats", "tensor"),
     Arg("total", "tensor"), Arg("weight", "tensor", None), Arg("bias", "tensor", None),
     Arg("acc", "tensor", None)) + _BN_ARGS + (Arg("count", "int", 1, range=Range(1)),),
    _input_shape, "backward",
    flops=lambda ins, out, a: (8 + (len(ins) > 6)) * out.numel(),
    workspace=lambda ins, out, a: (
        4 + (a.get("cap") is not None) if a["relu"] else 0) * out.numel(),
    differentiable=False, extra=_FUSED,
    doc="dx of sync_batchnorm from the sums of every copy (`total`, count values a "
        "channel); `acc`, another gradient of x, added (fuse_grads)"))
register(OpDef(
    "bn_running_update",
    (Arg("running_mean", "tensor"), Arg("running_var", "tensor"), Arg("stats", "tensor"),
     Arg("momentum", "float", 0.1, range=Range(0, 1)), Arg("count", "int", 1, range=Range(1))),
    lambda ins, a: ins[0], "optimizer", flops=lambda ins, out, a: 6 * out.numel(),
    differentiable=False, writes=(0, 1), view_of=0,
    doc="update batchnorm running statistics in place from bn_combine's rows (count "
        "values a channel: PyTorch's unbiased variance in the running var)"))


# -- kernels ------------------------------------------------------------------------------------
def _moments64(xp, stats):
    """The fused kernels' float64 moments (mean and biased variance rows)."""
    return xp.ascontiguousarray(stats, dtype=xp.float64)


def _inv(xp, stats, eps):
    """1/sqrt(var + eps) per channel, computed in float64 and rounded to the data's dtype
    as the fused kernels compute it: every kernel of a layer, forward and backward,
    recomputes the relu mask from the same scale."""
    return (1.0 / xp.sqrt(_moments64(xp, stats)[1] + eps)).astype(stats.dtype)


@kernel("bn_moments")
def _bn_moments(xp, ins, a, ctx):
    x3 = _view3(ins[0])
    f = fused_kernels(ctx, ins[0], cuda=True)
    if f is not None:
        moments = xp.empty((2, x3.shape[1]), xp.float64)
        f.bn_moments(x3, moments, f.threads)
        return moments.astype(x3.dtype)
    count = x3.shape[0] * x3.shape[2]
    mean = xp.einsum("ncp->c", x3) / count
    d = x3 - mean[:, None]
    return xp.stack([mean, xp.einsum("ncp,ncp->c", d, d) / count])


@kernel("bn_combine")
def _bn_combine(xp, ins, a, ctx):
    f = fused_kernels(ctx, ins[0], cuda=True)
    if f is not None:  # (the counts a host array: the CUDA kernels keep them uploaded)
        out = xp.empty((2, ins[0].shape[1]), ins[0].dtype)
        f.bn_combine(ins[0], np.asarray(a["counts"], dtype=np.float64), out)
        return out
    parts = ins[0].astype(xp.float64).reshape(len(a["counts"]), 2, -1)
    n = xp.asarray(a["counts"], dtype=xp.float64)[:, None]
    total = float(sum(a["counts"]))
    mean = (n * parts[:, 0]).sum(axis=0) / total
    var = (n * (parts[:, 1] + (parts[:, 0] - mean) ** 2)).sum(axis=0) / total
    return xp.stack([mean, var]).astype(ins[0].dtype)


@kernel("sync_batchnorm")
def _sync_batchnorm(xp, ins, a, ctx):
    x, stats = ins[0], ins[1]
    w, b = affine_inputs(ins, 2)
    x3, relu, cap = _view3(x), a["relu"], a.get("cap")
    if not ctx.training:
        raise NetdslError(f"sync_batchnorm (node %{ctx.node.name}) runs in training only: "
                          "evaluation uses the batchnorm's running statistics")
    f = fused_kernels(ctx, x, ctx.out, cuda=True)
    if f is not None:
        y = xp.empty_like(x3) if ctx.out is None else _view3(ctx.out)
        f.bn_normalise(x3, _moments64(xp, stats), *_affine_or_unit(xp, w, b, x3.shape[1],
                                                                   x.dtype),
                       a["eps"], relu, _no_cap(cap), y, f.threads)
        return y.reshape(x.shape)
    y = xp.subtract(x3, stats[0][:, None], out=None if ctx.out is None else _view3(ctx.out))
    return affine_in_place(xp, y, _inv(xp, stats, a["eps"]), w, b, relu, cap).reshape(x.shape)


@kernel("sync_batchnorm_grad_sums")
def _sync_bn_grad_sums(xp, ins, a, ctx):
    dy, x, stats = ins[0], ins[1], ins[2]
    w, b = affine_inputs(ins, 3)
    dy3, x3 = _view3(dy), _view3(x)
    out = xp.empty((2, x3.shape[1]), dtype=dy.dtype)
    f = fused_kernels(ctx, dy, x, cuda=True)
    if f is not None:
        f.bn_grad_sums(dy3, x3, _moments64(xp, stats),
                       *_affine_or_unit(xp, w, b, x3.shape[1], x.dtype), a["eps"], a["relu"],
                       _no_cap(a.get("cap")), out, f.threads)
        return out
    d = x3 - stats[0][:, None]
    return grad_sums(xp, dy3, d, _inv(xp, stats, a["eps"]), w, b, a["relu"], a.get("cap"),
                     out)


@kernel("sync_batchnorm_grad_input")
def _sync_bn_grad_input(xp, ins, a, ctx):
    dy, x, stats, total = ins[:4]
    w, b = affine_inputs(ins, 4)
    acc = ins[6] if len(ins) > 6 else None
    # STAT_ROWS' rows: the totals, the mean and 1/std
    st = xp.concatenate([total, stats[:1], _inv(xp, stats, a["eps"])[None]])
    return grad_from_stats(xp, ctx, dy, x, st, w, b, acc, a["relu"], a.get("cap"),
                           a["count"])


@kernel("bn_running_update")
def _bn_running_update(xp, ins, a, ctx):
    rm, rv, stats = ins
    return move_running(xp, fused_kernels(ctx, rm, rv, cuda=True), rm, rv, stats,
                        a["momentum"], a["count"])


# -- the backward of every copy at once ----------------------------------------------------------
@grad_rule("sync_batchnorm")
def _sync_batchnorm_rule(n, b, gy):
    """The first copy visited writes every copy's backward (their sums, one all_reduce,
    their dx); each copy's rule returns its own: dx, nothing for the statistics, the
    weight's and the bias's gradients (this copy's sums)."""
    group = n.meta["sync_group"]
    key = ("sync_batchnorm", group)
    if key not in b.memo:
        b.memo[key] = _group_backward(b, group)
    return b.memo[key][n.name]


def _group_backward(b, group: tuple[str, ...]) -> dict[str, list]:
    nodes = [b.g[m] for m in group]
    prev = b.fwd
    gys, sums = [], []
    for m in nodes:
        b.fwd = m
        gm = b.grad_total(m.name)
        if gm is None:  # (a copy nothing differentiable reads: its dx still takes the
            # other copies' gradients through the statistics)
            gm = b.emit("fill", [], {"shape": m.type.shape, "value": 0.0,
                                     "dtype": m.type.dtype}, tag="zero")
        gys.append(gm)
        sums.append(b.emit("sync_batchnorm_grad_sums", [gm, *m.inputs], _bn_attrs(m),
                           tag="sums"))
    devices = [m.device for m in nodes]
    b.fwd = nodes[0]
    totals = sums if len(nodes) == 1 else b.emit_group(  # (a micro-batch alone: its own)
        "all_reduce", sums, {"group": tuple(devices)},
        [b.g.fresh_name(f"{m.name}.grad.sums_all") for m in nodes], devices)
    count = nodes[0].meta["sync_count"]
    out = {}
    for m, gm, s, t in zip(nodes, gys, sums, totals, strict=True):
        b.fwd = m
        x, stats, *affine = m.inputs
        dx = b.emit("sync_batchnorm_grad_input", [gm, x, stats, t, *affine],
                    {**_bn_attrs(m), "count": count}, tag="x")
        grads = [dx, None]
        if affine:
            grads += [b.emit("batchnorm_grad_affine", [s], {"row": 0}, tag="weight"),
                      b.emit("batchnorm_grad_affine", [s], {"row": 1}, tag="bias")]
        out[m.name] = grads
    b.fwd = prev
    return out


def _bn_attrs(n) -> dict:
    """The normalisation's attributes a backward node of `n` takes (eps, relu, cap)."""
    return {k: n.attrs[k] for k in ("eps", "relu", "cap") if k in n.attrs}
