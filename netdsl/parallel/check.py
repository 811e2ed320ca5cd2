"""The structural check after a split (a split that drops or doubles a layer, or leaves a
gradient without its update, is the silent wrong result users of pipeline frameworks
report; this catches it before anything runs):

- every compute node of the single-device forward graph is computed exactly once per
  part (replica x micro-batch, and per device of a tensor split, where every device runs
  the whole network) - a synchronised batchnorm's ops count as its batchnorm, a split
  layer's shards as the layer;
- every parameter copy's gradient reaches its update;
- every device is one of the split's (numbered replica x stage x tensor rank);
- no node reads a value held on another device except through a communication op;
- a collective's members sit side by side in the node order (every rank then enters its
  collectives in one order, which is what keeps MPI runs from deadlocking).
"""
from __future__ import annotations

from collections import Counter

from netdsl.errors import NetdslError
from netdsl.ir.graph import Graph
from netdsl.ir.ops.comm import COMM_OPS


class SplitCheckError(NetdslError):
    """A split graph breaks a structural rule: a bug in a split pass, named by node."""


def check(g: Graph, fwd: Graph) -> None:
    parts = _parts(g)
    counts: Counter = Counter()
    for n in g.nodes:
        if n.meta.get("phase") in ("backward", "optimizer") or n.meta.get("combined"):
            continue
        if n.is_source or n.op in COMM_OPS or "origin" not in n.meta:
            continue
        if n.meta.get("sync_bn") and n.name != n.meta["sync_bn"]:
            continue  # the parts of a synchronised batchnorm; its final op counts
        counts[n.meta["origin"]] += 1
    strips = set(g.meta.get("spatial_layers", ()))
    for n in fwd.nodes:
        if n.is_source or n.op == "dropout":
            continue
        want = parts * g.meta["split"].get("spatial", 1) if n.name in strips else parts
        if counts[n.name] != want:
            raise SplitCheckError(
                f"split check: forward node %{n.name} ({n.op}) is computed "
                f"{counts[n.name]} times, once per part ({want}) was expected",
                loc=n.loc, stack=n.stack)
    devices = g.meta["split"].get("devices", 1)
    stray = sorted({n.device for n in g.nodes if n.device is not None} - set(range(devices)))
    if stray:  # a layout bug: Megatron's order numbers every device below their count
        raise SplitCheckError(f"split check: device(s) {stray} lie outside the split's "
                              f"{devices} (replica x stage x tensor rank: "
                              "placement.position_of)")
    update_names = set(g.outputs.get("updates", []))
    read_by_update = {i for n in g.nodes if n.name in update_names for i in n.inputs}
    # a clipped gradient reaches its update through its scaled copy (passes.optimizer)
    read_by_update |= {g[i].meta["clip_of"] for i in list(read_by_update)
                       if "clip_of" in g[i].meta}
    for gp in g.outputs.get("grads", []):
        if update_names and gp not in read_by_update:
            raise SplitCheckError(f"split check: gradient %{gp} reaches no update")
    for n in g.nodes:
        if n.op in ("send", "recv") or n.meta.get("members") or n.device is None:
            continue
        for i in n.inputs:
            src = g[i]
            if src.device is not None and src.device != n.device:
                raise SplitCheckError(
                    f"split check: %{n.name} on device {n.device} reads %{i} from device "
                    f"{src.device} without communication", loc=n.loc, stack=n.stack)


    pos = {n.name: k for k, n in enumerate(g.nodes)}
    for n in g.nodes:
        members = n.meta.get("members")  # (an update group's is a count)
        if isinstance(members, tuple) and n.name == members[0]:
            at = sorted(pos[m] for m in members)
            if at[-1] - at[0] != len(members) - 1:
                raise SplitCheckError(f"split check: the members of collective %{n.name} "
                                      "are not side by side in the node order")


def _parts(g: Graph) -> int:
    s = g.meta.get("split", {})
    return s.get("data", 1) * s.get("microbatches", 1) * s.get("tensor", 1)
