"""What an editor asks about a `.net` file, answered from the checker: its errors (the
same as `netdsl check`), what the name under the cursor is (a tensor's type and the node
that made it, parameters and FLOPs; a block's signature and doc comment), where it is
defined, what may be typed next (`completion`), and the outline. No LSP here:
`netdsl.tooling.lsp` wraps this for pygls; positions are 1-based lines and columns, as in
`SourceLoc`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from netdsl.errors import Diagnostic, NetdslError, SourceLoc
from netdsl.frontend import ast, load_module, train_config
from netdsl.frontend.modules import ModuleEnv
from netdsl.frontend.values import POISON, BlockRef, Builtin, ModuleRef, OpRef, Tensor
from netdsl.ir import registry
from netdsl.ir.graph import Graph
from netdsl.ir.stats import fmt_count, fmt_si, summarize
from netdsl.tooling.completion import Completion, completions
from netdsl.tooling.recorder import Entry, Recorder
from netdsl.tooling.signatures import (
    block_signature,
    doc_comment,
    expr_text,
    op_doc,
    op_signature,
    value_text,
)


@dataclass
class Symbol:
    name: str
    kind: str  # network | block | train | input
    detail: str
    range: tuple[int, int, int, int]  # line, column, end line, end column (1-based)
    selection: SourceLoc
    children: list[Symbol] = field(default_factory=list)



class Analysis:
    """One version of one file, checked; ask it about positions."""

    def __init__(self, text: str, file: str):
        self.text, self.file = text, file
        self.diagnostics: list[Diagnostic] = []
        self.env: ModuleEnv | None = None
        self.graph: Graph | None = None
        self.index: dict = {}
        self._stats = None
        try:
            self.env = load_module(text=text, file=file)
        except NetdslError as e:
            self.diagnostics = list(e.diagnostics)
            return
        for net in self.env.tree.networks[:1]:
            rec = Recorder(self.env, net, self.index)
            try:
                self.graph = rec.run().verify()
            except NetdslError as e:
                self.diagnostics += e.diagnostics
        if len(self.env.tree.networks) > 1:
            nets = self.env.tree.networks
            self.diagnostics.append(Diagnostic(
                f"{file} defines {len(nets)} networks ({', '.join(n.name for n in nets)}); "
                "choose one", nets[1].loc))
        try:
            train_config(self.env.tree.train)
        except NetdslError as e:
            self.diagnostics += e.diagnostics
        if self.graph is not None and not self.diagnostics:
            try:
                self.graph.bind(1)
            except NetdslError as e:
                self.diagnostics += e.diagnostics

    # -- hover ----------------------------------------------------------------------------
    def _at(self, line: int, col: int) -> list[Entry]:
        hits = []
        for e in self.index.values():
            lo = e.loc
            if not same_file(lo.file, self.file) or lo.end_line is None:
                continue
            if (lo.line, lo.column) <= (line, col) <= (lo.end_line, lo.end_column - 1):
                hits.append(e)
        if not hits:
            return []
        # the innermost: the shortest range
        size = lambda e: (e.loc.end_line - e.loc.line, e.loc.end_column - e.loc.column)  # noqa: E731
        best = min(map(size, hits))
        order = {"block-call": 0, "call": 1, "value": 2, "argument": 3}
        hits = sorted((e for e in hits if size(e) == best), key=lambda e: order[e.kind])
        if hits[0].kind in ("call", "block-call"):  # a call says what the callee is
            hits = [e for e in hits if e.kind != "value"
                    or not isinstance(e.value, BlockRef | OpRef)]
        return hits

    def stats(self):
        if self._stats is None and self.graph is not None:
            self._stats = summarize(self.graph.bind(1))
        return self._stats

    def hover(self, line: int, col: int) -> str | None:
        """Markdown about the name at (line, col), or None."""
        parts = [self._describe(e) for e in self._at(line, col)]
        parts = [p for p in parts if p]
        if not parts:
            imp = self._import_at(line, col)
            if imp is not None:
                return f"module `{imp.name}` ({imp.file})\n\nblocks: " + ", ".join(
                    f"`{b.name}`" for b in imp.tree.blocks)
            return None
        return "\n\n---\n\n".join(dict.fromkeys(parts))

    def _node_line(self, node: str) -> str:
        s = self.stats()
        if s is None or node not in s.per_node:
            return ""
        n = s.per_node[node]
        return f"params {fmt_count(n.params)}, forward FLOPs {fmt_si(n.flops)} per sample"

    def _describe(self, e: Entry) -> str:
        v = e.value
        where = f" (x{e.count})" if e.count > 1 else ""
        if e.kind == "call":
            info = self._node_line(e.detail["node"])
            sig = op_signature(registry.get(e.detail["op"]))
            return (f"```\n{sig} -> {v.type}\n```\nnode `{e.detail['node']}`{where}"
                    + (f"; {info}" if info else "") + "\n\n" + op_doc(e.detail["op"]))
        if e.kind == "block-call":
            b: ast.BlockDef = e.detail["block"]
            nodes = e.detail["nodes"]
            s = self.stats()
            out = f"```\n{block_signature(b)}\n```\n"
            if isinstance(v, Tensor):
                out += f"returns `{v.type}`{where}; "
            if s is not None:
                params = sum(s.per_node[n].params for n in nodes if n in s.per_node)
                flops = sum(s.per_node[n].flops for n in nodes if n in s.per_node)
                ops = sum(1 for n in nodes if n in s.per_node)
                out += (f"{fmt_count(ops)} operators, params {fmt_count(params)}, forward "
                        f"FLOPs {fmt_si(flops)} per sample (this call)")
            doc = doc_comment(b)
            return out + (f"\n\n{doc}" if doc else "")
        name = e.detail.get("name", "")
        if e.kind == "argument":
            if isinstance(v, BlockRef):
                p = next(p for p in v.block.params if p.name == name)
                default = f" = {expr_text(p.default)}" if p.default is not None else ""
                return (f"```\n{name}{default}\n```\nparameter of "
                        f"`{block_signature(v.block)}`")
            arg = next((a for a in registry.get(v.name).signature if a.name == name), None)
            if arg is None:
                return ""
            default = "" if arg.required else f" = {value_text(arg.default)}"
            choices = f"; one of {', '.join(map(value_text, arg.choices))}" \
                if arg.choices else ""
            return (f"```\n{name}: {arg.kind}{default}\n```\nargument of "
                    f"`{op_signature(registry.get(v.name))}`{choices}")
        if isinstance(v, Tensor):
            made = self._node_of(v.node)
            out = f"```\n{name}: {v.type}\n```\n"
            if made is not None and not made.is_source:
                out += f"made by `{made.op}` (node `{made.name}`)"
                if made.stack:  # inside block calls: which ones, outermost first
                    out += " in block " + " > ".join(f"`{c.block}`" for c in made.stack)
                info = self._node_line(made.name)
                out += f"; {info}" if info else ""
            elif made is not None:
                out += f"{made.op} `{made.name}`"
            if e.detail.get("block"):
                out += f"\n\nin block `{e.detail['block']}`{where}"
            return out
        if isinstance(v, BlockRef):
            doc = doc_comment(v.block)
            return f"```\n{block_signature(v.block)}\n```" + (f"\n\n{doc}" if doc else "") + \
                f"\n\ndefined in {v.block.loc.file}"
        if isinstance(v, OpRef):
            return f"```\n{op_signature(registry.get(v.name))}\n```\n\n{op_doc(v.name)}"
        if isinstance(v, ModuleRef):
            m = v.module
            return f"module `{m.name}` ({m.file})\n\nblocks: " + ", ".join(
                f"`{b.name}`" for b in m.tree.blocks)
        if isinstance(v, Builtin):
            return f"builtin function `{v.name}()`"
        if v is POISON or v is None and e.kind != "value":
            return ""
        return f"```\n{name} = {value_text(v)}\n```" + (
            f"\n\nin block `{e.detail['block']}`" if e.detail.get("block") else "")

    def _node_of(self, name: str):
        if self.graph is None or name not in self.graph:
            return None
        return self.graph[name]

    def _import_at(self, line: int, col: int) -> ModuleEnv | None:
        if self.env is None:
            return None
        for imp in self.env.tree.imports:
            lo = imp.loc
            if lo.line <= line <= (lo.end_line or lo.line):
                ref = self.env.globals.get(imp.alias)
                if isinstance(ref, ModuleRef):
                    return ref.module
        return None

    # -- go to definition -----------------------------------------------------------------
    def definition(self, line: int, col: int) -> SourceLoc | None:
        for e in self._at(line, col):
            if e.definition is not None:
                return e.definition
        imp = self._import_at(line, col)
        if imp is not None:
            return SourceLoc(imp.file, 1, 1)
        # a file that does not elaborate (a library of blocks): resolve the name statically
        word = _word_at(self.text, line, col)
        if self.env is not None and word:
            v = self.env.globals.get(word)
            if isinstance(v, BlockRef):
                return v.block.loc
            mod, _, attr = _dotted_at(self.text, line, col).rpartition(".")
            ref = self.env.globals.get(mod)
            if isinstance(ref, ModuleRef) and isinstance(ref.module.globals.get(attr),
                                                         BlockRef):
                return ref.module.globals[attr].block.loc
        return None

    # -- outline ----------------------------------------------------------------------------
    def symbols(self) -> list[Symbol]:
        if self.env is None:
            return []
        from netdsl.frontend.parser import parse_tree
        tree = parse_tree(self.text, self.file)
        spans = {}
        for t in tree.children:
            if hasattr(t, "meta") and not t.meta.empty:
                m = t.meta
                spans[(t.data, m.line)] = (m.line, m.column, m.end_line, m.end_column)
        out = []

        def span(kind, loc):
            for (k, _line), r in spans.items():
                if k == kind and r[0] <= loc.line <= r[2]:
                    return r
            return (loc.line, loc.column, loc.end_line or loc.line, loc.end_column or 1)

        for b in self.env.tree.blocks:
            out.append(Symbol(b.name, "block", block_signature(b), span("block_def", b.loc),
                              b.loc))
        for n in self.env.tree.networks:
            kids = [Symbol(s.name, "input", f"{s.dtype}[...]",
                           (s.loc.line, s.loc.column, s.loc.end_line or s.loc.line,
                            s.loc.end_column or s.loc.column + 1), s.loc)
                    for s in n.body if isinstance(s, ast.InputDecl)]
            out.append(Symbol(n.name, "network", "network", span("network_def", n.loc), n.loc,
                              kids))
        t = self.env.tree.train
        if t is not None:
            out.append(Symbol("train", "train", "training settings", span("train_def", t.loc),
                              t.loc))
        return sorted(out, key=lambda s: s.range)

    def completions(self, line: int, col: int, text: str | None = None) -> list[Completion]:
        """What may be typed at (line, col) of `text` (the current, maybe broken, text;
        this analysis may be of an older version that parsed)."""
        return completions(self.env, self.text if text is None else text, line, col)


def same_file(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def _word_at(text: str, line: int, col: int) -> str:
    lines = text.split("\n")
    if not 1 <= line <= len(lines):
        return ""
    s = lines[line - 1]
    for m in re.finditer(r"[A-Za-z_]\w*", s):
        if m.start() <= col - 1 <= m.end():
            return m.group()
    return ""


def _dotted_at(text: str, line: int, col: int) -> str:
    lines = text.split("\n")
    if not 1 <= line <= len(lines):
        return ""
    for m in re.finditer(r"[A-Za-z_][\w.]*", lines[line - 1]):
        if m.start() <= col - 1 <= m.end():
            return m.group()
    return ""
