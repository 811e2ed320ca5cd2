"""Tensor (model) parallelism: a linear or conv2d layer split by output channels.

Every device holds a copy of the network (the whole batch) and, of each split layer, the
weight and bias rows of its share of the output channels. It computes its share, and an
`all_gather` along the channel axis gives every device the whole output, so the layers
after it run unchanged. Autodiff turns the gather into a `reduce_scatter` of the output
gradient: each device gets exactly the gradient of its channels, so a shard's gradient is
complete on its device; the layers not split are replicated, and their gradients, which
the devices compute in parts, are summed by `gradsync` as in data parallelism. Only
device 0's copy of the loss counts (the others compute the same value), so the step is
the single-device step.

Which layers: those annotated `@shard(channels, k)` or `@shard(features, k)` (k must be
the device count), else every linear and ungrouped conv2d with at least as many output
channels as devices.
"""
from __future__ import annotations

from netdsl.errors import SplitError
from netdsl.ir.graph import Graph, Node
from netdsl.ir.placement import ShardSpec, even_parts
from netdsl.ir.rewrite import make_node
from netdsl.ir.types import TensorType

SPLITTABLE = {"linear": ("out_features", -1), "conv2d": ("out_channels", 1)}


def chosen_layers(fwd: Graph, ways: int) -> list[str]:
    """The forward nodes to split (module docstring)."""
    marked = [n for n in fwd.nodes if ShardSpec.of(n) is not None]
    for n in marked:
        dim, k = ShardSpec.of(n).dim, ShardSpec.of(n).ways
        where = f" ({n.loc})" if n.loc else ""
        if n.op not in SPLITTABLE or dim not in ("channels", "features"):
            raise SplitError(f"@shard({dim}, {k}) on %{n.name}{where}: only linear and conv2d "
                             "split, by output channels (channels or features)")
        if k != ways:
            raise SplitError(f"@shard({dim}, {k}) on %{n.name}{where} asks for {k} ways, but "
                             f"the split has {ways} devices")
    if marked:
        return [n.name for n in marked]
    return [n.name for n in fwd.nodes if n.op in SPLITTABLE
            and n.attrs[SPLITTABLE[n.op][0]] >= ways and n.attrs.get("groups", 1) == 1]


def _shard_state(g: Graph, name: str, lo: int, hi: int) -> None:
    """Make state node `name` (a replica of a weight or bias) rows [lo, hi) of it."""
    n = g[name]
    full = tuple(n.type.shape)
    shape = (hi - lo,) + full[1:]
    n.type = TensorType(shape, n.type.dtype)
    if "shape" in n.attrs:
        n.attrs["shape"] = shape
    n.meta["shard"] = (0, lo, hi, full)


def split_layers(g: Graph, copies: dict[str, list[str]], fwd: Graph, ways: int) -> Graph:
    """Replace each chosen layer's copies (one per device) by shards and a gather."""
    layers = chosen_layers(fwd, ways)
    if not layers:
        raise SplitError(f"network `{fwd.name}` has no linear or conv2d layer with {ways} or "
                         "more output channels to split")
    # each layer's copies (side by side) are replaced where they stand by the shards and
    # then the gather's members, which take the copies' names: every reader of a copy
    # reads the whole output
    rewrite: dict[str, list[Node]] = {}
    for orig in layers:
        names = copies[orig]
        attr, axis = SPLITTABLE[fwd[orig].op]
        shards = []
        for name, (lo, hi) in zip(names, even_parts(fwd[orig].attrs[attr], ways), strict=True):
            n = g[name]
            for state in n.inputs[1:]:  # weight, bias: this device's rows
                if "shard" not in g[state].meta:
                    _shard_state(g, state, lo, hi)
            s = make_node(g, f"{name}.shard", n.op, n.inputs, {**n.attrs, attr: hi - lo},
                          like=n, meta={**n.meta, "tensor_shard": orig})
            g.add(s)  # `make_node` reads its inputs' types from the graph
            shards.append(s)
        devices = tuple(g[x].device for x in names)
        members = [make_node(g, name, "all_gather", [s.name for s in shards],
                             {"group": devices, "index": t, "axis": axis}, like=g[name],
                             meta={**g[name].meta, "members": tuple(names)})
                   for t, name in enumerate(names)]
        rewrite[names[0]] = shards + members
        rewrite.update({name: [] for name in names[1:]})
        rewrite.update({s.name: [] for s in shards})  # placed with the first copy
    g.nodes = [m for n in g.nodes for m in rewrite.get(n.name, [n])]
    g.meta.setdefault("tensor_layers", layers)
    return g
