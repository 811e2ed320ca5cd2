"""Static statistics of a graph: parameters, forward FLOPs and bytes, per node and per block.

`summarize(g)` takes a graph bound to a concrete batch (`Graph.bind`) and counts, for every
operator node:

- params: elements of the `param` nodes it reads (buffers such as BN running statistics
  are not parameters; they are counted separately as `buffers`). A parameter read by
  several nodes is counted once, at its first reader, so rows add up to the total;
- flops: forward FLOPs from the registry (`OpDef.flops`), counted as 2 x multiply-
  accumulates;
- out_bytes: bytes of the node's output at its dtype;
- workspace: scratch bytes the kernel needs while it runs (`OpDef.workspace`).

Totals: `params` (every param node's elements, used or not), `flops_forward`,
`activation_bytes` (all operator outputs; sources excluded), `nodes` (operator nodes),
`convs` (conv2d nodes), `workspace_peak` (the largest single workspace, since workspaces
are reused from op to op).

Grouping. `node.scope` is the path of block instances that created the node, outermost
first. The front end names the calls of block `name` within one scope `name`, `name[1]`,
`name[2]`, ... (so the copies made by `repeat` are numbered; `name[0]` is accepted too);
`group_tree` folds consecutive sibling groups with the same base name and the same
structure into one group, so the 790 bottlenecks of a stage become one row,
"bottleneck[1..789] x789" (a first copy that differs, e.g. with a projection shortcut,
stays a row of its own). A row's numbers are always totals over all the copies it stands
for.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from netdsl.ir import registry
from netdsl.ir.bulk import gc_paused
from netdsl.ir.graph import SOURCE_OPS, STATE_OPS, Graph, Node
from netdsl.ir.printer import fmt_attrs
from netdsl.ir.types import TensorType

REPEAT_RE = re.compile(r"^(?P<base>.*)\[(?P<index>\d+)\]$")
# the 2-d convolutions counted as the network's layers (conv2d_add: the fuse pass's
# conv2d with its residual add)
_CONV2D = ("conv2d", "conv2d_add")


def split_repeat(scope_entry: str) -> tuple[str, int | None]:
    """'bottleneck[12]' -> ('bottleneck', 12); 'stem' -> ('stem', None)."""
    m = REPEAT_RE.match(scope_entry)
    if m is None:
        return scope_entry, None
    return m.group("base"), int(m.group("index"))


# -- grouping (structure only; works on symbolic graphs too) ------------------------------

@dataclass
class OpItem:
    node: Node


@dataclass
class GroupItem:
    """One block instance, or `count` consecutive structurally equal repeat copies."""

    name: str  # scope entry of the first copy, e.g. "bottleneck[1]"
    level: int  # index of this entry in node.scope
    copies: list[list[Node]]  # the nodes of each copy, in graph order
    types: dict[str, TensorType] = field(default_factory=dict, repr=False)  # of all values
    last_name: str | None = None  # scope entry of the last copy when folded

    @property
    def count(self) -> int:
        return len(self.copies)

    @property
    def label(self) -> str:
        if self.count == 1:
            return self.name
        base, first = split_repeat(self.name)
        _, last = split_repeat(self.last_name or self.name)
        return f"{base}[{first or 0}..{last}] x{self.count}"

    @property
    def nodes(self) -> list[Node]:
        return [n for c in self.copies for n in c]

    def children(self) -> list[OpItem | GroupItem]:
        """The items of one copy (the first), one level down."""
        return group_tree(self.copies[0], self.level + 1, self.types)


def _signature(nodes: list[Node], level: int, types: dict[str, TensorType]) -> tuple:
    """What must agree for two repeat copies to be folded: the relative scopes, ops,
    types, attributes and parameter shapes of their nodes, in order."""
    return tuple((n.scope[level + 1:], n.op, str(n.type), fmt_attrs(n.attrs),
                  tuple(str(types[i]) for i in n.inputs if i in types))
                 for n in nodes)


def group_tree(nodes: list[Node], level: int = 0,
               types: dict[str, TensorType] | None = None) -> list[OpItem | GroupItem]:
    """Group operator nodes (sources are skipped) by `scope[level]`, folding repeats.

    Nodes whose scope has exactly `level` entries are OpItems; the others are grouped by
    their entry at `level`, consecutive nodes with the same entry forming one group.
    `types` maps value names to types (for parameter shapes in the folding test); by
    default it is taken from `nodes`, so pass all of a graph's nodes, sources included.
    """
    if types is None:
        types = {n.name: n.type for n in nodes}
    items: list[OpItem | GroupItem] = []
    for n in nodes:
        if n.is_source:
            continue
        if len(n.scope) <= level:
            items.append(OpItem(n))
            continue
        entry = n.scope[level]
        last = items[-1] if items else None
        if isinstance(last, GroupItem) and last.name == entry:
            last.copies[0].append(n)
        else:
            items.append(GroupItem(entry, level, [[n]], types))
    return _fold(items, level, types)


def _fold(items: list[OpItem | GroupItem], level: int,
          types: dict[str, TensorType]) -> list[OpItem | GroupItem]:
    out: list[OpItem | GroupItem] = []
    sigs: dict[int, tuple] = {}
    for it in items:
        prev = out[-1] if out else None
        if (isinstance(it, GroupItem) and isinstance(prev, GroupItem)
                and _can_follow(prev, it)):
            if id(prev) not in sigs:
                sigs[id(prev)] = _signature(prev.copies[0], level, types)
            if _signature(it.copies[0], level, types) == sigs[id(prev)]:
                prev.copies.append(it.copies[0])
                prev.last_name = it.name
                continue
        out.append(it)
    return out


def _can_follow(prev: GroupItem, it: GroupItem) -> bool:
    # `name` (the first call in a scope), then `name[1]`, `name[2]`, ...: a bare name
    # counts as index 0
    base_p, idx_p = split_repeat(prev.last_name or prev.name)
    base_i, idx_i = split_repeat(it.name)
    return base_p == base_i and idx_i is not None and idx_i == (idx_p or 0) + 1


# -- numbers -----------------------------------------------------------------------------

@dataclass
class NodeStats:
    name: str
    op: str
    type: TensorType
    params: int
    buffers: int
    flops: int
    out_bytes: int
    workspace: int


@dataclass
class Row:
    """One line of `netdsl show`: an operator node or a (folded) block instance."""

    label: str
    kind: str  # "op" | "block"
    op: str  # operator name, or the block's name for a block row
    type: TensorType | None  # output type (a block's: that of its last node)
    level: int  # nesting depth, 0 at the top
    count: int  # how many copies this row stands for (numbers below are totals)
    params: int = 0
    flops: int = 0
    out_bytes: int = 0
    workspace: int = 0  # the largest single workspace inside
    nodes: int = 0  # operator nodes inside (all copies)

    @property
    def precision(self) -> str | None:
        """An operator row's mixed-precision rule (`OpDef.precision`: reduced, f32 or
        follow); None for a block."""
        return registry.OPS[self.op].precision if self.kind == "op" else None

    def to_json(self) -> dict:
        return {"name": self.label, "kind": self.kind, "op": self.op,
                "precision": self.precision,
                "type": str(self.type) if self.type is not None else None,
                "shape": list(self.type.shape) if self.type is not None else None,
                "level": self.level, "count": self.count, "params": self.params,
                "flops": self.flops, "output_bytes": self.out_bytes,
                "workspace_bytes": self.workspace, "nodes": self.nodes}


@dataclass
class Summary:
    network: str
    batch: int
    graph: Graph = field(repr=False)
    per_node: dict[str, NodeStats] = field(repr=False)
    params: int
    buffers: int
    flops_forward: int
    activation_bytes: int
    param_bytes: int
    workspace_peak: int
    nodes: int
    convs: int

    def rows(self, depth: int = 2) -> list[Row]:
        """The table of `show`: depth 1 gives one row per top-level node or (folded) block;
        each further level expands the blocks one level more. Depth 0 gives no rows."""
        out: list[Row] = []
        if depth < 1:
            return out
        self._rows(group_tree(self.graph.nodes, 0), depth, 1, out)
        return out

    def _rows(self, items, depth: int, mult: int, out: list[Row]) -> None:
        for it in items:
            if isinstance(it, OpItem):
                s = self.per_node[it.node.name]
                out.append(Row(it.node.name if mult == 1 else f"{it.node.name} x{mult}",
                               "op", s.op, s.type, len(it.node.scope), mult,
                               s.params * mult, s.flops * mult, s.out_bytes * mult,
                               s.workspace, mult))
                continue
            ns = [self.per_node[n.name] for n in it.nodes]
            first = it.copies[0]
            block = _block_name(first[0], it.level)
            count = it.count * mult
            label = it.label if mult == 1 else f"{it.label} (x{mult})"
            out.append(Row(label, "block", block, first[-1].type, it.level, count,
                           sum(s.params for s in ns) * mult, sum(s.flops for s in ns) * mult,
                           sum(s.out_bytes for s in ns) * mult,
                           max((s.workspace for s in ns), default=0), len(ns) * mult))
            if it.level + 1 < depth:
                self._rows(it.children(), depth, count, out)

    def totals(self) -> Row:
        return Row("total", "total", "", None, 0, 1, self.params, self.flops_forward,
                   self.activation_bytes, self.workspace_peak, self.nodes)

    def to_json(self, depth: int | None = 2) -> dict:
        d = {"network": self.network, "batch": self.batch, "params": self.params,
             "buffers": self.buffers, "param_bytes": self.param_bytes,
             "flops_forward": self.flops_forward, "flops_counted_as": "2 x MACs",
             "activation_bytes": self.activation_bytes,
             "workspace_peak_bytes": self.workspace_peak, "nodes": self.nodes,
             "convs": self.convs}
        if depth is not None:
            d["depth"] = depth
            d["rows"] = [r.to_json() for r in self.rows(depth)]
        return d


def _block_name(n: Node, level: int) -> str:
    # the block called for this scope entry, when the front end recorded the call stack
    if len(n.stack) == len(n.scope) and level < len(n.stack):
        return n.stack[level].block
    return "block"


@dataclass(frozen=True)
class Counts:
    params: int  # trainable parameter elements
    nodes: int  # operator nodes (not inputs, parameters or buffers)
    convs: int


def counts(g: Graph) -> Counts:
    """What `netdsl check` reports, as `summarize` counts it, from the graph as it is (a
    symbolic batch is fine: none of these depend on it). Cheap: `summarize` of a big file
    costs a copy of the graph to bind the batch and every node's FLOPs."""
    params = nodes = convs = 0
    for n in g.nodes:
        op = n.op
        if op == "param":
            params += n.type.numel(1)
        elif op not in SOURCE_OPS:
            nodes += 1
            convs += op in _CONV2D
    return Counts(params, nodes, convs)


def summarize(g: Graph) -> Summary:
    """Statistics of `g`, which must be bound to an integer batch (`Graph.bind`)."""
    if not isinstance(g.batch, int):
        raise ValueError(f"graph {g.name} has the symbolic batch {g.batch!r}; bind it first")
    with gc_paused():
        return _summarize(g)


def _summarize(g: Graph) -> Summary:
    ops = registry.load_all()
    types: dict[str, TensorType] = {}
    kinds: dict[str, str] = {}
    counted: set[str] = set()
    state_of: dict[str, str] = {}  # a cast of a parameter or buffer -> that state
    per_node: dict[str, NodeStats] = {}
    params = buffers = param_bytes = flops_total = act = ws_peak = n_ops = convs = 0
    for n in g.nodes:
        types[n.name] = n.type
        kinds[n.name] = n.op
        if n.op == "param":
            params += n.type.numel()
            param_bytes += n.type.nbytes()
            continue
        if n.op == "buffer":
            buffers += n.type.numel()
            continue
        if n.is_source:
            continue
        op = ops[n.op]
        p = b = 0
        if n.op == "cast" and kinds.get(n.inputs[0]) in STATE_OPS:
            # a 2-byte copy of a parameter (mixed precision): the parameter counts at the
            # copy's reader, the layer that uses it
            kinds[n.name], state_of[n.name] = kinds[n.inputs[0]], n.inputs[0]
        else:
            for i in n.inputs:
                s = state_of.get(i, i)
                if kinds.get(i) in STATE_OPS and s not in counted:
                    counted.add(s)
                    if kinds[i] == "param":
                        p += types[i].numel()
                    else:
                        b += types[i].numel()
        ins = [types[i] for i in n.inputs[:op.n_tensor_inputs(len(n.inputs))]]
        f = int(op.flops(ins, n.type, n.attrs))
        w = int(op.workspace(ins, n.type, n.attrs))
        ob = n.type.nbytes()
        per_node[n.name] = NodeStats(n.name, n.op, n.type, p, b, f, ob, w)
        flops_total += f
        act += ob
        ws_peak = max(ws_peak, w)
        n_ops += 1
        convs += n.op in _CONV2D
    return Summary(g.name, g.batch, g, per_node, params, buffers, flops_total, act,
                   param_bytes, ws_peak, n_ops, convs)


# -- human-readable numbers (shared by the CLI and the DOT output) ------------------------

def fmt_count(n: int) -> str:
    return f"{n:,}"


def fmt_si(n: float, unit: str = "") -> str:
    """4_100_000_000 -> '4.10 G'; decimal prefixes (FLOPs)."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:g} {unit}".rstrip()

