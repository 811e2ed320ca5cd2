"""What an editor asks about a `.net` file, answered from the checker: its errors (the
same as `netdsl check`), what the name under the cursor is (a tensor's type and the node
that made it, parameters and FLOPs; a block's signature and doc comment), where it is
defined, what may be typed next, and the outline. No LSP here: `netdsl.tooling.lsp` wraps
this for pygls; positions are 1-based lines and columns, as in `SourceLoc`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from netdsl.errors import Diagnostic, NetdslError, SourceLoc, source_line
from netdsl.frontend import ast, load_module, train_config
from netdsl.frontend.elaborate import Elaborator
from netdsl.frontend.modules import ModuleEnv
from netdsl.frontend.values import POISON, BlockRef, Builtin, ModuleRef, OpRef, Tensor
from netdsl.ir import registry
from netdsl.ir.graph import Graph
from netdsl.ir.stats import fmt_count, fmt_si, summarize
from netdsl.tooling.names import BUILTINS, dtypes, keywords, operators


def _value_text(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if v is None:
        return "none"
    if isinstance(v, str):
        return f'"{v}"' if v != "N" else "N"
    if isinstance(v, tuple):
        return "(" + ", ".join(map(_value_text, v)) + ("," if len(v) == 1 else "") + ")"
    return repr(v)


def op_signature(op: registry.OpDef) -> str:
    parts = []
    for a in op.signature:
        name = f"{a.name}..." if a.kind == "tensors" else a.name
        parts.append(name if a.required else f"{name}={_value_text(a.default)}")
    return f"{op.name}({', '.join(parts)})"


def block_signature(b: ast.BlockDef) -> str:
    parts = []
    for p in b.params:
        parts.append(p.name if p.default is None else f"{p.name}={_expr_text(p.default)}")
    return f"block {b.name}({', '.join(parts)})"


def _expr_text(e: ast.Expr) -> str:
    """The source text of a (short) expression, from its location."""
    loc = e.loc
    line = source_line(loc.file, loc.line) if loc is not None else None
    if line is None or loc.end_line != loc.line or not loc.end_column:
        if isinstance(e, ast.Const):
            return _value_text(e.value)
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


@dataclass
class Entry:
    """What a range of the source refers to."""

    loc: SourceLoc
    kind: str  # value | call | block-call | input
    value: object = None
    detail: dict = field(default_factory=dict)
    definition: SourceLoc | None = None
    count: int = 1


class _Recorder(Elaborator):
    """The elaborator, noting for each name and call in the source what it evaluated to."""

    def __init__(self, module: ModuleEnv, net: ast.NetworkDef, index: dict):
        super().__init__(module, net)
        self.index = index
        self.bound: dict[int, dict[str, SourceLoc]] = {}  # frame -> name -> where bound

    def note(self, loc: SourceLoc | None, kind: str, value=None, definition=None, **detail):
        if loc is None:
            return
        key = (loc.file, loc.line, loc.column, loc.end_line, loc.end_column, kind)
        if key in self.index:
            self.index[key].count += 1  # the same text again: a repeat or another call
            return
        self.index[key] = Entry(loc, kind, value, detail, definition)

    def _definition(self, name: str, frame) -> SourceLoc | None:
        d = self.bound.get(id(frame), {}).get(name)
        if d is not None:
            return d
        if frame.block is not None:  # a block parameter
            ref = frame.module.globals.get(frame.block)
            if isinstance(ref, BlockRef):
                for p in ref.block.params:
                    if p.name == name:
                        return p.loc
        v = frame.module.globals.get(name)
        if isinstance(v, BlockRef):
            return v.block.loc
        if isinstance(v, ModuleRef):
            return SourceLoc(v.module.file, 1, 1)
        return None

    def e_Name(self, e, frame):
        v = super().e_Name(e, frame)
        self.note(e.loc, "value", v, self._definition(e.id, frame), name=e.id,
                  block=frame.block)
        return v

    def e_Attr(self, e, frame):
        v = super().e_Attr(e, frame)
        d = v.block.loc if isinstance(v, BlockRef) else None
        self.note(e.loc, "value", v, d, name=e.name, block=frame.block)
        return v

    def e_Call(self, e, frame):
        try:
            return super().e_Call(e, frame)
        finally:  # the keyword names: what they are arguments of
            f = e.func.loc
            callee = self.index.get((f.file, f.line, f.column, f.end_line, f.end_column,
                                     "value"))
            ref = callee.value if callee is not None else None
            for name, _, kloc in e.kwargs:
                if isinstance(ref, BlockRef):
                    p = next((p for p in ref.block.params if p.name == name), None)
                    if p is not None:
                        self.note(kloc, "argument", ref, p.loc, name=name)
                elif isinstance(ref, OpRef):
                    self.note(kloc, "argument", ref, None, name=name)

    def input_decl(self, st, frame):
        super().input_decl(st, frame)
        self.bound.setdefault(id(frame), {})[st.name] = st.loc
        self.note(st.loc, "value", frame.locals.get(st.name), st.loc, name=st.name)

    def bind(self, st, v, frame):
        try:
            super().bind(st, v, frame)
        finally:
            line = source_line(st.loc.file, st.loc.line) or ""
            col = st.loc.column - 1
            for name in st.targets:
                m = re.compile(r"\b" + re.escape(name) + r"\b").search(line, col)
                if m is None:
                    break
                loc = SourceLoc(st.loc.file, st.loc.line, m.start() + 1, st.loc.line,
                                m.end() + 1)
                col = m.end()
                first = self.bound.setdefault(id(frame), {}).setdefault(name, loc)
                self.note(loc, "value", frame.locals.get(name), first, name=name,
                          block=frame.block)

    def emit(self, op, tensors, attrs, loc):
        t = super().emit(op, tensors, attrs, loc)
        self.note(loc, "call", t, op=op, node=t.node)
        return t

    def call_block(self, ref, args, kwargs, e):
        first = len(self.g.nodes)
        r = super().call_block(ref, args, kwargs, e)
        self.note(e.loc, "block-call", r, ref.block.loc, block=ref.block,
                  nodes=[n.name for n in self.g.nodes[first:]])
        return r


@dataclass
class Symbol:
    name: str
    kind: str  # network | block | train | input
    detail: str
    range: tuple[int, int, int, int]  # line, column, end line, end column (1-based)
    selection: SourceLoc
    children: list[Symbol] = field(default_factory=list)


@dataclass
class Completion:
    label: str
    kind: str  # operator | block | module | keyword | builtin | variable | argument | dtype
    detail: str = ""
    doc: str = ""
    insert: str | None = None


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
            rec = _Recorder(self.env, net, self.index)
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
                    + (f"; {info}" if info else "") + "\n\n" + _op_doc(e.detail["op"]))
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
                default = f" = {_expr_text(p.default)}" if p.default is not None else ""
                return (f"```\n{name}{default}\n```\nparameter of "
                        f"`{block_signature(v.block)}`")
            arg = next((a for a in registry.get(v.name).signature if a.name == name), None)
            if arg is None:
                return ""
            default = "" if arg.required else f" = {_value_text(arg.default)}"
            choices = f"; one of {', '.join(map(_value_text, arg.choices))}" \
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
            return f"```\n{op_signature(registry.get(v.name))}\n```\n\n{_op_doc(v.name)}"
        if isinstance(v, ModuleRef):
            m = v.module
            return f"module `{m.name}` ({m.file})\n\nblocks: " + ", ".join(
                f"`{b.name}`" for b in m.tree.blocks)
        if isinstance(v, Builtin):
            return f"builtin function `{v.name}()`"
        if v is POISON or v is None and e.kind != "value":
            return ""
        return f"```\n{name} = {_value_text(v)}\n```" + (
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

    # -- completion -------------------------------------------------------------------------
    def completions(self, line: int, col: int, text: str | None = None) -> list[Completion]:
        """What may be typed at (line, col) of `text` (the current, maybe broken, text;
        this analysis may be of an older version that parsed)."""
        text = self.text if text is None else text
        lines = text.split("\n")
        before = lines[line - 1][:col - 1] if 1 <= line <= len(lines) else ""
        m = re.search(r"([A-Za-z_]\w*)\.(\w*)$", before)
        if m and self.env is not None:  # `resnet.` : the module's blocks
            ref = self.env.globals.get(m.group(1))
            if isinstance(ref, ModuleRef):
                return [_block_item(b) for b in ref.module.tree.blocks]
            return []
        items: list[Completion] = []
        callee = _open_call(text, line, col)
        if callee is not None:
            items += self._arguments(callee)
        for name, op in operators().items():
            items.append(Completion(name, "operator", op_signature(op), op.doc,
                                    insert=None))
        items += [Completion(b, "builtin", f"{b}(...)") for b in BUILTINS]
        items += [Completion(k, "keyword") for k in keywords()]
        items += [Completion(d, "dtype") for d in dtypes()]
        if self.env is not None:
            for name, v in self.env.globals.items():
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

    def _arguments(self, callee: str) -> list[Completion]:
        mod, _, name = callee.rpartition(".")
        if not mod and name in operators():
            op = operators()[name]
            return [Completion(f"{a.name}=", "argument", f"{a.name}: {a.kind}" + (
                "" if a.required else f" = {_value_text(a.default)}"), op_signature(op))
                for a in op.signature if a.kind not in ("tensor", "tensors")]
        if self.env is None:
            return []
        env = self.env
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
                           f"{p.name} = {_expr_text(p.default)}", sig)
                for p in ref.block.params]


def _op_doc(name: str) -> str:
    op = registry.get(name)
    return f"{op.doc} ({op.layer_type})" if op.doc else f"({op.layer_type})"


def _block_item(b: ast.BlockDef) -> Completion:
    return Completion(b.name, "block", block_signature(b), doc_comment(b))


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
