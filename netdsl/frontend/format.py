"""`netdsl fmt`: the one canonical layout of a `.net` file (see docs/language.md, section
"Formatting"). Works on Lark's parse tree, which keeps every token's text (so `1_000`,
`1e-3` and `[a, b]` stay as written), and puts back the comments the grammar ignores.

The layout: 4-space indentation; one statement per line (`;` dropped); a blank line
between top-level definitions and at most one where the source had some; spaces around
binary operators and after commas, none around `=` of a keyword argument; a statement's
annotations on the line before it; `train` and `parallel` one setting per line with the
`=` aligned; a call too long for 100 columns breaks after its `(`, then one argument per
line with a trailing comma; a long `if ... then ... else ...` breaks before `else`.
Parentheses are only where the precedence needs them.

Comments stay where they were: before a statement or definition, at the end of its line,
or at the end of a body; between the arguments of a call (items of a tuple, parameters of
a block) after its argument, that list then one item per line. A comment elsewhere inside
a statement (`a +  # why` and `b` on the next line) moves to the line before it.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from lark import Tree

from netdsl.frontend.layout import HARD, LINE, SOFT, Align, Group, IfBreak, Nest, render
from netdsl.frontend.parser import parse, parse_tree

WIDTH = 100
INDENT = 4

# strings first, so a `#` inside one is not a comment (neither can span lines)
_COMMENT_RE = re.compile(r'"(?:[^"\\\n]|\\.)*"?|#[^\n]*')


@dataclass(frozen=True)
class _Comment:
    pos: int
    text: str


# precedence levels of the grammar's expression rules; a child printed where a higher
# level is needed gets parentheses
_ATOM, _POSTFIX, _POWER, _UNARY, _PRODUCT, _SUM, _COMPARE = 10, 9, 8, 7, 6, 5, 4
_NOT, _AND, _OR, _EXPR = 3, 2, 1, 0
_BINOP_LEVEL = {"ADD_OP": _SUM, "MUL_OP": _PRODUCT, "POW": _POWER}
_LITERALS = {"true": "true", "false": "false", "none": "none"}


def _join(docs: list, sep) -> list:
    out: list = []
    for i, d in enumerate(docs):
        if i:
            out.append(sep)
        out.append(d)
    return out


class _Formatter:
    def __init__(self, text: str):
        self.text = text
        self.comments = [_Comment(m.start(), m.group().rstrip())
                         for m in _COMMENT_RE.finditer(text) if m.group().startswith("#")]
        self.starts = [c.pos for c in self.comments]
        self.used = [False] * len(self.comments)
        self.depth = 0  # of the statements being laid out
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", text)]

    # -- positions and comments -------------------------------------------------------------
    def line(self, pos: int) -> int:
        return bisect.bisect_right(self.line_starts, pos)

    def take(self, lo: int, hi: int) -> list[_Comment]:
        """The comments starting in [lo, hi) not yet placed; they are placed by the caller."""
        out = []
        for k in range(bisect.bisect_left(self.starts, lo), len(self.comments)):
            c = self.comments[k]
            if c.pos >= hi:
                break
            if not self.used[k]:
                self.used[k] = True
                out.append(c)
        return out

    def has_comment(self, lo: int, hi: int) -> bool:
        k = bisect.bisect_left(self.starts, lo)
        return k < len(self.starts) and self.starts[k] < hi

    def blank_between(self, a: int, b: int) -> bool:
        """Whether the source has an empty line between offsets a and b."""
        return self.text.count("\n", a, b) >= 2

    def brace_after(self, pos: int, brace: str = "{") -> int:
        """The offset of the `brace` after `pos`, past blanks and comments."""
        while True:
            ch = self.text[pos]
            if ch == brace:
                return pos
            if ch == "#":
                pos = self.text.index("\n", pos)
            pos += 1

    # -- statement lists ------------------------------------------------------------------
    def items(self, nodes: list, lo: int, hi: int, top: bool = False, pad: int = 0) -> list:
        """A list of statements (or top-level items, or settings) with their comments, as
        docs separated by hard line breaks; the comments in [lo, hi) are placed here."""
        nodes = [n for n in nodes if isinstance(n, Tree) and n.data != "empty"]
        laid = []  # per node: its comments before, its doc, its comment after
        prev_end = lo
        for i, n in enumerate(nodes):
            start, end = n.meta.start_pos, n.meta.end_pos
            leading = self.take(prev_end, start)
            doc = self.node(n, pad)
            leading += self.take(start, end)  # inside the statement, not in a body of it
            limit = nodes[i + 1].meta.start_pos if i + 1 < len(nodes) else hi
            after = None
            k = bisect.bisect_left(self.starts, end)
            if k < len(self.comments) and not self.used[k] and self.comments[k].pos < limit \
                    and self.line(self.comments[k].pos) == self.line(end - 1):
                after = self.take(self.comments[k].pos, self.comments[k].pos + 1)[0]
            prev_end = after.pos + len(after.text) if after else end
            laid.append([n, leading, doc, after, prev_end])
        if not top:
            for i, line in self.aligned_calls(laid).items():
                laid[i][2] = line
        out: list = []
        prev_end, prev_kind = None, None  # where the last thing printed ends
        for n, leading, doc, after, end in laid:
            kind = n.data
            # top level: a blank line between definitions, imports may stay together
            force_blank = top and prev_kind not in (None, "comment") and not (
                kind.startswith("import") and prev_kind.startswith("import"))
            for c in leading:
                self._sep(out, prev_end, c.pos, force_blank, top)
                out.append(c.text)
                prev_end, prev_kind, force_blank = c.pos + len(c.text), "comment", False
            self._sep(out, prev_end, n.meta.start_pos, force_blank, top)
            out.append(doc)
            if after is not None:
                out.append("  " + after.text)
            prev_end, prev_kind = end, kind
        for c in self.take(lo if prev_end is None else prev_end, hi):  # end of the body
            self._sep(out, prev_end, c.pos, False, top)
            out.append(c.text)
            prev_end = c.pos + len(c.text)
        return out

    def aligned_calls(self, laid: list) -> dict[int, str]:
        """Lines like `h = stage(h, width=64,  blocks=3)` in a run of assignments from
        calls of the same callee, arguments of the same names: each argument column padded
        to its widest, when every line of the run then fits. {index in `laid`: its line}.
        A comment or a blank line before a statement ends a run."""
        rows: dict[int, tuple] = {}
        for i, (n, _, doc, _, _) in enumerate(laid):
            if n.data != "assign" or n.children[-1].data != "call" or _flat(doc) is None:
                continue
            *targets, call = n.children
            func, arglist = call.children
            args = arglist.children if arglist is not None else []
            keys = tuple(str(a.children[0]) if isinstance(a, Tree) and a.data == "kwarg"
                         else None for a in args)
            texts = [_flat(d) for d in self.arg_docs(arglist)]
            head = ", ".join(map(str, targets)) + " = " + _flat(self.expr(func, _POSTFIX))
            if any(t is None for t in texts):
                continue
            rows[i] = (head, keys, texts)
        runs, run = [], []
        for i in range(len(laid)):
            n = laid[i][0]
            ok = i in rows and run and run[-1] == i - 1 and rows[i][0] == rows[run[0]][0] \
                and _compatible(rows[i][1], rows[run[0]][1]) and not laid[i][1] \
                and not self.blank_between(laid[i - 1][4], n.meta.start_pos)
            if ok:
                run.append(i)
                continue
            if len(run) >= 2:
                runs.append(run)
            run = [i] if i in rows else []
        if len(run) >= 2:
            runs.append(run)
        out: dict[int, str] = {}
        for run in runs:
            ncols = max(len(rows[i][2]) for i in run)
            widths = [max((len(rows[i][2][k]) + 1 for i in run if k < len(rows[i][2]) - 1),
                          default=0) for k in range(ncols)]
            lines = {}
            for i in run:
                head, _, texts = rows[i]
                cells = [(t + ",").ljust(widths[k] + 1) if k < len(texts) - 1 else t
                         for k, t in enumerate(texts)]
                lines[i] = head + "(" + "".join(cells).rstrip() + ")"
            if max(len(x) for x in lines.values()) + INDENT * self.depth <= WIDTH:
                out.update(lines)
        return out

    def _sep(self, out: list, prev_end: int | None, start: int, force_blank: bool,
             top: bool) -> None:
        if prev_end is None:
            if not top:
                out.append(HARD)
            return
        out.append(HARD)
        if force_blank or self.blank_between(prev_end, start):
            out.append(HARD)

    def body(self, nodes: list, open_pos: int, close_pos: int, pad: int = 0) -> list:
        """`{`, the statements indented, `}`; a comment after the `{` stays on its line."""
        head: list = ["{"]
        nl = self.text.find("\n", open_pos)
        nl = close_pos if nl < 0 else min(nl, close_pos)
        first = [c for c in self.comments if open_pos < c.pos < nl
                 and not self.text[open_pos + 1:c.pos].strip()]
        if first:
            self.take(first[0].pos, first[0].pos + 1)
            head.append("  " + first[0].text)
        self.depth += 1
        inner = self.items(nodes, open_pos + 1, close_pos, pad=pad)
        self.depth -= 1
        if not inner:
            return head + ([HARD, "}"] if first else ["}"])
        return head + [Nest(INDENT, inner), HARD, "}"]

    def block_body(self, t: Tree) -> list:
        return self.body(t.children, t.meta.start_pos, t.meta.end_pos - 1)

    def settings_body(self, t: Tree, settings: list, after: int) -> list:
        names = [len(str(s.children[0])) for s in settings if isinstance(s, Tree)]
        return self.body(settings, self.brace_after(after), t.meta.end_pos - 1,
                         pad=max(names, default=0))

    # -- statements and definitions -------------------------------------------------------
    def node(self, t: Tree, pad: int = 0):
        return getattr(self, "n_" + t.data)(t, pad)

    def n_import_module(self, t, pad):
        name, alias = t.children
        return f"import {name}" + (f" as {alias}" if alias is not None else "")

    def n_import_file(self, t, pad):
        path, alias = t.children
        return f"import {path} as {alias}"

    def annotations(self, t: Tree | None) -> list:
        if t is None:
            return []
        return [_join([self.annotation(a) for a in t.children], " "), HARD]

    def annotation(self, t: Tree):
        name, arglist = t.children
        if arglist is None:
            return "@" + name
        return ["@", str(name), self.args(arglist, self.brace_after(name.end_pos, "("),
                                          t.meta.end_pos - 1)]

    def n_block_def(self, t, pad):
        anns, name, params, body = t.children
        ps, spans = [], None
        if params is not None:
            ps = [self.param(p) for p in params.children]
            spans = (self.brace_after(name.end_pos, "("),
                     self.brace_after(params.meta.end_pos, ")"), params.children)
        return self.annotations(anns) + ["block ", str(name),
                                         self.bracketed("(", ps, ")", spans=spans),
                                         " ", self.block_body(body)]

    def param(self, t: Tree):
        name, default = t.children
        return str(name) if default is None else [str(name), "=", self.expr(default)]

    def n_network_def(self, t, pad):
        anns, name, *stmts = t.children
        body = self.body(stmts, self.brace_after(name.end_pos), t.meta.end_pos - 1)
        return self.annotations(anns) + ["network ", str(name), " ", body]

    def n_train_def(self, t, pad):
        return ["train ", self.settings_body(t, t.children, t.meta.start_pos + len("train"))]

    def n_parallel_decl(self, t, pad):
        return ["parallel ", self.settings_body(t, t.children,
                                                t.meta.start_pos + len("parallel"))]

    def n_setting(self, t, pad):
        name, value = t.children
        return [str(name).ljust(pad), " = ", self.expr(value)]

    def n_annotated_stmt(self, t, pad):
        anns, stmt = t.children
        return self.annotations(anns) + [self.node(stmt)]

    def n_input_decl(self, t, pad):
        name, ttype = t.children
        dtype, *dims = ttype.children
        dims = [self.expr(d) for d in dims if d is not None]
        return ["input ", str(name), ": ", str(dtype), "[", _join(dims, ", "), "]"]

    def _values(self, keyword: str, values: list):
        docs = [self.expr(v) for v in values]
        if len(docs) == 1:
            return [keyword, " ", docs[0]]
        return Group([keyword, " ", Align(_join(docs, [",", LINE]))])

    def n_output_decl(self, t, pad):
        return self._values("output", t.children)

    def n_return_stmt(self, t, pad):
        return self._values("return", t.children)

    def n_loss_decl(self, t, pad):
        return ["loss ", self.expr(t.children[0])]

    def n_assign(self, t, pad):
        *targets, value = t.children
        return [", ".join(map(str, targets)), " = ", self.expr(value)]

    def n_repeat_stmt(self, t, pad):
        count, var, body = t.children
        return ["repeat ", self.expr(count), f" as {var}" if var is not None else "", " ",
                self.block_body(body)]

    def n_if_stmt(self, t, pad):
        test, body, orelse = t.children
        out = ["if ", self.expr(test), " ", self.block_body(body)]
        if orelse is not None:
            out += [" else ", self.block_body(orelse) if orelse.data == "body"
                    else self.node(orelse)]
        return out

    # -- expressions ----------------------------------------------------------------------
    def bracketed(self, open_: str, docs: list, close: str, comma: bool = False,
                  spans: tuple | None = None):
        """`(a, b)`: on one line if it fits, else the items on the next line, else one
        per line with a trailing comma. `comma`: a trailing comma even on one line.
        `spans`: (offset of the opening bracket, of the closing one, the item trees), to
        keep the comments between the items; then it is one item per line."""
        if not docs:
            return open_ + close
        if spans is not None:
            laid = self._with_comments(docs, *spans)
            if laid is not None:
                return [open_, Nest(INDENT, laid), HARD, close]
        items = Group(_join(docs, [",", LINE]) + [IfBreak(",", "," if comma else "")])
        return Group([open_, Nest(INDENT, [SOFT, items]), SOFT, close])

    def _with_comments(self, docs: list, open_pos: int, close_pos: int, trees: list):
        """One item per line, each comment between the items after the item it follows on
        its line, or on a line of its own before the next; None if there are none."""
        trees = [t for t in trees if t is not None]
        bounds = [(t.meta.start_pos, t.meta.end_pos) for t in trees]
        found = [(k, c) for k, c in enumerate(self.comments) if not self.used[k]
                 and open_pos < c.pos < close_pos
                 and not any(a <= c.pos < b for a, b in bounds)]
        if not found:
            return None
        leading: dict[int, list[str]] = {}
        trailing: dict[int, str] = {}
        for k, c in found:
            self.used[k] = True
            before = [i for i, (_, b) in enumerate(bounds) if b <= c.pos]
            i = before[-1] if before else None
            if i is not None and i not in trailing and self.line(c.pos) == \
                    self.line(bounds[i][1] - 1):
                trailing[i] = c.text
            else:
                leading.setdefault(i + 1 if i is not None else 0, []).append(c.text)
        out: list = []
        for i, d in enumerate(docs):
            for text in leading.get(i, []):
                out += [HARD, text]
            out += [HARD, d, ","]
            if i in trailing:
                out.append("  " + trailing[i])
        for text in leading.get(len(docs), []):
            out += [HARD, text]
        return out

    def args(self, arglist: Tree | None, open_pos: int | None = None,
             close_pos: int | None = None):
        spans = (open_pos, close_pos, arglist.children) \
            if arglist is not None and open_pos is not None else None
        return self.bracketed("(", self.arg_docs(arglist), ")", spans=spans)

    def arg_docs(self, arglist: Tree | None) -> list:
        docs = []
        for a in arglist.children if arglist is not None else ():
            if isinstance(a, Tree) and a.data == "kwarg":
                docs.append([str(a.children[0]), "=", self.expr(a.children[1])])
            else:
                docs.append(self.expr(a))
        return docs

    def expr(self, t, need: int = _EXPR):
        doc, level = self._expr(t)
        return ["(", doc, ")"] if level < need else doc

    def _expr(self, t):
        d = t.data
        c = t.children
        if d in ("name", "int_", "float_", "string"):
            return str(c[0]), _ATOM
        if d in _LITERALS:
            return _LITERALS[d], _ATOM
        if d == "tuple_":
            items = [self.expr(x) for x in c if x is not None]
            spans = (t.meta.start_pos, t.meta.end_pos - 1, c)
            if self.text[t.meta.start_pos] == "[":
                return self.bracketed("[", items, "]", spans=spans), _ATOM
            return self.bracketed("(", items, ")", comma=len(items) == 1, spans=spans), _ATOM
        if d == "call":
            func = self.expr(c[0], _POSTFIX)
            # the `(` after the callee; `(f)(x)`: past the callee's own `)`
            after = c[0].meta.end_pos
            return [func, self.args(c[1], self.brace_after(after, "("),
                                    t.meta.end_pos - 1)], _POSTFIX
        if d == "index":
            return [self.expr(c[0], _POSTFIX), "[", self.expr(c[1]), "]"], _POSTFIX
        if d == "attr":
            obj = c[0]
            # `(1).x` must keep its parentheses: `1.x` lexes as the number `1.`
            need = _ATOM + 1 if obj.data in ("int_", "float_") else _POSTFIX
            return [self.expr(obj, need), ".", str(c[1])], _POSTFIX
        if d == "binop":
            op = c[1]
            level = _BINOP_LEVEL[op.type]
            if op.type == "POW":
                return self._binary(c[0], str(op), c[2], level, _POSTFIX, _UNARY)
            return self._binary(c[0], str(op), c[2], level, level, level + 1)
        if d == "compare":
            return self._binary(c[0], str(c[1]), c[2], _COMPARE, _SUM, _SUM)
        if d == "and_":
            return self._binary(c[0], "and", c[1], _AND, _AND, _NOT)
        if d == "or_":
            return self._binary(c[0], "or", c[1], _OR, _OR, _AND)
        if d == "neg":
            return ["-", self.expr(c[0], _UNARY)], _UNARY
        if d == "not_":
            return ["not ", self.expr(c[0], _NOT)], _NOT
        if d == "cond":
            test, then, orelse = (self.expr(c[0], _OR), self.expr(c[1]), self.expr(c[2]))
            return Align(Group(["if ", test, " then ", then, LINE, "else ", orelse])), _EXPR
        raise AssertionError(f"unknown expression {d}")  # pragma: no cover

    def _binary(self, left, op: str, right, level: int, lneed: int, rneed: int):
        doc = Group([self.expr(left, lneed), " ", op, Nest(INDENT, [LINE,
                                                                   self.expr(right, rneed)])])
        return doc, level


def _flat(doc) -> str | None:
    """`doc` on one line, or None if it cannot be (it holds a hard break)."""
    text = render(Group(doc), width=10**9)
    return None if "\n" in text else text


def _compatible(a: tuple, b: tuple) -> bool:
    """Argument lists that line up: the same keyword (or positional) at each shared place."""
    return all(x == y for x, y in zip(a, b))


def format_source(text: str, file: str = "<string>") -> str:
    """The canonical layout of `text`. Raises NetdslError if it does not parse (the same
    error `netdsl check` gives), so a broken file is never rewritten."""
    parse(text, file)  # every syntax error, located, as the checker reports it
    tree = parse_tree(text, file)
    f = _Formatter(text)
    doc = f.items(tree.children, 0, len(text), top=True)
    leftover = [c for c, used in zip(f.comments, f.used) if not used]
    assert not leftover, f"comments not placed: {leftover}"  # a formatter bug, not the user's
    out = render(doc, WIDTH).strip("\n")
    return out + "\n" if out else ""
