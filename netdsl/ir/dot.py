"""Graphviz DOT of a graph: one cluster per block instance, repeats folded by default.

A run of structurally equal repeat copies (see `netdsl.ir.stats.group_tree`) is drawn as
one box, "bottleneck[1..789] x789", so a 2,504-layer network stays a picture of a few
dozen boxes. Parameters and buffers are left out (they are listed in each op's label as a
count); network inputs are drawn as ellipses. `fold=False` expands every copy.
"""
from __future__ import annotations

from netdsl.ir.graph import Graph, Node
from netdsl.ir.stats import GroupItem, OpItem, fmt_count, group_tree


def _q(s: str) -> str:
    """A quoted DOT string; newlines become DOT's centred line breaks."""
    s = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{s}"'


def to_dot(g: Graph, *, fold: bool = True, depth: int | None = None) -> str:
    """DOT text for `g`. Blocks deeper than `depth` levels are drawn as one box each."""
    d = _Drawing(g, fold, depth)
    d.network_inputs()
    d.items(group_tree(g.nodes, 0), "  ", 0)
    d.edges()
    d.output_roles()
    d.lines.append("}")
    return "\n".join(d.lines) + "\n"


class _Drawing:
    """The DOT lines of one graph, and which box stands for each value drawn so far."""

    def __init__(self, g: Graph, fold: bool, depth: int | None):
        self.g, self.fold, self.depth = g, fold, depth
        self.types = {n.name: n.type for n in g.nodes}
        self.kinds = {n.name: n.op for n in g.nodes}
        self.shown: dict[str, str] = {}  # value name -> id of the box that stands for it
        self.lines = [f"digraph {_q(g.name)} {{",
                      "  rankdir=TB;",
                      '  node [shape=box, style="rounded,filled", fillcolor=white, '
                      'fontsize=10];']
        self.counter = 0

    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def network_inputs(self) -> None:
        for n in self.g.nodes:
            if n.op == "input":
                self.shown[n.name] = n.name
                label = _q(f"{n.name}\n{n.type}")
                self.lines.append(f"  {_q(n.name)} [shape=ellipse, label={label}];")

    def param_elems(self, nodes) -> int:
        """The elements of the parameters `nodes` read (a symbolic shape counts none)."""
        return sum(self.types[i].numel() for n in nodes for i in n.inputs
                   if self.kinds.get(i) == "param" and not self.types[i].symbolic)

    def op_box(self, n: Node, indent: str) -> None:
        self.shown[n.name] = n.name
        label = f"{n.name}\n{n.op} : {n.type}"
        if any(self.kinds.get(i) == "param" for i in n.inputs):
            label += f"\n{fmt_count(self.param_elems([n]))} params"
        self.lines.append(f"{indent}{_q(n.name)} [label={_q(label)}];")

    def collapsed_box(self, it: GroupItem, indent: str) -> None:
        bid = self.fresh("group")
        members = it.nodes
        for n in members:
            self.shown[n.name] = bid
        text = f"{it.label}\n{len(members)} ops : {members[-1].type}"
        if pe := self.param_elems(members):
            text += f"\n{fmt_count(pe)} params"
        style = ', shape=box3d' if it.count > 1 else ''
        self.lines.append(f'{indent}{bid} [label={_q(text)}, fillcolor="#eeeeff"{style}];')

    def items(self, items, indent: str, level: int) -> None:
        """Boxes for the ops and groups of one level of the block tree; a group expanded
        is a cluster per copy, holding the next level."""
        for it in items:
            if isinstance(it, OpItem):
                self.op_box(it.node, indent)
            elif (it.count > 1 and self.fold) or (self.depth is not None
                                                  and level >= self.depth):
                self.collapsed_box(it, indent)
            else:
                for copy_nodes in it.copies:
                    self.cluster(it, copy_nodes, indent, level)

    def cluster(self, it: GroupItem, copy_nodes, indent: str, level: int) -> None:
        name = it.name if len(it.copies) == 1 else _scope_name(copy_nodes[0], level)
        self.lines.append(f"{indent}subgraph {self.fresh('cluster_')} {{")
        self.lines.append(f"{indent}  label={_q(name)}; style=rounded; color=gray50;")
        self.items(group_tree(copy_nodes, level + 1, self.types), indent + "  ", level + 1)
        self.lines.append(f"{indent}}}")

    def edges(self) -> None:
        """An edge between two boxes for each value one reads of the other, once."""
        seen: set[tuple[str, str]] = set()
        for n in self.g.nodes:
            if n.name not in self.shown or n.is_source:
                continue
            dst = self.shown[n.name]
            for i in n.inputs:
                src = self.shown.get(i)
                if src is not None and src != dst and (src, dst) not in seen:
                    seen.add((src, dst))
                    self.lines.append(f"  {_q(src)} -> {_q(dst)};")

    def output_roles(self) -> None:
        for role, names in self.g.outputs.items():
            oid = f"__{role}"
            self.lines.append(f"  {_q(oid)} [shape=plaintext, label={_q(role)}];")
            for name in names:
                if name in self.shown:
                    self.lines.append(f"  {_q(self.shown[name])} -> {_q(oid)} [style=dashed];")


def _scope_name(n: Node, level: int) -> str:
    return n.scope[level]
