"""JSON round-trip of the IR (every field, so passes can be checkpointed and diffed).

`Graph.to_json()` and `Graph.from_json()` call this module, which takes and gives graphs
as they are (it does not import netdsl.ir.graph, which imports it).
"""
from __future__ import annotations

import hashlib

from netdsl.errors import CallSite, SourceLoc
from netdsl.ir.node import Node
from netdsl.ir.types import TensorType

FORMAT = "netdsl-ir/1"


def _jsonable(v):
    if isinstance(v, tuple):
        return {"__tuple__": [_jsonable(x) for x in v]}
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return v


def _unjson(v):
    if isinstance(v, dict):
        if set(v) == {"__tuple__"}:
            return tuple(_unjson(x) for x in v["__tuple__"])
        return {k: _unjson(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_unjson(x) for x in v]
    return v


def _loc(d):
    return None if d is None else SourceLoc(d["file"], d["line"], d["column"],
                                            d.get("end_line"), d.get("end_column"))


def _loc_json(loc):
    if loc is None:
        return None
    return {"file": loc.file, "line": loc.line, "column": loc.column,
            "end_line": loc.end_line, "end_column": loc.end_column}


def node_to_json(n: Node) -> dict:
    return {
        "name": n.name, "op": n.op, "inputs": list(n.inputs),
        "type": {"shape": list(n.type.shape), "dtype": n.type.dtype},
        "attrs": _jsonable(n.attrs), "loc": _loc_json(n.loc),
        "stack": [{"block": s.block, "loc": _loc_json(s.loc)} for s in n.stack],
        "scope": list(n.scope), "annotations": _jsonable(n.annotations),
        "device": n.device, "meta": _jsonable(n.meta),
    }


def node_from_json(d: dict) -> Node:
    """The node as it was saved, built directly rather than through rewrite's factories:
    a document is restored field for field, with no rule run again over it."""
    return Node(
        name=d["name"], op=d["op"], inputs=tuple(d["inputs"]),
        type=TensorType(tuple(d["type"]["shape"]), d["type"]["dtype"]),
        attrs=_unjson(d["attrs"]), loc=_loc(d["loc"]),
        stack=tuple(CallSite(s["block"], _loc(s["loc"])) for s in d["stack"]),
        scope=tuple(d["scope"]), annotations=_unjson(d["annotations"]),
        device=d["device"], meta=_unjson(d["meta"]))


def graph_to_json(g) -> dict:
    return {"format": FORMAT, "name": g.name, "batch": g.batch, "parallel": dict(g.parallel),
            "outputs": {k: list(v) for k, v in g.outputs.items()}, "meta": _jsonable(g.meta),
            "nodes": [node_to_json(n) for n in g.nodes]}


def graph_fields_from_json(d: dict) -> dict:
    """The `Graph` constructor's arguments from a document (`Graph.from_json` builds it)."""
    if d.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} document")
    return {"name": d["name"], "nodes": [node_from_json(n) for n in d["nodes"]],
            "outputs": {k: list(v) for k, v in d["outputs"].items()}, "batch": d["batch"],
            "parallel": dict(d["parallel"]), "meta": _unjson(d.get("meta", {}))}


_PLAIN = (str, int, float, bool, type(None), tuple)


def fingerprint(g) -> str:
    """A digest of what a graph computes and where: every node's name, op, inputs, type,
    attributes and device, and the outputs (not source locations or meta). Processes that
    must run parts of one graph (MPI ranks) compare it."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((g.name, g.batch, sorted(g.outputs.items()))).encode())
    for n in g.nodes:
        attrs = sorted((k, v if isinstance(v, _PLAIN) else type(v).__name__)
                       for k, v in n.attrs.items())
        h.update(repr((n.name, n.op, n.inputs, n.type.shape, n.type.dtype, attrs,
                       n.device)).encode())
    return h.hexdigest()
