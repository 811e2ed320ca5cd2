"""Gradient synchronisation: after autodiff, the copies of a replicated parameter (one
per device) each hold the gradient of the whole loss with respect to their copy, i.e. of
their device's share of the loss (the combined loss weights each part by its rows); their
sum is the parameter's gradient. `sync_gradients` sums them with an `all_reduce` over the
devices holding copies, placed right after the last copy's gradient is made, so on a real
interconnect the reduction of the last layers' gradients overlaps the backward pass of
the first layers (PyTorch DDP and Horovod reduce in the same order). Each device's
optimizer update then reads the summed gradient, so the copies stay identical.
"""
from __future__ import annotations

from netdsl.ir.graph import Graph, Node
from netdsl.ir.placement import canonical
from netdsl.ir.rewrite import make_node, splice
from netdsl.passes.pipeline import register_pass


@register_pass("sync_gradients")
def sync_gradients(g: Graph) -> Graph:
    """All-reduce the gradients of parameters replicated over several devices."""
    params = [n for n in g.nodes if n.op == "param"]
    grads = list(g.outputs["grads"])
    groups: dict[str, list[int]] = {}
    for k, p in enumerate(params):
        if "shard" not in p.meta:  # a shard's gradient is whole on its device
            groups.setdefault(canonical(p.name), []).append(k)
    pos = {n.name: i for i, n in enumerate(g.nodes)}
    after: dict[str, list[Node]] = {}
    grad_of = dict(g.meta.get("grad_of", {}))
    for key, idx in groups.items():
        devices = [params[k].device for k in idx]
        if len(idx) < 2 or len(set(devices)) < 2:
            continue
        ins = [grads[k] for k in idx]
        anchor = max(ins, key=lambda x: pos[x])
        names = [g.fresh_name(f"{key}.grad.all_reduce@d{params[k].device}") for k in idx]
        members = []
        for j, (k, name) in enumerate(zip(idx, names, strict=True)):
            m = make_node(g, name, "all_reduce", ins, {"group": tuple(devices), "index": j},
                          like=g[ins[j]], device=params[k].device,
                          meta={"phase": "backward", "forward": params[k].name,
                                "members": tuple(names), "grad_sync": key})
            g.add(m)
            members.append(m)
            grad_of.pop(grads[k], None)
            grads[k] = name
            grad_of[name] = params[k].name
        after.setdefault(anchor, []).extend(members)
    g.nodes = [n for n in g.nodes if n.meta.get("grad_sync") is None]
    splice(g, after=after)
    g.outputs["grads"] = grads
    g.meta["grad_of"] = grad_of
    return g
