"""ZeRO stage 3 (PyTorch FSDP's full shard): the data replicas' parameters sharded too.

Two rewrites of the data split's step:

- `shard_parameters` (on the split forward graph, before autodiff): the parameters are
  taken a *unit* at a time (a layer: the parameters its forward node reads, in the order
  the forward pass reads them; or, where the file says `@shard_unit`, every parameter
  made in one evaluation of the annotated statement or block: a block instance). Replica
  j keeps range j of each unit's parameters flattened and joined (`even_parts` of its
  length): a piece of each parameter there, a `param` node of its own (`meta["shard"]`,
  axis `placement.FLAT`). Just before a unit's layer runs (one unit ahead: the gather of
  unit u + 1 is issued before unit u's layer, FSDP's forward prefetch) every replica
  joins its pieces, an all-gather makes the whole unit, and each parameter is cut out of
  it in its shape; the layers read those. Autodiff then turns the all-gather into a
  reduce-scatter of the unit's gradients (its transpose), so each replica gets the
  summed gradient of its pieces right after the unit's backward, and the optimizer
  updates the pieces: state 1/N, no all-gather after.
- `gather_for_backward` (after autodiff): the backward pass does not read the forward's
  gathered parameters (which would keep every unit whole through the step); each unit is
  gathered again before its backward (one unit ahead, as FSDP's backward prefetch), so a
  unit's whole parameters live from its gather to its layer's last use.

The step is still the single-device step's (the gate), and each replica sends 3 (N - 1)
/ N of the parameters' bytes: two all-gathers and a reduce-scatter, 1.5 times plain data
parallelism's all-reduce.
"""
from __future__ import annotations

import re

from netdsl.errors import SplitError
from netdsl.ir.graph import Graph, Node
from netdsl.ir.placement import copy_name, even_parts, flat_piece_shard, replica_key
from netdsl.ir.rewrite import make_node, splice
from netdsl.ir.types import TensorType
from netdsl.passes.registry import register_pass

_SHARD_KEY = re.compile(r"\.shard\d+_\d+$")  # `replica_key`'s range of a shard


def shard_parameters(g: Graph) -> Graph:
    """The forward rewrite (module docstring); `g` is a data split's forward graph."""
    pos = {n.name: k for k, n in enumerate(g.nodes)}
    readers: dict[str, list[str]] = {}
    for n in g.nodes:
        for i in n.inputs:
            readers.setdefault(i, []).append(n.name)
    replicas: dict[str, list[Node]] = {}
    for n in g.nodes:
        if n.op == "param":
            replicas.setdefault(replica_key(n), []).append(n)
    units: dict[str, list[str]] = {}  # first reader (device 0's) -> replica keys
    first: dict[str, int] = {}
    for key, ps in replicas.items():
        if len({p.device for p in ps}) != len(ps) or len(ps) < 2:
            raise SplitError(f"shard=3 shards parameters over data replicas; "
                             f"%{ps[0].name} is not replicated")
        at = min(pos[r] for p in ps for r in readers.get(p.name, ()))
        unit = _unit(ps[0], g.nodes[min(pos[r] for r in readers.get(ps[0].name, ()))])
        units.setdefault(unit, []).append(key)
        first[unit] = min(first.get(unit, at), at)
    order = sorted(units, key=lambda u: first[u])
    before: dict[str, list[Node]] = {}
    layout = []
    for k, unit in enumerate(order):
        anchor = g.nodes[first[order[k - 1] if k else unit]].name  # one unit ahead
        params = [(key, replicas[key]) for key in units[unit]]
        made, whole = _gather(g, f"unit{k}", params, "forward", pieces=True)
        for p, w in whole.items():
            for r in readers.get(p, ()):
                g[r].inputs = tuple(w if i == p else i for i in g[r].inputs)
        before.setdefault(anchor, []).extend(made)
        layout.append({"params": units[unit], "devices": [p.device for p in params[0][1]],
                       "whole": [[whole[p.name] for p in ps] for _, ps in params]})
    drop = {p.name for ps in replicas.values() for p in ps}
    drop |= {n.name for ns in before.values() for n in ns}
    g.nodes = [n for n in g.nodes if n.name not in drop]
    pieces = [n for ns in before.values() for n in ns if n.op == "param"]
    splice(g, before={a: [n for n in ns if n.op != "param"] for a, ns in before.items()})
    g.nodes = pieces + g.nodes  # (sources first, as every graph has them)
    g.meta["zero"] = {"stage": 3, "buckets": layout}
    return g


def _unit(param: Node, reader: Node) -> str:
    """The unit a parameter belongs to: its `@shard_unit` instance, else its first
    reader's layer."""
    k = param.annotations.get("shard_unit")
    return reader.name if k is None else f"@shard_unit({k})"


@register_pass("gather_for_backward")
def gather_for_backward(g: Graph) -> Graph:
    """After autodiff: each unit gathered again for the backward nodes that read its
    parameters, one unit ahead of its first such node (module docstring)."""
    pos = {n.name: k for k, n in enumerate(g.nodes)}
    readers: dict[str, list[str]] = {}
    for n in g.nodes:
        if n.meta.get("phase") == "backward":
            for i in n.inputs:
                readers.setdefault(i, []).append(n.name)
    layout = g.meta["zero"]["buckets"]
    need = []
    for k, unit in enumerate(layout):
        wholes = [w for per in unit["whole"] for w in per]
        late = [pos[r] for w in wholes for r in readers.get(w, ())]
        if late:
            need.append((min(late), k))
    need.sort()
    before: dict[str, list[Node]] = {}
    for i, (at, k) in enumerate(need):
        unit = layout[k]
        anchor = g.nodes[need[i - 1][0] if i else at].name  # one unit ahead
        params = [(key, [g[w] for w in per]) for key, per in zip(unit["params"],
                                                                  unit["whole"], strict=True)]
        made, whole = _gather(g, f"unit{k}.backward", params, "backward", pieces=False)
        for per in unit["whole"]:
            for w in per:
                for r in readers.get(w, ()):
                    g[r].inputs = tuple(whole[w] if x == w else x for x in g[r].inputs)
        before.setdefault(anchor, []).extend(made)
    drop = {n.name for ns in before.values() for n in ns}
    g.nodes = [n for n in g.nodes if n.name not in drop]
    return splice(g, before=before)


def _gather(g: Graph, unit: str, params: list[tuple[str, list[Node]]], phase: str,
            pieces: bool) -> tuple[list[Node], dict[str, str]]:
    """One unit's gather: per replica its pieces joined (made here as `param` nodes from
    the replicas where `pieces`, else the existing ones, by name), the all-gather, each
    parameter cut out in its shape. `params`: (single-device name, a node per replica
    with the parameter's type and device). Returns the nodes in order and {the
    replica's node: its whole parameter}."""
    devices = tuple(p.device for p in params[0][1])
    sizes = [ps[0].type.numel() for _, ps in params]
    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    ranges = even_parts(sum(sizes), len(devices))
    made: list[Node] = []
    meta = {"phase": phase} if phase != "forward" else {}

    def add(name, op, ins, attrs, like, dev):
        n = make_node(g, g.fresh_name(name), op, ins, attrs, like=like, device=dev,
                      meta=dict(meta))
        made.append(g.add(n))
        return n.name
    joined = []
    for j, dev in enumerate(devices):
        lo, hi = ranges[j]
        mine = []
        for (key, ps), off, n in zip(params, offsets, sizes, strict=True):
            a, z = max(lo, off) - off, min(hi, off + n) - off
            if a < z:
                # named by the single-device entry (a tensor shard's key names its rows)
                name = copy_name(_SHARD_KEY.sub("", key), dev, strip=j)
                mine.append(_piece(g, ps[j], name, a, z, made) if pieces else name)
        joined.append(mine[0] if len(mine) == 1 else add(
            f"{unit}.pieces@d{dev}", "concat", mine, {"axis": 0}, g[mine[0]], dev))
    names = [g.fresh_name(f"{unit}.all_gather@d{dev}") for dev in devices]
    for j, (dev, name) in enumerate(zip(devices, names, strict=True)):
        made.append(g.add(make_node(g, name, "all_gather", joined,
                                    {"group": devices, "index": j, "axis": 0},
                                    like=g[joined[j]], device=dev,
                                    meta={**meta, "members": tuple(names)})))
    whole: dict[str, str] = {}
    for j, dev in enumerate(devices):
        for (key, ps), off, n in zip(params, offsets, sizes, strict=True):
            p = ps[j]
            part = names[j] if n == sum(sizes) else add(
                f"{key}.gathered@d{dev}", "slice", [names[j]],
                {"axis": 0, "start": off, "stop": off + n, "step": 1}, p, dev)
            whole[p.name] = add(f"{key}.whole@d{dev}", "reshape", [part],
                                {"shape": tuple(p.type.shape)}, p, dev)
    return made, whole


def _piece(g: Graph, p: Node, name: str, a: int, z: int, made: list[Node]) -> str:
    """Replica `p`'s piece [a, z) of its elements: a parameter of its own."""
    attrs = dict(p.attrs)
    if "shape" in attrs:
        attrs["shape"] = (z - a,)
    piece = p.copy(name=name, type=TensorType((z - a,), p.type.dtype), attrs=attrs,
                   meta={**p.meta, "shard": flat_piece_shard(p, a, z)})
    made.append(g.add(piece))
    return name
