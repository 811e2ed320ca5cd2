"""A node of the graph IR: one operator application (or a source value) and the one value
it produces, named after the node.

Network inputs, parameters and buffers are nodes too (ops `input`, `param`, `buffer`), so
autodiff and the optimizer can refer to them like any other value, and a later pass can
move, split or duplicate them.

A layer makes nodes with `netdsl.ir.rewrite.make_node` (operators) and `make_source`
(sources), and copies them with `Node.copy`. `meta` holds what passes tell each other
about a node, under the keys netdsl.ir.meta declares (verify checks them).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from netdsl.errors import CallSite, SourceLoc
from netdsl.ir.types import TensorType

# node ops that hold no computation: sources of values
SOURCE_OPS = ("input", "param", "buffer")
# the sources that are persistent state (kept across steps, saved in checkpoints)
STATE_OPS = ("param", "buffer")


@dataclass
class Node:
    name: str
    op: str
    inputs: tuple[str, ...]
    type: TensorType
    attrs: dict[str, Any] = field(default_factory=dict)
    loc: SourceLoc | None = None
    stack: tuple[CallSite, ...] = ()  # block calls that created the node, outermost first
    scope: tuple[str, ...] = ()  # block instance path, e.g. ("stage3", "bottleneck12")
    annotations: dict[str, Any] = field(default_factory=dict)
    device: int | None = None  # assignment to a device, set by placement passes
    meta: dict[str, Any] = field(default_factory=dict)  # netdsl.ir.meta; survives copies

    @property
    def is_source(self) -> bool:
        return self.op in SOURCE_OPS

    def copy(self, **changes) -> Node:
        """A copy with its own attrs, annotations and meta dicts (`dataclasses.replace`
        semantics: only fields are copied; an unknown change is a TypeError). Written out:
        through `replace`, its checks would be a large share of binding a big graph."""
        if type(self) is not Node or not changes.keys() <= _NODE_FIELD_SET:
            return _replace_copy(self, changes)  # replace's checks and TypeError
        d = self.__dict__
        if len(d) == len(_NODE_FIELDS):  # the fields alone (the usual case): copy the dict
            values = d.copy()
        else:
            values = {f: d[f] for f in _NODE_FIELDS}
        if changes:
            values.update(changes)
        values["attrs"] = dict(values["attrs"])
        values["annotations"] = dict(values["annotations"])
        values["meta"] = dict(values["meta"])
        n = object.__new__(Node)
        n.__dict__ = values
        return n


_NODE_FIELDS = tuple(f.name for f in fields(Node))
_NODE_FIELD_SET = frozenset(_NODE_FIELDS)


def _replace_copy(node: Node, changes: dict) -> Node:
    n = replace(node, **changes)
    n.attrs = dict(n.attrs)
    n.annotations = dict(n.annotations)
    n.meta = dict(n.meta)
    return n
