"""How the tools show operators, blocks and static values: signatures as a user writes
the calls, and the doc comment of a block (the comment lines above its definition)."""
from __future__ import annotations

from netdsl.errors import source_line
from netdsl.frontend import ast
from netdsl.ir import registry


def value_text(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if v is None:
        return "none"
    if isinstance(v, str):
        return f'"{v}"' if v != "N" else "N"
    if isinstance(v, tuple):
        return "(" + ", ".join(map(value_text, v)) + ("," if len(v) == 1 else "") + ")"
    return repr(v)


def op_signature(op: registry.OpDef) -> str:
    parts = []
    for a in op.signature:
        name = f"{a.name}..." if a.kind == "tensors" else a.name
        parts.append(name if a.required else f"{name}={value_text(a.default)}")
    return f"{op.name}({', '.join(parts)})"


def block_signature(b: ast.BlockDef) -> str:
    parts = []
    for p in b.params:
        parts.append(p.name if p.default is None else f"{p.name}={expr_text(p.default)}")
    return f"block {b.name}({', '.join(parts)})"


def expr_text(e: ast.Expr) -> str:
    """The source text of a (short) expression, from its location."""
    loc = e.loc
    line = source_line(loc.file, loc.line) if loc is not None else None
    if line is None or loc.end_line != loc.line or not loc.end_column:
        if isinstance(e, ast.Const):
            return value_text(e.value)
        return "..."
    return line[loc.column - 1:loc.end_column - 1]


def doc_comment(b: ast.BlockDef) -> str:
    """The comment lines right above a block definition (past its annotations)."""
    out: list[str] = []
    n = b.loc.line - 1
    while n >= 1:
        text = (source_line(b.loc.file, n) or "").strip()
        if text.startswith("@"):
            n -= 1
            continue
        if not text.startswith("#"):
            break
        out.append(text.lstrip("#").strip())
        n -= 1
    return "\n".join(reversed(out))



def op_doc(name: str) -> str:
    op = registry.get(name)
    return f"{op.doc} ({op.layer_type})" if op.doc else f"({op.layer_type})"
