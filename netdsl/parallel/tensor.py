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
channels as devices that is not marked `@replicate`.

**Pairs** (Megatron-LM's column and row splits): where a chosen layer A feeds a chosen
layer B of the same kind through element-wise activations only (a transformer's
feed-forward `linear -> gelu -> linear`, a conv -> relu -> conv), A's output is not
gathered: the activations run on each device's channels, and B is split by *input*
channels (its weight's columns), so each device computes a partial B(x) over its
channels and one `all_reduce` sums them (B's bias added once, on device 0). A pair then
needs one collective forward (the all-reduce) and one backward (the all-reduce of the
output gradient), against two gathers and two reduce-scatters unpaired.
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
            and n.attrs[SPLITTABLE[n.op][0]] >= ways and n.attrs.get("groups", 1) == 1
            and not n.annotations.get("replicate")]


PAIR_THROUGH = ("relu", "gelu", "silu", "tanh", "sigmoid", "leaky_relu", "elu", "relu6",
                "hardswish", "mish", "softplus", "selu")  # per-channel, parameter-free


def pairs(fwd: Graph, layers: list[str]) -> list[tuple[str, list[str], str]]:
    """(A, activations between, B) for every chosen layer A whose only reader chain is
    element-wise activations ending at chosen layer B's input (module docstring)."""
    chosen = set(layers)
    readers = fwd.consumers()
    out, used = [], set()
    for a in layers:
        chain, x = [], a
        while True:
            rs = readers.get(x, [])
            if len(rs) != 1 or any(x in v for v in fwd.outputs.values()):
                break
            r = fwd[rs[0]]
            if r.op in PAIR_THROUGH and r.inputs == (x,):
                chain.append(r.name)
                x = r.name
                continue
            if (r.name in chosen and r.op == fwd[a].op and r.inputs[0] == x
                    and x not in r.inputs[1:] and a not in used and r.name not in used
                    and r.attrs.get("groups", 1) == 1):
                out.append((a, chain, r.name))
                used.update((a, r.name))
            break
    return out


def _shard_state(g: Graph, name: str, lo: int, hi: int, axis: int = 0) -> None:
    """Make state node `name` (a replica of a weight or bias) [lo, hi) of it along
    `axis` (rows: output channels; columns: input channels)."""
    n = g[name]
    full = tuple(n.type.shape)
    shape = full[:axis] + (hi - lo,) + full[axis + 1:]
    n.type = TensorType(shape, n.type.dtype)
    if "shape" in n.attrs:
        n.attrs["shape"] = shape
    n.meta["shard"] = (axis, lo, hi, full)


def split_layers(g: Graph, copies: dict[str, list[str]], fwd: Graph, ways: int,
                 replicas: int = 1, pair: bool = True) -> Graph:
    """Replace each chosen layer's copies (one per device) by shards and a gather (or,
    for a pair, an all-reduce). With `replicas` parts (data replicas, micro-batches),
    `copies` lists part r's `ways` copies at [r * ways, (r + 1) * ways), and each part is
    split alike. `pair` False: no pairs, every shard one of output channels (rows)."""
    layers = chosen_layers(fwd, ways)
    if not layers:
        raise SplitError(f"network `{fwd.name}` has no linear or conv2d layer with {ways} or "
                         "more output channels to split")
    # each layer's copies (side by side) are replaced where they stand by the shards and
    # then the gather's members, which take the copies' names: every reader of a copy
    # reads the whole output
    rewrite: dict[str, list[Node]] = {}
    paired = pairs(fwd, layers) if pair else []
    in_pairs = {x for a, _, b in paired for x in (a, b)}
    for r in range(replicas):
        mine = {o: names[r * ways:(r + 1) * ways] for o, names in copies.items()}
        for a, chain, b in paired:
            _split_pair(g, mine, fwd, a, chain, b, ways, rewrite)
        for orig in layers:
            if orig not in in_pairs:
                _split_layer(g, mine[orig], fwd[orig], ways, rewrite)
    g.nodes = [m for n in g.nodes for m in rewrite.get(n.name, [n])]
    g.meta.setdefault("tensor_layers", layers)
    g.meta.setdefault("tensor_pairs", [[a, b] for a, _, b in paired])
    return g


def _split_layer(g: Graph, names: list[str], layer: Node, ways: int,
                 rewrite: dict[str, list[Node]]) -> None:
    """One layer's copies `names` (one per device) as output-channel shards and the
    members of an all-gather, placed where the first copy stands."""
    orig = layer.name
    attr, axis = SPLITTABLE[layer.op]
    shards = []
    for name, (lo, hi) in zip(names, even_parts(layer.attrs[attr], ways), strict=True):
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


def _split_pair(g: Graph, copies: dict[str, list[str]], fwd: Graph, a: str,
                chain: list[str], b: str, ways: int, rewrite: dict[str, list[Node]]) -> None:
    """Column-split `a`, run `chain` on the shards, row-split `b` and all-reduce it
    (module docstring); the new nodes go where `a`'s first copy stands, the all-reduce's
    members (under `b`'s copies' names) where `b`'s first copy stands."""
    attr, axis = SPLITTABLE[fwd[a].op]
    parts = even_parts(fwd[a].attrs[attr], ways)
    placed: list[Node] = []
    last = []
    for t, (name, (lo, hi)) in enumerate(zip(copies[a], parts, strict=True)):
        n = g[name]
        for state in n.inputs[1:]:
            if "shard" not in g[state].meta:
                _shard_state(g, state, lo, hi)
        s = make_node(g, f"{name}.shard", n.op, n.inputs, {**n.attrs, attr: hi - lo},
                      like=n, meta={**n.meta, "tensor_shard": a})
        g.add(s)
        placed.append(s)
        x = s.name
        for c in chain:  # the activations, on this device's channels
            cn = g[copies[c][t]]
            m = make_node(g, f"{cn.name}.shard", cn.op, [x], cn.attrs, like=cn,
                          meta={**cn.meta, "tensor_shard": c})
            g.add(m)
            placed.append(m)
            x = m.name
        bn = g[copies[b][t]]
        w = bn.inputs[1]
        if "shard" not in g[w].meta:
            _shard_state(g, w, lo, hi, axis=1)  # the weight's input columns
        keep_bias = t == 0 and len(bn.inputs) > 2
        ins = [x, w] + ([bn.inputs[2]] if keep_bias else [])
        p = make_node(g, f"{bn.name}.partial", bn.op, ins,
                      {**bn.attrs, "bias": keep_bias}, like=bn,
                      meta={**bn.meta, "tensor_shard": b})
        g.add(p)
        last.append(p)
    dropped = {i for t, name in enumerate(copies[b]) if t > 0 for i in g[name].inputs[2:]}
    names = copies[b]
    devices = tuple(g[x].device for x in names)
    members = [make_node(g, name, "all_reduce", [p.name for p in last],
                         {"group": devices, "index": t}, like=g[name],
                         meta={**g[name].meta, "members": tuple(names)})
               for t, name in enumerate(names)]
    rewrite[copies[a][0]] = placed
    rewrite[names[0]] = last + members
    for x in copies[a][1:] + names[1:] + [n for c in chain for n in copies[c]] + \
            [n.name for n in placed + last] + sorted(dropped):
        rewrite.setdefault(x, [])
