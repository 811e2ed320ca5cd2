"""Completion: what may be typed at a position of a `.net` file, maybe one that does not
parse while it is being typed (the module environment comes from the last version that
did): after `module.` its blocks; inside a call the keyword arguments of its operator or
block; else operators, builtins, blocks, modules, keywords, dtypes and variables."""
from __future__ import annotations

import re
from dataclasses import dataclass

from netdsl.frontend import ast
from netdsl.frontend.modules import ModuleEnv
from netdsl.frontend.values import BlockRef, ModuleRef
from netdsl.tooling.names import BUILTINS, dtypes, keywords, operators
from netdsl.tooling.signatures import (
    block_signature,
    doc_comment,
    expr_text,
    op_signature,
    value_text,
)


@dataclass
class Completion:
    label: str
    kind: str  # operator | block | module | keyword | builtin | variable | argument | dtype
    detail: str = ""
    doc: str = ""
    insert: str | None = None


def completions(env: ModuleEnv | None, text: str, line: int, col: int) -> list[Completion]:
    """What may be typed at (line, col) of `text`; `env`: the file's imports and blocks."""
    lines = text.split("\n")
    before = lines[line - 1][:col - 1] if 1 <= line <= len(lines) else ""
    m = re.search(r"([A-Za-z_]\w*)\.(\w*)$", before)
    if m and env is not None:  # `resnet.` : the module's blocks
        ref = env.globals.get(m.group(1))
        if isinstance(ref, ModuleRef):
            return [_block_item(b) for b in ref.module.tree.blocks]
        return []
    items: list[Completion] = []
    callee = _open_call(text, line, col)
    if callee is not None:
        items += _arguments(env, callee)
    for name, op in operators().items():
        items.append(Completion(name, "operator", op_signature(op), op.doc))
    items += [Completion(b, "builtin", f"{b}(...)") for b in BUILTINS]
    items += [Completion(k, "keyword") for k in keywords()]
    items += [Completion(d, "dtype") for d in dtypes()]
    if env is not None:
        for name, v in env.globals.items():
            if isinstance(v, BlockRef):
                items.append(_block_item(v.block))
            elif isinstance(v, ModuleRef):
                items.append(Completion(name, "module", v.module.file))
    seen = {c.label for c in items}
    for var in dict.fromkeys(re.findall(r"^\s*([A-Za-z_]\w*)\s*(?:,\s*\w+\s*)*=(?!=)",
                                        text, re.M)):
        if var not in seen:
            items.append(Completion(var, "variable"))
    return items


def _arguments(env: ModuleEnv | None, callee: str) -> list[Completion]:
    """The keyword arguments of the operator or block `callee` (`conv2d`, `resnet.stage`)."""
    mod, _, name = callee.rpartition(".")
    if not mod and name in operators():
        op = operators()[name]
        return [Completion(f"{a.name}=", "argument", f"{a.name}: {a.kind}" + (
            "" if a.required else f" = {value_text(a.default)}"), op_signature(op))
            for a in op.signature if a.kind not in ("tensor", "tensors")]
    if env is None:
        return []
    if mod:
        ref = env.globals.get(mod)
        if not isinstance(ref, ModuleRef):
            return []
        env = ref.module
    ref = env.globals.get(name)
    if not isinstance(ref, BlockRef):
        return []
    sig = block_signature(ref.block)
    return [Completion(f"{p.name}=", "argument", p.name if p.default is None else
                       f"{p.name} = {expr_text(p.default)}", sig)
            for p in ref.block.params]


def _block_item(b: ast.BlockDef) -> Completion:
    return Completion(b.name, "block", block_signature(b), doc_comment(b))


def _open_call(text: str, line: int, col: int) -> str | None:
    """The callee of the innermost call whose `(` is open at (line, col): `conv2d`,
    `resnet.stage`; None outside calls."""
    lines = text.split("\n")
    offset = sum(len(ln) + 1 for ln in lines[:line - 1]) + col - 1
    depth = 0
    i = offset - 1
    body = re.sub(r'#[^\n]*|"(?:[^"\\\n]|\\.)*"', lambda m: " " * len(m.group()),
                  text[:offset])
    while i >= 0:
        ch = body[i]
        if ch in ")]":
            depth += 1
        elif ch in "([":
            if depth == 0:
                if ch == "[":
                    return None
                m = re.search(r"([A-Za-z_][\w.]*)\s*$", body[:i])
                return m.group(1) if m else None
            depth -= 1
        elif ch in "{}" and depth == 0:
            return None
        i -= 1
    return None
