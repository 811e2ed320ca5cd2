"""A compact, stable text form of a graph, one node a line (used as golden test output).

    %stem.conv = conv2d(%x, %stem.conv.weight) {kernel=(7, 7), stride=(2, 2)} : f32[N, 64, 112, 112]
"""
from __future__ import annotations


def fmt_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(fmt_value(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    if isinstance(v, str):
        return v if v.replace("_", "").replace(".", "").isalnum() else repr(v)
    if v is None:
        return "none"
    return str(v)


def fmt_attrs(attrs: dict) -> str:
    return ", ".join(f"{k}={fmt_value(v)}" for k, v in attrs.items())


def _annotation(k, v) -> str:
    if v is True:
        return f"@{k}"
    args = ", ".join(fmt_value(x) for x in v) if isinstance(v, (list, tuple)) else fmt_value(v)
    return f"@{k}({args})"


def node_line(n, *, locations: bool = False) -> str:
    args = ", ".join(f"%{i}" for i in n.inputs)
    line = f"%{n.name} = {n.op}({args})"
    if n.attrs:
        line += " {" + fmt_attrs(n.attrs) + "}"
    line += f" : {n.type}"
    if n.annotations:
        line += " " + " ".join(_annotation(k, v) for k, v in n.annotations.items())
    if n.device is not None:
        line += f" on {n.device}"
    if locations and n.loc is not None:
        line += f"  # {n.loc}"
    return line


def to_text(g, *, locations: bool = False) -> str:
    head = f"graph {g.name}(batch={g.batch})"
    if g.parallel:
        head += " parallel {" + fmt_attrs(g.parallel) + "}"
    lines = [head + " {"]
    lines += ["  " + node_line(n, locations=locations) for n in g.nodes]
    for role, names in g.outputs.items():
        lines.append(f"  {role} " + ", ".join(f"%{x}" for x in names))
    lines.append("}")
    return "\n".join(lines) + "\n"
