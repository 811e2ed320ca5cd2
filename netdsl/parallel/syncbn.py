"""Synchronised batchnorm: a batchnorm whose copies on several devices normalise with the
statistics of the whole batch, so a data-parallel step equals the single-device step.

Each copy's `batchnorm(x, w, b, running_mean, running_var)` (or `batchnorm_relu`)
becomes its local moments, one `all_gather` of them, their combination and one
normalising pass (the operators are netdsl/ir/ops/norm_sync.py's):

    m = bn_moments(x)                               this copy's mean and variance
    s = bn_combine(all_gather(m), counts)           the whole batch's
    y = sync_batchnorm(x, s, w, b)                  (x - mean) * w / sqrt(var + eps) + b

plus a `bn_running_update` of the running statistics (in `outputs["state_updates"]`).
Autodiff then writes PyTorch's SyncBatchNorm backward: each copy's two sums, one
all_reduce of them, and dx (sync_batchnorm's gradient rule).
"""
from __future__ import annotations

import math

from netdsl.errors import NetdslError
from netdsl.ir.graph import Graph, Node
from netdsl.ir.ops.norm import bn_inputs
from netdsl.ir.rewrite import make_node

NORMS = ("batchnorm", "batchnorm_relu")  # the ops with running statistics


def sync_batchnorms(g: Graph, copies: dict[str, list[str]], fwd: Graph, rows: int,
                    update: bool = True) -> Graph:
    """Rewrite every training-mode batchnorm whose copies sit on more than one device.
    The copies hold `rows` rows of the batch together (the whole batch, or one
    micro-batch of every replica), the statistics counting them over the single-device
    node's spatial size (a data split's copies hold all of it; a spatial split's hold
    strips). Without `update` the running statistics are left alone (micro-batches after
    the first, as on one device)."""
    origs = [orig for orig, names in copies.items() if fwd[orig].op in NORMS
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
            count = rows * math.prod(fwd[origs[k]].type.shape[2:])
            new, ups = _rewrite(g, pending.pop(k), count, update)
            out.extend(new)
            updates.extend(ups)
    g.nodes = out
    g.outputs["state_updates"] = g.outputs.get("state_updates", []) + updates
    return g


def _rewrite(g: Graph, bns: list[Node], count: int,
             update: bool) -> tuple[list[Node], list[str]]:
    """The synchronised copies of one batchnorm's per-device copies (node-major order,
    each collective's members side by side); `count` values per channel in all; the
    running statistics' updates with `update`."""
    first = bns[0]
    c = first.type.shape[1]
    counts = tuple(math.prod(g[n.inputs[0]].type.shape) // c for n in bns)
    if sum(counts) != count:
        raise NetdslError(f"synchronised batchnorm %{first.name}: its copies hold "
                          f"{sum(counts)} values a channel, the batch {count}")
    made: list[Node] = []
    devices = tuple(n.device for n in bns)
    names = tuple(n.name for n in bns)

    def each(tag: str, op: str, inputs_of, attrs=None, final=False, meta=None) -> list[str]:
        out = []
        for n, ins in zip(bns, inputs_of, strict=True):
            name = n.name if final else g.fresh_name(f"{n.name}.{tag}")
            m = make_node(g, name, op, ins, attrs, like=n,
                          meta={**n.meta, "sync_bn": n.name, **(meta or {})})
            if not final:
                g.add(m)
            made.append(m)
            out.append(name)
        return out

    parts = [bn_inputs(n.inputs, n.attrs) for n in bns]  # x, w, b, running mean, var
    moments = each("moments", "bn_moments", [[p[0]] for p in parts])
    gathered = [g.fresh_name(f"{n.name}.moments_all") for n in bns]
    for k, (n, name) in enumerate(zip(bns, gathered, strict=True)):
        m = make_node(g, name, "all_gather", moments, {"group": devices, "index": k, "axis": 0},
                      like=n, meta={**n.meta, "members": tuple(gathered), "sync_bn": n.name})
        g.add(m)
        made.append(m)
    stats = each("stats", "bn_combine", [[v] for v in gathered], {"counts": counts})
    attrs = {"eps": first.attrs["eps"], "relu": first.op == "batchnorm_relu"}
    if first.attrs.get("cap") is not None:
        attrs["cap"] = first.attrs["cap"]
    affine = [[w, b] if w is not None else [] for _x, w, b, _rm, _rv in parts]
    each("", "sync_batchnorm", [[p[0], s, *a] for p, s, a in zip(parts, stats, affine,
                                                                  strict=True)],
         attrs, final=True, meta={"sync_group": names, "sync_count": count})
    if not update:
        return made, []
    ups = each("running_update", "bn_running_update",
               [[p[3], p[4], s] for p, s in zip(parts, stats, strict=True)],
               {"momentum": first.attrs["momentum"], "count": count})
    return made, ups
