"""The graph IR: plain dataclasses that every pass reads and rewrites.

A `Graph` is a list of `Node`s (netdsl.ir.node) in topological order. Every node produces
one value named after the node; `inputs` name the nodes it reads.
"""
from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, field
from typing import Any

from netdsl.ir.bulk import gc_paused
from netdsl.ir.node import SOURCE_OPS, STATE_OPS, Node
from netdsl.ir.printer import to_text
from netdsl.ir.serialize import graph_fields_from_json, graph_to_json
from netdsl.ir.types import bind_dim
from netdsl.ir.verify import verify

# Node and the source-op tuples are re-exported: most layers take them from here
__all__ = ["SOURCE_OPS", "STATE_OPS", "Graph", "Node", "NodeList"]


class NodeList(list):
    """The node list of a graph: any change to it drops the graph's name index, so the
    index cannot go stale whichever way a pass edits the list (append, insert, slice
    assignment, or replacing `graph.nodes` outright)."""

    __slots__ = ("_graph",)

    def __init__(self, items=(), graph: Graph | None = None):
        super().__init__(items)
        # a weak reference: a strong one made every graph a reference cycle, freed only
        # by the cyclic collector (a split's discarded candidates piled up until it ran)
        self._graph = weakref.ref(graph) if graph is not None else None

    def _changed(self) -> None:
        g = self._graph() if self._graph is not None else None
        if g is not None:
            g._index = None


def _mutator(name: str):
    method = getattr(list, name)

    def wrapped(self, *args, **kwargs):
        self._changed()
        return method(self, *args, **kwargs)
    wrapped.__name__ = name
    return wrapped


for _m in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "insert", "extend",
           "pop", "remove", "clear", "sort", "reverse"):
    setattr(NodeList, _m, _mutator(_m))


@dataclass
class Graph:
    name: str
    nodes: list[Node] = field(default_factory=list)
    # named results: "output" (the network's declared outputs), "loss" (a scalar) ...
    outputs: dict[str, list[str]] = field(default_factory=dict)
    batch: int | str = "N"
    parallel: dict[str, int] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)  # keys declared in netdsl.ir.meta
    _index: dict[str, Node] | None = field(default=None, repr=False, compare=False)

    def __reduce__(self):
        # rebuilt through the constructor, so the node list tracks its graph again (the
        # list's weak reference does not pickle): a split's worker processes get graphs
        return (Graph, (self.name, list(self.nodes), self.outputs, self.batch,
                        self.parallel, self.meta))

    def __setattr__(self, key, value):
        if key == "nodes":  # every node list a graph holds tracks its changes
            value = NodeList(value, self)
            object.__setattr__(self, "_index", None)
        object.__setattr__(self, key, value)

    # -- lookup -------------------------------------------------------------------------
    def _idx(self) -> dict[str, Node]:
        if self._index is None:
            self._index = {n.name: n for n in self.nodes}
        return self._index

    def __getitem__(self, name: str) -> Node:
        index = self._index  # (the passes look nodes up millions of times: one call less)
        return (index if index is not None else self._idx())[name]

    def __contains__(self, name: str) -> bool:
        index = self._index
        return name in (index if index is not None else self._idx())

    def __iter__(self):
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def add(self, node: Node) -> Node:
        index = self._idx()
        if node.name in index:
            raise ValueError(f"duplicate node name {node.name!r}")
        list.append(self.nodes, node)  # appending keeps the index valid: extend it
        index[node.name] = node
        return node

    def fresh_name(self, base: str) -> str:
        if base not in self:
            return base
        i = 1
        while f"{base}_{i}" in self:
            i += 1
        return f"{base}_{i}"

    def consumers(self) -> dict[str, list[str]]:
        users: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                users[i].append(n.name)
        return users

    def by_op(self, *ops: str) -> list[Node]:
        return [n for n in self.nodes if n.op in ops]

    def params(self) -> list[Node]:
        return self.by_op("param")

    def output(self, role: str = "output") -> list[Node]:
        return [self[n] for n in self.outputs.get(role, [])]

    def copy(self) -> Graph:
        return Graph(self.name, [n.copy() for n in self.nodes],
                     {k: list(v) for k, v in self.outputs.items()}, self.batch,
                     dict(self.parallel), dict(self.meta))

    def bind(self, batch: int) -> Graph:
        """The same graph with the symbolic batch `N` replaced by an integer."""
        with gc_paused():
            g = self.copy()
            for n in g.nodes:
                n.type = n.type.bind(batch)
                if "shape" in n.attrs:
                    n.attrs["shape"] = tuple(bind_dim(d, batch) for d in n.attrs["shape"])
        g.batch = batch
        return g

    # -- checks and printing ------------------------------------------------------------
    def verify(self, *, recheck_shapes: bool = True) -> Graph:
        verify(self, recheck_shapes=recheck_shapes)
        return self

    def to_text(self, *, locations: bool = False) -> str:
        return to_text(self, locations=locations)

    def to_json(self) -> dict:
        return graph_to_json(self)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @staticmethod
    def from_json(data: dict) -> Graph:
        return Graph(**graph_fields_from_json(data))
