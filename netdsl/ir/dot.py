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
    types = {n.name: n.type for n in g.nodes}
    kinds = {n.name: n.op for n in g.nodes}
    shown: dict[str, str] = {}  # value name -> id of the box that stands for it
    lines = [f"digraph {_q(g.name)} {{",
             "  rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fillcolor=white, fontsize=10];']
    counter = [0]

    def fresh(prefix: str) -> str:
        counter[0] += 1
        return f"{prefix}{counter[0]}"

    for n in g.nodes:
        if n.op == "input":
            shown[n.name] = n.name
            label = _q(f"{n.name}\n{n.type}")
            lines.append(f"  {_q(n.name)} [shape=ellipse, label={label}];")

    def n_params(n: Node) -> int:
        return sum(1 for i in n.inputs if kinds.get(i) == "param")

    def op_box(n: Node, indent: str) -> None:
        shown[n.name] = n.name
        label = f"{n.name}\n{n.op} : {n.type}"
        if n_params(n):
            pe = sum(types[i].numel() for i in n.inputs if kinds.get(i) == "param"
                     and not types[i].symbolic)
            label += f"\n{fmt_count(pe)} params"
        lines.append(f"{indent}{_q(n.name)} [label={_q(label)}];")

    def collapsed_box(it: GroupItem, indent: str, label: str) -> None:
        bid = fresh("group")
        members = it.nodes
        for n in members:
            shown[n.name] = bid
        last = members[-1]
        text = f"{label}\n{len(members)} ops : {last.type}"
        pe = sum(types[i].numel() for n in members for i in n.inputs
                 if kinds.get(i) == "param" and not types[i].symbolic)
        if pe:
            text += f"\n{fmt_count(pe)} params"
        style = ', shape=box3d' if it.count > 1 else ''
        lines.append(f'{indent}{bid} [label={_q(text)}, fillcolor="#eeeeff"{style}];')

    def emit(items, indent: str, level: int) -> None:
        for it in items:
            if isinstance(it, OpItem):
                op_box(it.node, indent)
                continue
            if it.count > 1 and fold:
                collapsed_box(it, indent, it.label)
                continue
            if depth is not None and level >= depth:
                collapsed_box(it, indent, it.label)
                continue
            for copy_nodes in it.copies:
                name = it.name if len(it.copies) == 1 else _scope_name(copy_nodes[0], level)
                cid = fresh("cluster_")
                lines.append(f"{indent}subgraph {cid} {{")
                lines.append(f"{indent}  label={_q(name)}; style=rounded; color=gray50;")
                emit(group_tree(copy_nodes, level + 1, types), indent + "  ", level + 1)
                lines.append(f"{indent}}}")

    emit(group_tree(g.nodes, 0), "  ", 0)

    edges: set[tuple[str, str]] = set()
    for n in g.nodes:
        if n.name not in shown or n.is_source:
            continue
        dst = shown[n.name]
        for i in n.inputs:
            src = shown.get(i)
            if src is not None and src != dst and (src, dst) not in edges:
                edges.add((src, dst))
                lines.append(f"  {_q(src)} -> {_q(dst)};")
    for role, names in g.outputs.items():
        oid = f"__{role}"
        lines.append(f"  {_q(oid)} [shape=plaintext, label={_q(role)}];")
        for name in names:
            if name in shown:
                lines.append(f"  {_q(shown[name])} -> {_q(oid)} [style=dashed];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _scope_name(n: Node, level: int) -> str:
    return n.scope[level]
