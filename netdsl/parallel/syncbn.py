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
all_reduce of them, and dx (sync_batchnorm's gradient rule). A micro-batch alone on its
device is rewritten so too (`alone`: its own moments, no collective), and a device's
micro-batches update its running statistics once, from their statistics combined
(`defer_running_stats`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from netdsl.errors import NetdslError
from netdsl.ir.graph import Graph, Node
from netdsl.ir.ops.norm import bn_inputs
from netdsl.ir.rewrite import make_node

NORMS = ("batchnorm", "batchnorm_relu")  # the ops with running statistics


def sync_batchnorms(g: Graph, copies: dict[str, list[str]], fwd: Graph, rows: int,
                    update: bool = True, alone: bool = False) -> dict[str, Synced]:
    """Rewrite every training-mode batchnorm whose copies sit on more than one device
    (with `alone`, every group, even one copy: a micro-batch normalised with its own
    statistics whose running update is deferred). The copies hold `rows` rows of the
    batch together (the whole batch, or one micro-batch of every replica), the
    statistics counting them over the single-device node's spatial size (a data split's
    copies hold all of it; a spatial split's hold strips). Without `update` the running
    statistics are left alone (defer_running_stats updates them). Returns what each
    rewritten copy normalised with."""
    origs = [orig for orig, names in copies.items() if fwd[orig].op in NORMS
             and (alone or len({g[x].device for x in names}) > 1)]
    groups = [copies[orig] for orig in origs]
    if not groups:
        return {}
    index = {x: k for k, names in enumerate(groups) for x in names}
    out: list[Node] = []
    updates: list[str] = []
    synced: dict[str, Synced] = {}
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
            new, ups = _rewrite(g, pending.pop(k), count, update, synced)
            out.extend(new)
            updates.extend(ups)
    g.nodes = out
    g.outputs["state_updates"] = g.outputs.get("state_updates", []) + updates
    return synced


@dataclass(frozen=True)
class Synced:
    """What a rewritten batchnorm copy normalised with: its statistics value (the mean
    and biased variance rows), the values a channel they count, its running mean and
    variance, and its momentum."""

    stats: str
    count: int
    running: tuple[str, str]
    momentum: float


def defer_running_stats(g: Graph, owners: list[list[str]], synced: dict[str, Synced]) -> None:
    """One running-statistics update a step for each list of copies in `owners` (a
    device's micro-batches of one batchnorm, in order) from their statistics combined:
    the mean and variance of every row they normalised, as the unsplit step's update
    (torchgpipe's DeferredBatchNorm), instead of one per micro-batch."""
    updates = []
    for names in owners:
        parts = [synced[x] for x in names if x in synced]
        if not parts:
            continue
        first = g[names[0]]
        stats = [p.stats for p in parts]
        if len(stats) > 1:
            joined = make_node(g, g.fresh_name(f"{first.name}.stats_parts"), "concat", stats,
                               {"axis": 0}, like=first, meta={"sync_bn": first.name})
            g.add(joined)
            whole = make_node(g, g.fresh_name(f"{first.name}.stats_whole"), "bn_combine",
                              [joined.name], {"counts": tuple(p.count for p in parts)},
                              like=first, meta={"sync_bn": first.name})
            g.add(whole)
            stats = [whole.name]
        up = make_node(g, g.fresh_name(f"{first.name}.running_update"), "bn_running_update",
                       [*parts[0].running, stats[0]],
                       {"momentum": parts[0].momentum, "count": sum(p.count for p in parts)},
                       like=first, meta={"sync_bn": first.name})
        g.add(up)
        updates.append(up.name)
    g.outputs["state_updates"] = g.outputs.get("state_updates", []) + updates


def _rewrite(g: Graph, bns: list[Node], count: int, update: bool,
             synced: dict[str, Synced]) -> tuple[list[Node], list[str]]:
    """The synchronised copies of one batchnorm's per-device copies (node-major order,
    each collective's members side by side; one copy alone normalises with its own
    moments); `count` values per channel in all; the running statistics' updates with
    `update`. Records each copy's statistics in `synced`."""
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
    stats = moments = each("moments", "bn_moments", [[p[0]] for p in parts])
    if len(bns) > 1:
        gathered = [g.fresh_name(f"{n.name}.moments_all") for n in bns]
        for k, (n, name) in enumerate(zip(bns, gathered, strict=True)):
            m = make_node(g, name, "all_gather", moments,
                          {"group": devices, "index": k, "axis": 0}, like=n,
                          meta={**n.meta, "members": tuple(gathered), "sync_bn": n.name})
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
    momentum = first.attrs["momentum"]
    for n, p, st in zip(bns, parts, stats, strict=True):
        synced[n.name] = Synced(st, count, (p[3], p[4]), momentum)
    if not update:
        return made, []
    ups = each("running_update", "bn_running_update",
               [[p[3], p[4], s] for p, s in zip(parts, stats, strict=True)],
               {"momentum": momentum, "count": count})
    return made, ups
