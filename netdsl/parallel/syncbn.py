"""Synchronised batchnorm: a batchnorm whose copies on several devices normalise with the
statistics of the whole batch, so a data-parallel step equals the single-device step.

Each copy's `batchnorm(x, w, b, running_mean, running_var)` becomes two `all_reduce`s of
per-channel sums (the mean first, then the squared deviations from it: the two-pass
variance the single-device kernel uses) and one normalising pass:

    mean = all_reduce(sum(x, every dim but 1)) / M   M = rows of the whole batch x spatial
    var  = all_reduce(centered_sq_sum(x, mean)) / M  (sum((x - mean)^2), one pass)
    y    = centered_affine(x, mean, w / sqrt(var + eps), b)   ((x - mean) * k + b)

plus a `bn_running_update` of the running statistics (in `outputs["state_updates"]`).
Autodiff differentiates it like anything else, and the collectives' gradient rules add
the backward's two all-reduces (of sum(dy) and sum(dy * d)) that a hand-written
synchronised batchnorm would have.
"""
from __future__ import annotations

import math

from netdsl.ir.graph import Graph, Node
from netdsl.ir.rewrite import make_node


def sync_batchnorms(g: Graph, copies: dict[str, list[str]], fwd: Graph, batch: int) -> Graph:
    """Rewrite every training-mode batchnorm whose copies sit on more than one device.
    The statistics count the whole batch over the single-device node's spatial size (a
    data split's copies hold all of it; a spatial split's hold strips)."""
    origs = [orig for orig, names in copies.items() if fwd[orig].op == "batchnorm"
             and len({g[x].device for x in names}) > 1]
    groups = [copies[orig] for orig in origs]
    if not groups:
        return g
    index = {x: k for k, names in enumerate(groups) for x in names}
    out: list[Node] = []
    updates: list[str] = []
    done: set[int] = set()
    pending: dict[int, list[Node]] = {}
    for n in list(g.nodes):
        k = index.get(n.name)
        if k is None:
            out.append(n)
            continue
        pending.setdefault(k, []).append(n)
        if len(pending[k]) == len(groups[k]) and k not in done:
            done.add(k)
            count = batch * math.prod(fwd[origs[k]].type.shape[2:])
            new, ups = _rewrite(g, pending.pop(k), count)
            out.extend(new)
            updates.extend(ups)
    g.nodes = out
    g.outputs["state_updates"] = g.outputs.get("state_updates", []) + updates
    return g


def _rewrite(g: Graph, bns: list[Node], count: int) -> tuple[list[Node], list[str]]:
    """The synchronised copies of one batchnorm's per-device copies (node-major order,
    each collective's members side by side); `count` values per channel in all."""
    first = bns[0]
    shape = first.type.shape
    c = shape[1]
    bshape = (1, c) + (1,) * (len(shape) - 2)
    affine = first.attrs["affine"]
    eps, momentum = first.attrs["eps"], first.attrs["momentum"]
    made: list[Node] = []
    devices = [n.device for n in bns]

    def each(tag: str, op: str, inputs_of, attrs=None, final=False) -> list[str]:
        names = []
        for n, ins in zip(bns, inputs_of, strict=True):
            name = n.name if final else g.fresh_name(f"{n.name}.{tag}")
            m = make_node(g, name, op, ins, attrs, like=n,
                          meta={**n.meta, "sync_bn": n.name})
            if not final:
                g.add(m)
            made.append(m)
            names.append(name)
        return names

    def all_reduce(tag: str, xs: list[str]) -> list[str]:
        names = [g.fresh_name(f"{n.name}.{tag}") for n in bns]
        for k, (n, name) in enumerate(zip(bns, names, strict=True)):
            m = make_node(g, name, "all_reduce", xs, {"group": tuple(devices), "index": k},
                          like=n, meta={**n.meta, "members": tuple(names), "sync_bn": n.name})
            g.add(m)
            made.append(m)
        return names

    xs = [n.inputs[0] for n in bns]
    axes = {"axis": (0,) + tuple(range(2, len(shape))), "keepdims": True}
    s = each("sum", "sum", [[x] for x in xs], axes)
    mean = each("mean", "scale", [[v] for v in all_reduce("sum_all", s)], {"factor": 1 / count})
    q = each("sq", "centered_sq_sum", [[x, m] for x, m in zip(xs, mean, strict=True)])
    var = each("var", "scale", [[v] for v in all_reduce("sq_all", q)], {"factor": 1 / count})
    dtype = first.type.dtype
    eps_c = each("eps", "fill", [[] for _ in bns], {"shape": (), "value": eps, "dtype": dtype})
    one = each("one", "fill", [[] for _ in bns], {"shape": (), "value": 1.0, "dtype": dtype})
    sd = each("std", "sqrt", [[v] for v in each("ve", "add", [[v, e] for v, e in
                                                              zip(var, eps_c, strict=True)])])
    k = each("inv", "div", [[o, v] for o, v in zip(one, sd, strict=True)])
    if affine:
        w4 = each("weight4", "reshape", [[n.inputs[1]] for n in bns], {"shape": bshape})
        k = each("scale", "mul", [[v, w] for v, w in zip(k, w4, strict=True)])
    if affine:
        b4 = each("bias4", "reshape", [[n.inputs[2]] for n in bns], {"shape": bshape})
        each("", "centered_affine", [[x, m, s_, b] for x, m, s_, b in
                                     zip(xs, mean, k, b4, strict=True)], final=True)
    else:
        each("", "centered_affine", [[x, m, s_] for x, m, s_ in zip(xs, mean, k, strict=True)],
             final=True)
    flat = {"shape": (c,)}
    running = [n.inputs[-2:] for n in bns]
    ups = each("running_update", "bn_running_update",
               [[rm, rv, m, v] for (rm, rv), m, v in zip(
                   running, each("mean_c", "reshape", [[m] for m in mean], flat),
                   each("var_c", "reshape", [[v] for v in var], flat), strict=True)],
               {"momentum": momentum, "count": count})
    return made, ups
