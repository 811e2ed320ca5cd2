"""Rewrites of an ONNX graph before import: operators that exporters spell as several
nodes are put back together, so the importer table sees one node.

- gelu: `x * 0.5 * (1 + erf(x / sqrt 2))` (PyTorch's and netdsl's own spelling, with Div
  or Mul, in either order of the two products) becomes one `Gelu` node (opset 20's).
"""
from __future__ import annotations

import math

import numpy as np


def _scalar(consts, name) -> float | None:
    v = consts.get(name)
    return float(v.reshape(())) if v is not None and v.size == 1 else None


def _near(v, want) -> bool:
    return v is not None and abs(v - want) <= 1e-4 * abs(want)


def fuse_gelu(onnx, graph, consts: dict[str, np.ndarray]) -> None:
    """Replace each erf-form gelu subgraph by a Gelu node, in place."""
    producer = {o: n for n in graph.node for o in n.output}
    users: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    outputs = {o.name for o in graph.output}

    def other(node, name):
        """(the non-constant input, the constant's scalar value) of a binary node."""
        a, b = node.input
        if _scalar(consts, b) is not None:
            return a, _scalar(consts, b)
        if _scalar(consts, a) is not None:
            return b, _scalar(consts, a)
        return None, None

    def only_user(value):
        u = users.get(value, [])
        return u[0] if len(u) == 1 and value not in outputs else None

    drop, replace = set(), {}
    for erf in [n for n in graph.node if n.op_type == "Erf"]:
        pre = producer.get(erf.input[0])
        if pre is None or only_user(pre.output[0]) is not erf:
            continue
        x, c = other(pre, None) if pre.op_type in ("Mul", "Div") else (None, None)
        if x is None or not (pre.op_type == "Mul" and _near(c, 1 / math.sqrt(2))
                             or pre.op_type == "Div" and _near(c, math.sqrt(2))):
            continue
        add = only_user(erf.output[0])
        if add is None or add.op_type != "Add" or not _near(other(add, None)[1], 1.0):
            continue
        m1 = only_user(add.output[0])
        if m1 is None or m1.op_type != "Mul":
            continue
        rest = m1.input[1] if m1.input[0] == add.output[0] else m1.input[0]
        half = producer.get(rest)
        if rest == x:  # (x * (1 + erf)) * 0.5
            m2 = only_user(m1.output[0])
            if m2 is None or m2.op_type != "Mul" or not _near(other(m2, None)[1], 0.5):
                continue
            nodes, last = [pre, erf, add, m1, m2], m2
        elif (half is not None and half.op_type == "Mul" and only_user(rest) is m1
              and other(half, None) == (x, 0.5)):  # (x * 0.5) * (1 + erf)
            nodes, last = [pre, erf, add, half, m1], m1
        else:
            continue
        drop.update(id(n) for n in nodes)
        replace[id(last)] = onnx.helper.make_node("Gelu", [x], [last.output[0]],
                                                  name=erf.name or last.name)
    if not replace:
        return
    kept = []
    for n in graph.node:
        if id(n) in replace:
            kept.append(replace[id(n)])
        elif id(n) not in drop:
            kept.append(n)
    del graph.node[:]
    graph.node.extend(kept)
