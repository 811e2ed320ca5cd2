"""The `fuse` pass's attention rewrite: multi-head self-attention written out over one packed
q/k/v projection becomes `attention_qkv` (netdsl.ir.ops.attention_qkv), its probabilities
kept by an `attention_qkv_probs` where they are small. And `join_attention_grads`, for
fuse_grads: the kept probabilities' three backward nodes and their gradient sum become one
attention_qkv_grad.

The form it finds is what stdlib/transformer.net's self_attention and causal_self_attention
lower to, and what torch.nn.MultiheadAttention computes:

    q, k, v = slice(qkv, axis=2) into thirds, in that order      (qkv: [N, T, 3D])
    each  = permute(reshape(third, (N, T, heads, hd)), (0, 2, 1, 3))
    core  = matmul(softmax(scale(matmul(q, transpose(k)), s)), v)     (scale optional)
         or scaled_dot_product_attention(q, k, v, causal, scale)
    out   = reshape(permute(core, (0, 2, 1, 3)), (N, T, D))

Every value in between must be read by the next node alone and be no graph output, no node
of it placed on a device or a recompute replay; anything else is left as written. The
fused node takes the final reshape's name and place (its readers are unchanged), the core
product's source location and scope, and qkv as its input; where the probabilities are
kept (short sequences: KEEP_PROBS_UP_TO), an attention_qkv_probs(qkv) named as the softmax
comes first and attention_qkv reads it as `p`.
"""
from __future__ import annotations

import math

from netdsl.ir.graph import Graph, Node
from netdsl.ir.rewrite import make_node

_HEADS_ORDER = (0, 2, 1, 3)


# Keep each head's [T, T] probabilities from the forward where T <= this x hd (a head's
# probabilities no more than 4/3 of its q, k and v, [T, 3hd]): the backward then reads them
# instead of recomputing the scores' products and softmax (transformer-tiny's step runs
# faster so for little more memory at the peak; docs/benchmarks.md). Longer
# sequences recompute: their probabilities would outgrow the activations around them
# (flash attention's choice).
KEEP_PROBS_UP_TO = 4


def attention_into_qkv(g: Graph, only) -> Graph:
    """Each match of the written-out attention -> attention_qkv(qkv), or, where the
    probabilities are kept (KEEP_PROBS_UP_TO), attention_qkv_probs(qkv) then
    attention_qkv(qkv, p); `only(x, r)`: value x is read by node r alone and is no
    output."""
    found = {}  # the final reshape's name -> (qkv, attrs, the nodes it replaces)
    for n in g.nodes:
        if n.op == "reshape":
            m = _match(g, n, only)
            if m is not None:
                found[n.name] = m
    if not found:
        return g
    dropped = {x.name for _, _, nodes in found.values() for x in nodes}
    return _rebuilt(g, dropped,
                    dict.fromkeys(found, lambda out, n: _add_fused(out, n, *found[n.name])))


def _rebuilt(g: Graph, dropped: set[str], remake: dict) -> Graph:
    """A copy of g without the `dropped` nodes, each node named in `remake` replaced in its
    place by what remake[name](the copy so far, the node) adds to the copy (so a node
    made there may read one made just before it). Nodes are added with `Graph.add`, which
    keeps the copy's name index: an append to its node list would drop it, and each node
    made would index the whole copy again."""
    out = g.copy()
    out.nodes = []
    for n in g.nodes:
        if n.name in remake:
            remake[n.name](out, n)
        elif n.name not in dropped:
            out.add(n)
    return out


def _add_fused(g: Graph, n: Node, qkv: str, attrs: dict, nodes: list[Node]) -> None:
    """Appends to g the node(s) that replace the attention ending at reshape `n`: named as
    it (and, for the kept probabilities, as the softmax or scaled_dot_product_attention it
    replaces), with the core product's source location and scope."""
    core = nodes[-1]
    meta = {**core.meta, "fused": tuple(x.name for x in nodes) + (n.name,)}
    t, hd = g[qkv].type.shape[1], core.type.shape[3]
    inputs = [qkv]
    if t <= KEEP_PROBS_UP_TO * hd:
        probs = next((x for x in nodes if x.op == "softmax"), core)
        g.add(make_node(g, probs.name, "attention_qkv_probs", [qkv], attrs, like=probs,
                        meta=dict(meta)))
        inputs.append(probs.name)
    f = make_node(g, n.name, "attention_qkv", inputs, attrs, like=core, meta=meta)
    f.annotations = dict(n.annotations)
    g.add(f)


def join_attention_grads(g: Graph, only) -> Graph:
    """The gradient sum add(attention_qkv_grad_values(dy, p),
    attention_qkv_probs_grad(attention_qkv_grad_probs(dy, qkv), p, qkv)) (either order),
    each term read by the sum alone and dP by its one reader -> attention_qkv_grad(dy, qkv,
    p), named as the sum: one pass an (image, head) task, dP in the thread's cache."""
    joined = {}  # the sum's name -> (the joined node's inputs and attributes, dropped)
    for n in g.nodes:
        if n.op != "add" or "sums_gradient_of" not in n.meta or len(n.inputs) != 2:
            continue
        values, probs_grad = sorted((g[x] for x in n.inputs), key=lambda x: x.op)
        if (values.op, probs_grad.op) != ("attention_qkv_grad_values",
                                          "attention_qkv_probs_grad"):
            continue
        dp = g[probs_grad.inputs[0]]
        dy, p, qkv = values.inputs[0], values.inputs[1], probs_grad.inputs[2]
        if (dp.op == "attention_qkv_grad_probs" and tuple(dp.inputs) == (dy, qkv)
                and probs_grad.inputs[1] == p
                and all(x.device == n.device for x in (dp, probs_grad, values))
                and only(dp.name, probs_grad.name) and only(probs_grad.name, n.name)
                and only(values.name, n.name)):
            joined[n.name] = ((dy, qkv, p), dict(probs_grad.attrs),
                              (dp.name, probs_grad.name, values.name))
    if not joined:
        return g
    def joined_grad(out, n):
        ins, attrs, names = joined[n.name]
        out.add(make_node(out, n.name, "attention_qkv_grad", ins, attrs, like=n,
                          meta={**n.meta, "fused": names + (n.name,)}))
    dropped = {x for _, _, names in joined.values() for x in names}
    return _rebuilt(g, dropped, dict.fromkeys(joined, joined_grad))


def _plain(n: Node) -> bool:
    return n.device is None and not n.attrs.get("replay")


def _match(g: Graph, out: Node, only):
    """(qkv's name, attention_qkv's attributes, the nodes replaced: merge permute first,
    core product last) where `out` ends the written-out attention, else None."""
    if not _plain(out) or out.type.rank != 3:
        return None
    merge = g[out.inputs[0]]
    if not (merge.op == "permute" and tuple(merge.attrs["dims"]) == _HEADS_ORDER
            and _plain(merge) and only(merge.name, out.name)):
        return None
    core = g[merge.inputs[0]]
    if not (_plain(core) and only(core.name, merge.name)):
        return None
    inner = _core(g, core, only)
    if inner is None:
        return None
    (qh, kh, vh), scale, causal, (q_reader, k_reader), between = inner
    heads = [_head(g, x, only, reader) for x, reader in
             ((qh, q_reader), (kh, k_reader), (vh, core))]
    if any(h is None for h in heads) or len({h[0] for h in heads}) != 1 \
            or [h[1] for h in heads] != [0, 1, 2]:
        return None
    src = g[heads[0][0]]
    n, t, d3 = src.type.shape
    nh, hd = core.type.shape[1], core.type.shape[3]
    if not isinstance(t, int) or d3 != 3 * nh * hd or out.type.shape != (n, t, nh * hd) \
            or not src.type.is_float or any(h[2][1].type.shape[2] != nh for h in heads):
        return None
    attrs = {"heads": nh, "causal": causal,
             "scale": None if math.isclose(scale, hd ** -0.5, rel_tol=1e-12) else scale}
    nodes = [merge] + [x for h in heads for x in h[2]] + between + [core]
    return src.name, attrs, nodes


def _core(g: Graph, core: Node, only):
    """((q, k, v) heads' names, scale, causal, (q's reader, k's reader), the nodes
    between the heads and `core`) of the attention product `core`, else None."""
    if core.op == "scaled_dot_product_attention":
        q, k, v = core.inputs
        scale = core.attrs["scale"]
        if scale is None:
            scale = g[q].type.shape[-1] ** -0.5
        return (q, k, v), scale, core.attrs["causal"], (core, core), []
    if core.op != "matmul":
        return None
    probs, v = (g[x] for x in core.inputs)
    if not (probs.op == "softmax" and probs.attrs["axis"] in (-1, 3) and _plain(probs)
            and only(probs.name, core.name)):
        return None
    scores, between, scale = g[probs.inputs[0]], [probs], 1.0
    if scores.op == "scale" and _plain(scores) and only(scores.name, probs.name):
        between.append(scores)
        scale = float(scores.attrs["factor"])
        scores = g[scores.inputs[0]]
    if not (scores.op == "matmul" and _plain(scores) and only(scores.name, between[-1].name)
            and scale > 0):
        return None
    kt = g[scores.inputs[1]]
    if not (kt.op == "transpose" and _plain(kt) and only(kt.name, scores.name)
            and {kt.attrs["dim0"] % 4, kt.attrs["dim1"] % 4} == {2, 3}):
        return None
    return (scores.inputs[0], kt.inputs[0], v.name), scale, False, (scores, kt), \
        between + [scores, kt]


def _head(g: Graph, name: str, only, reader: Node):
    """(qkv's name, which third, [the permute, reshape and slice]) where value `name` is
    a third of a [N, T, 3D] value split into heads (permute(reshape(slice)), read by
    `reader` alone), else None."""
    perm = g[name]
    if not (perm.op == "permute" and tuple(perm.attrs["dims"]) == _HEADS_ORDER
            and _plain(perm) and only(name, reader.name)):
        return None
    rs = g[perm.inputs[0]]
    if not (rs.op == "reshape" and _plain(rs) and only(rs.name, perm.name)
            and rs.type.rank == 4):
        return None
    sl = g[rs.inputs[0]]
    if not (sl.op == "slice" and _plain(sl) and only(sl.name, rs.name)
            and sl.attrs["axis"] % 3 == 2 and sl.attrs["step"] == 1):
        return None
    src = g[sl.inputs[0]].type
    if src.rank != 3 or not isinstance(src.shape[2], int) or src.shape[2] % 3:
        return None
    d = src.shape[2] // 3
    third, rest = divmod(sl.attrs["start"], d)
    if rest or sl.attrs["stop"] != sl.attrs["start"] + d \
            or rs.type.shape[:2] != src.shape[:2] or rs.type.shape[2] * rs.type.shape[3] != d:
        return None
    return sl.inputs[0], third, [perm, rs, sl]
