"""The `fuse` pass: operator chains that one kernel runs in fewer passes over memory.

Today one pattern: `relu(batchnorm(x))` where the relu is the batchnorm's only reader and
the batchnorm's value is no graph output becomes `batchnorm_relu(x)` (see
netdsl.ir.ops.norm_fused). The fused node takes the relu's name (its readers and output
roles are unchanged) and the batchnorm's inputs, attributes, source location and scope;
the batchnorm node goes. It runs on a forward graph, before autodiff, which then uses the
fused op's gradient rule. A recompute replay (`replay` attribute) is left alone.

`NETDSL_FUSE=0` (or the pass's `enabled=False`) switches it off, to compare.
"""
from __future__ import annotations

import os

from netdsl.ir.graph import Graph
from netdsl.ir.rewrite import make_node
from netdsl.passes.pipeline import register_pass

FUSE_ENV = "NETDSL_FUSE"


def fusion_enabled() -> bool:
    return os.environ.get(FUSE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@register_pass("fuse")
def fuse(g: Graph, enabled: bool | None = None) -> Graph:
    """relu(batchnorm(x)) -> batchnorm_relu(x) where the relu is the only reader."""
    if not (fusion_enabled() if enabled is None else enabled):
        return g
    readers = g.consumers()
    outputs = {x for names in g.outputs.values() for x in names}
    pairs = {}  # relu name -> batchnorm node
    for n in g.nodes:
        if n.op != "relu" or n.device is not None:
            continue
        bn = g[n.inputs[0]]
        if (bn.op == "batchnorm" and not bn.attrs.get("replay") and bn.device is None
                and readers[bn.name] == [n.name] and bn.name not in outputs):
            pairs[n.name] = bn
    if not pairs:
        return g
    g = g.copy()
    dropped = {bn.name for bn in pairs.values()}
    nodes = []
    for n in g.nodes:
        if n.name in dropped:
            continue
        bn = pairs.get(n.name)
        if bn is not None:
            f = make_node(g, n.name, "batchnorm_relu", bn.inputs, bn.attrs, like=bn,
                          meta={**bn.meta, "fused": (bn.name, n.name)})
            f.annotations = {**bn.annotations, **n.annotations}
            n = f
        nodes.append(n)
    g.nodes = nodes
    return g
