"""Gradient synchronisation: after autodiff, the copies of a replicated parameter (one
per device) each hold the gradient of the whole loss with respect to their copy, i.e. of
their device's share of the loss (the combined loss weights each part by its rows); their
sum is the parameter's gradient. `sync_gradients` sums them with `all_reduce`s over the
devices holding copies, in buckets (PyTorch DDP's): the gradients are taken in the order
backward makes them, flattened and joined up to about 25 MB per device, and each bucket
is reduced right after its last gradient is made, so on a real interconnect the
reduction of the last layers' gradients overlaps the backward pass of the first layers.
Each device's optimizer update then reads the summed gradient, so the copies stay
identical.
"""
from __future__ import annotations

from netdsl.ir.graph import Graph, Node
from netdsl.ir.placement import replica_key
from netdsl.ir.rewrite import make_node, splice
from netdsl.passes.pipeline import register_pass

BUCKET_BYTES = 25 * 10**6  # PyTorch DDP's default bucket (bucket_cap_mb=25)


@register_pass("sync_gradients")
def sync_gradients(g: Graph, bucket_bytes: int = BUCKET_BYTES) -> Graph:
    """All-reduce the gradients of parameters replicated over several devices, in buckets
    of about `bucket_bytes` per device (gradients flattened and joined, so a network of
    thousands of small parameters makes a few hundred collectives, not thousands; 0: one
    collective per parameter), each right after its last gradient is made."""
    params, grads, pos, buckets = plan_buckets(g, bucket_bytes)
    after: dict[str, list[Node]] = {}
    grad_of = dict(g.meta.get("grad_of", {}))
    for b, bucket in enumerate(buckets):
        anchor = max((grads[k] for _, _, idx, _ in bucket for k in idx), key=lambda x: pos[x])
        new = _reduce_bucket(g, b, bucket, params, grads, grad_of)
        after.setdefault(anchor, []).extend(new)
    g.nodes = [n for n in g.nodes if n.meta.get("grad_sync") is None]
    splice(g, after=after)
    g.outputs["grads"] = grads
    g.meta["grad_of"] = grad_of
    return g


Bucket = list[tuple]  # (position of its last gradient, replica key, params' indices, devices)


def plan_buckets(g: Graph, bucket_bytes: int = BUCKET_BYTES):
    """(params, grads, positions, buckets): the parameters, their gradients (in the order
    of `outputs["grads"]`), every node's position, and the buckets of replicated
    parameters, each a list of (position of the last copy's gradient, replica key,
    indices of its copies, their devices), in the order backward completes them."""
    params = [n for n in g.nodes if n.op == "param"]
    grads = list(g.outputs["grads"])
    groups: dict[str, list[int]] = {}
    for k, p in enumerate(params):
        # a shard's gradient is whole over its replica's devices; the same shard in
        # several data-parallel replicas is summed like any replicated parameter
        groups.setdefault(replica_key(p), []).append(k)
    pos = {n.name: i for i, n in enumerate(g.nodes)}
    ready = []
    for key, idx in groups.items():
        devices = tuple(params[k].device for k in idx)
        if len(idx) >= 2 and len(set(devices)) >= 2:
            ready.append((max(pos[grads[k]] for k in idx), key, idx, devices))
    ready.sort()
    buckets: list[list[tuple]] = []
    size = 0
    for item in ready:
        _, key, idx, devices = item
        nbytes = g[grads[idx[0]]].type.nbytes()
        last = buckets[-1][-1] if buckets else None
        if (last is None or last[3] != devices or size + nbytes > bucket_bytes
                or g[grads[last[2][0]]].type.dtype != g[grads[idx[0]]].type.dtype):
            buckets.append([])
            size = 0
        buckets[-1].append(item)
        size += nbytes
    return params, grads, pos, buckets


def _reduce_bucket(g: Graph, b: int, bucket: list[tuple], params, grads, grad_of) -> list[Node]:
    """The nodes of one bucket, added to `g` (moved into place by the caller): per device
    the flattened gradients joined, the all-reduce members side by side, then per
    parameter its slice in its shape. `grads` and `grad_of` are updated."""
    devices = bucket[0][3]
    made: list[Node] = []
    add = adder(g, made, {"phase": "backward", "grad_sync": f"bucket{b}"})
    joined = flatten_bucket(g, b, bucket, grads, add)
    names = [g.fresh_name(f"grad_bucket{b}.all_reduce@d{dev}") for dev in devices]
    for j, (dev, name) in enumerate(zip(devices, names, strict=True)):
        m = make_node(g, name, "all_reduce", joined, {"group": devices, "index": j},
                      like=g[joined[j]], device=dev,
                      meta={"phase": "backward", "members": tuple(names),
                            "grad_sync": f"bucket{b}"})
        g.add(m)
        made.append(m)
    for j, dev in enumerate(devices):
        lo = 0
        for _, key, idx, _ in bucket:
            k = idx[j]
            p = params[k]
            n = p.type.numel()
            part = names[j] if len(bucket) == 1 else add(
                f"{key}.grad.part@d{dev}", "slice", [names[j]],
                {"axis": 0, "start": lo, "stop": lo + n, "step": 1}, p, dev)
            lo += n
            whole = add(f"{key}.grad.all_reduce@d{dev}", "reshape", [part],
                        {"shape": tuple(p.type.shape)}, p, dev, forward=p.name)
            grad_of.pop(grads[k], None)
            grads[k] = whole
            grad_of[whole] = p.name
    return made


def adder(g: Graph, made: list[Node], base_meta: dict):
    """add(name, op, inputs, attrs, like, device, **meta) -> a fresh node's name, the node
    added to `g` and to `made`, its meta `base_meta` and `meta`."""
    def add(name, op, ins, attrs, like, device, **meta):
        m = make_node(g, g.fresh_name(name), op, ins, attrs, like=like, device=device,
                      meta={**base_meta, **meta})
        g.add(m)
        made.append(m)
        return m.name
    return add


def flatten_bucket(g: Graph, b: int, bucket: Bucket, grads: list[str], add) -> list[str]:
    """Per device of the bucket, its gradients flattened and joined in the bucket's order
    (the collective's input)."""
    joined = []
    for j, dev in enumerate(bucket[0][3]):
        flats = [add(f"{key}.grad.flat@d{dev}", "reshape", [grads[idx[j]]], {"shape": (-1,)},
                     g[grads[idx[j]]], dev) for _, key, idx, _ in bucket]
        joined.append(flats[0] if len(flats) == 1 else add(
            f"grad_bucket{b}@d{dev}", "concat", flats, {"axis": 0}, g[grads[bucket[0][2][j]]],
            dev))
    return joined
