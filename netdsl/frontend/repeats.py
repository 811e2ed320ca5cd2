"""Errors first: the later copies of a long `repeat`, known from its first two.

Checking `repeat 1_000_000 { h = relu(h) }` expands a million copies before it reaches
the statement after it, so a misspelt name there waits for all of them. A copy of a
repeat's body is evaluated from the frame's names alone (its static values, and its
tensors' types, origins and the nodes that made them): where the second copy is the
first's image, node for node (the same ops, attributes, types and annotations, reading
the first copy's nodes where the first read the values its names held before it, and
the same nodes outside the body), and leaves the names as the image of what the first
left, every later copy is an image too, and succeeds where the second did. So the
elaborator stops after two copies (`same_copies`) and goes on with the statements after
the loop, whose values have the types, origins and makers they would have had: any
error it reports is one the whole expansion reports. A check that finds no error builds
the whole graph again (Elaborator.run), so the graph is always every copy; a body that
makes parameters or buffers (state a later copy's name lookups could find) is never cut.
"""
from __future__ import annotations

from netdsl.frontend.values import Tensor
from netdsl.ir.graph import STATE_OPS, Graph

# cut a repeat only where the copies left would add at least this many nodes: below it,
# expanding them costs less than the check that builds the graph again
MIN_NODES_CUT = 10_000


def worth_cutting(body_nodes: int, count: int) -> bool:
    """Whether a repeat of `count` copies of `body_nodes` nodes each is worth cutting
    after its first two."""
    return body_nodes > 0 and body_nodes * (count - 2) >= MIN_NODES_CUT


def same_copies(g: Graph, names: tuple[dict, dict, dict], starts: tuple[int, int, int]
                ) -> bool:
    """Whether the second copy of a repeat's body is the image of its first (module doc):
    `names` the frame's names before the first copy, after it and after the second;
    `starts` where each copy's nodes begin in `g.nodes` and where the second's end."""
    n0, n1, n2 = starts
    first, second = g.nodes[n0:n1], g.nodes[n1:n2]
    if len(first) != len(second) or any(n.op in STATE_OPS for n in g.nodes[n0:n2]):
        return False
    before, after1, after2 = names
    if set(after2) != set(after1):
        return False
    # where the first copy read a name's earlier value, the second reads its later one
    later: dict[str, set[str]] = {}
    for k, v0 in before.items():
        if isinstance(v0, Tensor) and isinstance(after1[k], Tensor):
            later.setdefault(v0.node, set()).add(after1[k].node)
    image = {a.name: b.name for a, b in zip(first, second)}
    for a, b in zip(first, second):
        if (a.op, a.type, a.attrs, a.annotations) != (b.op, b.type, b.attrs, b.annotations) \
                or len(a.inputs) != len(b.inputs):
            return False
        for x, y in zip(a.inputs, b.inputs):
            if y != image.get(x, x) and y not in later.get(x, ()):
                return False
    # the names the second copy leaves are the image of what the first left: the third
    # copy starts where the second did, renamed
    return all(_image_of(after1[k], after2[k], image) for k in after1)


def _image_of(v1, v2, image: dict[str, str]) -> bool:
    if isinstance(v1, Tensor) or isinstance(v2, Tensor):
        return (isinstance(v1, Tensor) and isinstance(v2, Tensor)
                and (v1.type, v1.origin, v1.var) == (v2.type, v2.origin, v2.var)
                and v2.node == image.get(v1.node, v1.node))
    if isinstance(v1, tuple) and isinstance(v2, tuple):
        return len(v1) == len(v2) and all(_image_of(a, b, image) for a, b in zip(v1, v2))
    return type(v1) is type(v2) and v1 == v2
