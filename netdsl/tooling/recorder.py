"""The elaborator, noting what each name and call of the source evaluated to: the index
behind hover and go to definition (`netdsl.tooling.analysis`)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from netdsl.errors import SourceLoc, source_line
from netdsl.frontend import ast
from netdsl.frontend.elaborate import Elaborator
from netdsl.frontend.modules import ModuleEnv
from netdsl.frontend.values import BlockRef, ModuleRef, OpRef


@dataclass
class Entry:
    """What a range of the source refers to."""

    loc: SourceLoc
    kind: str  # value | call | block-call | input
    value: object = None
    detail: dict = field(default_factory=dict)
    definition: SourceLoc | None = None
    count: int = 1


class Recorder(Elaborator):
    """The elaborator, noting for each name and call in the source what it evaluated to."""

    errors_first = False  # (every copy of a repeat noted, as the hover counts say)

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

    def emit(self, op, tensors, attrs, loc, shared=None):
        t = super().emit(op, tensors, attrs, loc, shared=shared)
        self.note(loc, "call", t, op=op, node=t.node)
        return t

    def call_block(self, ref, args, kwargs, e):
        first = len(self.g.nodes)
        r = super().call_block(ref, args, kwargs, e)
        self.note(e.loc, "block-call", r, ref.block.loc, block=ref.block,
                  nodes=[n.name for n in self.g.nodes[first:]])
        return r

