"""Sharded data parallelism (ZeRO, Rajbhandari et al. 2020; DeepSpeed's stages 1 and 2):
the data replicas share the optimizer step out instead of each doing all of it.

Two rewrites of the data split's training graph, around the optimizer pass (in place of
`gradsync.sync_gradients`'s all-reduce):

- `shard_gradients` (after autodiff): the replicated parameters' gradients are taken in
  the buckets of `gradsync.plan_buckets` (flattened and joined in the order backward
  makes them), and each bucket is *reduce-scattered*: replica j keeps the sum of range j
  of the bucket (`even_parts` of its length over the replicas). Replica j's share of the
  optimizer step is the parameters' elements in that range: per parameter the piece of
  it there (`flat_piece`, a copy of the parameter's elements [a, b)) and its gradient's
  piece (a slice of the reduced range). The optimizer pass then updates those pieces
  (`meta["update_targets"]`), so its state is made for them: state pieces of axis
  `placement.FLAT`, 1/N of the state on each replica. Stage 1 reduces every bucket after
  the whole backward pass (the full gradients held until then, as DeepSpeed's stage 1
  does); stage 2 reduces each bucket as soon as its last gradient is made, and the full
  gradients die there (the memory plan sees it: only the reduced ranges live on).
- `gather_parameters` (after the optimizer): each replica joins its updated pieces of a
  bucket (its range: `pack_flat`), an *all-gather* gives every replica the whole updated
  bucket, and one `assign_flat` writes each parameter of it back in place.

In a split of three dimensions a parameter's copies are those of the replicas of its
stage (and, for a tensor shard, its tensor rank), and the buckets group parameters held by
the same devices, so each bucket is reduce-scattered over the devices that hold it.

The step computes the unsharded step's numbers: every element is updated once, by the
same rule, from the same summed gradient. A reduce-scatter and an all-gather of a bucket
move what its all-reduce did (the ring's all-reduce is exactly the two), so the bytes
sent equal plain data parallelism's. Checkpoints stay in the single-device layout: the
state pieces are joined by range (`runtime.state_parts`), and loaded by range.
"""
from __future__ import annotations

from netdsl.errors import SplitError
from netdsl.ir import registry
from netdsl.ir.graph import Graph, Node
from netdsl.ir.placement import canonical, copy_name, even_parts, flat_piece_shard
from netdsl.ir.rewrite import make_node, splice
from netdsl.parallel.gradsync import BUCKET_BYTES, adder, flatten_bucket, plan_buckets
from netdsl.passes.optimizer import group_updates
from netdsl.passes.registry import register_pass

STAGES = (1, 2)  # optimizer state sharded; and gradients


@register_pass("shard_gradients")
def shard_gradients(g: Graph, stage: int = 1, bucket_bytes: int = BUCKET_BYTES) -> Graph:
    """Reduce-scatter the replicated parameters' gradients in buckets and name each
    replica's pieces for the optimizer (module docstring)."""
    if stage not in STAGES:
        raise SplitError(f"shard must be one of {', '.join(map(str, STAGES))}, not {stage}")
    params, grads, pos, buckets = plan_buckets(g, bucket_bytes)
    if not buckets:
        raise SplitError("nothing to shard: no parameter is replicated over data replicas")
    grad_of = dict(g.meta.get("grad_of", {}))
    targets = [p.name for p in params]
    end = g.nodes[max(pos[grads[k]] for bucket in buckets for _, _, idx, _ in bucket
                      for k in idx)].name  # the end of the backward pass
    after: dict[str, list[Node]] = {}
    pieces: list[Node] = []
    layout = []
    for b, bucket in enumerate(buckets):
        last = max((grads[k] for _, _, idx, _ in bucket for k in idx), key=lambda x: pos[x])
        anchor = last if stage >= 2 else end
        made: list[Node] = []
        add = adder(g, made, {"phase": "backward", "grad_sync": f"bucket{b}"})
        shards = _reduce_scatter(g, b, bucket, flatten_bucket(g, b, bucket, grads, add), made)
        layout.append(_pieces(g, b, bucket, params, shards, grads, targets, grad_of, made,
                              pieces))
        after.setdefault(anchor, []).extend(made)
    late = {n.name for n in pieces}
    g.nodes = [n for n in g.nodes if n.meta.get("grad_sync") is None and n.name not in late]
    splice(g, after=after)
    g.nodes = g.nodes + pieces  # taken just before the optimizer's step: alive only during it
    # a replica's gradients and parameters outside its ranges are another's to update
    kept = [(x, t) for x, t in zip(grads, targets, strict=True) if x is not None]
    g.outputs["grads"] = [x for x, _ in kept]
    g.meta["grad_of"] = grad_of
    g.meta["update_targets"] = [t for _, t in kept]
    g.meta["zero"] = {"stage": stage, "buckets": layout}
    return g


def _reduce_scatter(g: Graph, b: int, bucket, joined: list[str], made: list[Node]) -> list[str]:
    """The bucket's reduce-scatter members (side by side): member j keeps range j."""
    devices = bucket[0][3]
    length = g[joined[0]].type.shape[0]
    sizes = tuple(hi - lo for lo, hi in even_parts(length, len(devices)))
    names = [g.fresh_name(f"grad_bucket{b}.reduce_scatter@d{dev}") for dev in devices]
    for j, (dev, name) in enumerate(zip(devices, names, strict=True)):
        m = make_node(g, name, "reduce_scatter", joined,
                      {"group": devices, "index": j, "axis": 0, "sizes": sizes},
                      like=g[joined[j]], device=dev,
                      meta={"phase": "backward", "members": tuple(names),
                            "grad_sync": f"bucket{b}"})
        g.add(m)
        made.append(m)
    return names


def _pieces(g: Graph, b: int, bucket, params, shards: list[str], grads: list[str],
            targets: list[str], grad_of: dict, made: list[Node], pieces: list[Node]) -> dict:
    """Per replica j, the pieces of the bucket's parameters in its range: the gradient's
    (a slice of its reduced range, made with the reduction) and the parameter's (a
    `flat_piece`, made just before the optimizer: `pieces`). `grads` and `targets` take
    the pieces in place of the parameter replicas' whole gradients; returns the layout
    `gather_parameters` reads."""
    devices = bucket[0][3]
    sizes = [params[idx[0]].type.numel() for _, _, idx, _ in bucket]
    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    ranges = even_parts(sum(sizes), len(devices))
    by_device = []
    for j, dev in enumerate(devices):
        lo, hi = ranges[j]
        mine = []
        for (_, _, idx, _), off, n in zip(bucket, offsets, sizes, strict=True):
            a, z = max(lo, off) - off, min(hi, off + n) - off
            k = idx[j]
            p = params[k]
            if a >= z:  # (not in this replica's range: its update is another's)
                grads[k] = targets[k] = None
                continue
            piece = make_node(g, g.fresh_name(copy_name(canonical(p.name), dev, strip=j)),
                              "flat_piece", [p.name], {"start": a, "stop": z}, like=p,
                              device=dev, meta={"phase": "optimizer",
                                                "shard": flat_piece_shard(p, a, z)})
            pieces.append(g.add(piece))
            part = shards[j]
            if z - a != hi - lo:
                start = off + a - lo
                part = make_node(g, g.fresh_name(f"{canonical(p.name)}.grad.piece@d{dev}"),
                                 "slice", [shards[j]],
                                 {"axis": 0, "start": start, "stop": start + z - a, "step": 1},
                                 like=g[shards[j]], device=dev,
                                 meta={"phase": "backward", "grad_sync": f"bucket{b}"})
                g.add(part)
                made.append(part)
                part = part.name
            grad_of.pop(grads[k], None)
            grads[k], targets[k] = part, piece.name
            grad_of[part] = piece.name
            mine.append(piece.name)
        by_device.append(mine)
    return {"devices": list(devices), "offsets": offsets,
            "params": [[params[idx[j]].name for _, _, idx, _ in bucket]
                       for j in range(len(devices))],
            "pieces": by_device}


@register_pass("gather_parameters")
def gather_parameters(g: Graph) -> Graph:
    """After the optimizer: every replica's updated pieces of a bucket joined, all-gathered,
    and written back into each parameter replica (module docstring). The pieces' updates
    are grouped first (`group_updates`: one node a replica and kind, as a step that runs
    has them), which the joins name as the writers they follow."""
    g = group_updates(g)
    writer = {}
    for u in g.outputs["updates"]:
        n = g[u]
        for i in registry.get(n.op).written_inputs(n):
            writer[n.inputs[i]] = u
    written = []
    for b, bucket in enumerate(g.meta["zero"]["buckets"]):
        devices = tuple(bucket["devices"])
        joined = []
        for j, dev in enumerate(devices):
            pieces = bucket["pieces"][j]
            after = list(dict.fromkeys(writer[x] for x in pieces))
            joined.append(_add(g, f"param_bucket{b}@d{dev}", "pack_flat", pieces + after,
                               {"count": len(pieces)}, g[pieces[0]], dev))
        names = [g.fresh_name(f"param_bucket{b}.all_gather@d{dev}") for dev in devices]
        for j, (dev, name) in enumerate(zip(devices, names, strict=True)):
            g.add(make_node(g, name, "all_gather", joined,
                            {"group": devices, "index": j, "axis": 0}, like=g[joined[j]],
                            device=dev, meta={"phase": "optimizer", "members": tuple(names)}))
        for j, dev in enumerate(devices):
            params = bucket["params"][j]
            written.append(_add(g, f"param_bucket{b}.written@d{dev}", "assign_flat",
                                [*params, names[j]], {"starts": tuple(bucket["offsets"])},
                                g[params[0]], dev))
    g.outputs["updates"] = list(g.outputs["updates"]) + written
    return g


def _add(g: Graph, name: str, op: str, ins: list[str], attrs: dict, like: Node,
         device: int) -> str:
    n = make_node(g, g.fresh_name(name), op, ins, attrs, like=like, device=device,
                  meta={"phase": "optimizer"})
    return g.add(n).name
