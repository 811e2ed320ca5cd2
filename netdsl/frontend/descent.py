"""A hand-written recursive-descent parser for programs without errors: the fast path.

Lark's LALR parser makes a reduction callback per precedence level, several per token,
each propagating positions, which makes a big file slow to parse. This parser follows
`grammar/netdsl.lark` rule by rule, one function per precedence level, and builds the
same AST with the same locations (a node spans its first to its last token; a call points
at its callee) directly from a token list.

It owns no error message: on anything it does not accept (a syntax error, a too-large
number, a bad escape, a keyword argument before a positional one, nesting that might pass
MAX_NESTING, a recursion limit) it gives up and `parse` runs the Lark parser, which
reports the error. tests/test_descent.py checks that both parsers give
equal ASTs on every program in the repository and on generated ones.
"""
from __future__ import annotations

import math
import re
from bisect import bisect_right

from netdsl.errors import SourceLoc
from netdsl.frontend import ast
from netdsl.frontend.deep import MAX_NESTING
from netdsl.frontend.strings import unescape
from netdsl.ir.registry import INT_MAX


class GiveUp(Exception):
    """The fast parser does not accept this text; the Lark parser decides."""


_KEYWORDS = frozenset(("import", "as", "block", "network", "input", "output", "loss",
                       "parallel", "train", "repeat", "if", "then", "else", "return", "and",
                       "or", "not", "true", "false", "none"))
# atomic: a comment must not give back characters for a token to match
_SKIP = r"(?>[ \t\r\n\f]*(?:\#[^\n]*[ \t\r\n\f]*)*)"  # \# for re.VERBOSE
# the grammar's terminals; FLOAT before INT, two-character operators before their
# prefixes, as Lark's lexer orders them
_TOKEN = re.compile(_SKIP + r"""(?:
    (?P<NAME>[A-Za-z_][A-Za-z_0-9]*)
  | (?P<FLOAT>(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+)
  | (?P<INT>[0-9][0-9_]*)
  | (?P<STRING>"(?:[^"\\\n]|\\.)*")
  | (?P<OP>\*\*|//|==|!=|<=|>=|[-+*/%<>=(){}\[\],.:;@])
)""", re.VERBOSE)
_TRAILER = re.compile(_SKIP)
_COMP = frozenset(("==", "!=", "<=", ">=", "<", ">"))
_MUL = frozenset(("*", "//", "/", "%"))
_ADD = frozenset(("+", "-"))
_END = "$END"


def tokenize(text: str) -> tuple[list[str], list[str], list[int]]:
    """Kinds (NAME, INT, FLOAT, STRING, or the keyword or operator itself), texts and start
    offsets of the tokens of `text`, ending with an `$END` token."""
    kinds: list[str] = []
    values: list[str] = []
    starts: list[int] = []
    end = 0
    for m in _TOKEN.finditer(text):
        if m.start() != end:  # a character no terminal matches, or only comments follow
            break
        end = m.end()
        kind = m.lastgroup
        value = m.group(kind)
        if kind == "OP" or (kind == "NAME" and value in _KEYWORDS):
            kind = value
        kinds.append(kind)
        values.append(value)
        starts.append(end - len(value))
    if _TRAILER.match(text, end).end() != len(text):
        raise GiveUp
    kinds.append(_END)
    values.append("")
    starts.append(len(text))
    return kinds, values, starts


class _Parser:
    def __init__(self, text: str, file: str):
        self.file = file
        self.kinds, self.values, self.starts = tokenize(text)
        self.i = 0
        # offsets of the line starts, for line and column (lines as Lark counts them)
        self.lines = [0] + [m.end() for m in re.finditer("\n", text)]
        self.deepest = 0  # a bound on the parse tree's depth (see _note_depth)

    # -- tokens and locations ------------------------------------------------------------
    def expect(self, kind: str) -> int:
        i = self.i
        if self.kinds[i] != kind:
            raise GiveUp
        self.i = i + 1
        return i

    def name(self) -> int:
        return self.expect("NAME")

    def span(self, first: int, last: int) -> SourceLoc:
        """The location from token `first` to the end of token `last` (no token spans
        lines, so the end is on the line where `last` starts)."""
        lines, starts = self.lines, self.starts
        a, b = starts[first], starts[last]
        la = bisect_right(lines, a)
        lb = la if first == last else bisect_right(lines, b)
        return SourceLoc(self.file, la, a - lines[la - 1] + 1, lb,
                         b - lines[lb - 1] + 1 + len(self.values[last]))

    def tok_loc(self, i: int) -> SourceLoc:
        a = self.starts[i]
        line = bisect_right(self.lines, a)
        col = a - self.lines[line - 1] + 1
        return SourceLoc(self.file, line, col, line, col + len(self.values[i]))

    def _note_depth(self, depth: int, first: int) -> None:
        """Every parse-tree level inside a statement's own expressions has a token of its
        own, so the statement at `depth` nests at most depth + its token count deep."""
        d = depth + self.i - first
        if d > self.deepest:
            self.deepest = d

    # -- expressions ---------------------------------------------------------------------
    def expr(self) -> ast.Expr:
        if self.kinds[self.i] != "if":
            return self.or_expr()
        first = self.i
        self.i += 1
        test = self.or_expr()
        self.expect("then")
        then = self.expr()
        self.expect("else")
        orelse = self.expr()
        return ast.Cond(self.span(first, self.i - 1), test, then, orelse)

    def or_expr(self) -> ast.Expr:
        first = self.i
        left = self.and_expr()
        while self.kinds[self.i] == "or":
            self.i += 1
            right = self.and_expr()
            left = ast.BinOp(self.span(first, self.i - 1), "or", left, right)
        return left

    def and_expr(self) -> ast.Expr:
        first = self.i
        left = self.not_expr()
        while self.kinds[self.i] == "and":
            self.i += 1
            right = self.not_expr()
            left = ast.BinOp(self.span(first, self.i - 1), "and", left, right)
        return left

    def not_expr(self) -> ast.Expr:
        if self.kinds[self.i] != "not":
            return self.comparison()
        first = self.i
        self.i += 1
        operand = self.not_expr()
        return ast.Unary(self.span(first, self.i - 1), "not", operand)

    def comparison(self) -> ast.Expr:
        first = self.i
        left = self.sum()
        op = self.kinds[self.i]
        if op not in _COMP:
            return left
        self.i += 1
        right = self.sum()
        return ast.BinOp(self.span(first, self.i - 1), op, left, right)

    def sum(self) -> ast.Expr:
        first = self.i
        left = self.product()
        kinds = self.kinds
        while kinds[self.i] in _ADD:
            op = kinds[self.i]
            self.i += 1
            right = self.product()
            left = ast.BinOp(self.span(first, self.i - 1), op, left, right)
        return left

    def product(self) -> ast.Expr:
        first = self.i
        left = self.unary()
        kinds = self.kinds
        while kinds[self.i] in _MUL:
            op = kinds[self.i]
            self.i += 1
            right = self.unary()
            left = ast.BinOp(self.span(first, self.i - 1), op, left, right)
        return left

    def unary(self) -> ast.Expr:
        if self.kinds[self.i] != "-":
            return self.power()
        first = self.i
        self.i += 1
        operand = self.unary()
        return ast.Unary(self.span(first, self.i - 1), "-", operand)

    def power(self) -> ast.Expr:
        first = self.i
        base = self.postfix()
        if self.kinds[self.i] != "**":
            return base
        self.i += 1
        exponent = self.unary()
        return ast.BinOp(self.span(first, self.i - 1), "**", base, exponent)

    def postfix(self) -> ast.Expr:
        first = self.i
        node = self.atom()
        kinds = self.kinds
        while True:
            k = kinds[self.i]
            if k == "(":
                self.i += 1
                args, kwargs = self.arglist(")")
                self.expect(")")
                node = ast.Call(node.loc, node, args, kwargs)  # at the callee, as Lark's
            elif k == "[":
                self.i += 1
                index = self.expr()
                self.expect("]")
                node = ast.Index(self.span(first, self.i - 1), node, index)
            elif k == ".":
                self.i += 1
                attr = self.values[self.name()]
                node = ast.Attr(self.span(first, self.i - 1), node, attr)
            else:
                return node

    def atom(self) -> ast.Expr:
        i = self.i
        k = self.kinds[i]
        self.i = i + 1
        if k == "NAME":
            return ast.Name(self.tok_loc(i), self.values[i])
        if k == "INT":
            v = int(self.values[i].replace("_", ""))
            if v > INT_MAX:
                raise GiveUp
            return ast.Const(self.tok_loc(i), v)
        if k == "FLOAT":
            v = float(self.values[i])
            if math.isinf(v):
                raise GiveUp
            return ast.Const(self.tok_loc(i), v)
        if k == "STRING":
            return ast.Const(self.tok_loc(i), _unescape(self.values[i]))
        if k == "true":
            return ast.Const(self.tok_loc(i), True)
        if k == "false":
            return ast.Const(self.tok_loc(i), False)
        if k == "none":
            return ast.Const(self.tok_loc(i), None)
        if k == "(":
            inner = self.expr()
            if self.kinds[self.i] == ")":
                self.i += 1
                return inner
            self.expect(",")
            items = [inner] + self.items(")")
            self.expect(")")
            return ast.TupleExpr(self.span(i, self.i - 1), tuple(items))
        if k == "[":
            items = self.items("]")
            self.expect("]")
            return ast.TupleExpr(self.span(i, self.i - 1), tuple(items))
        raise GiveUp

    def items(self, close: str) -> list[ast.Expr]:
        """`[expr ("," expr)* ","?]` up to (not including) `close`."""
        out: list[ast.Expr] = []
        while self.kinds[self.i] != close:
            out.append(self.expr())
            if self.kinds[self.i] != ",":
                break
            self.i += 1
        return out

    def arglist(self, close: str):
        """`[argument ("," argument)* ","?]` up to `close`: positional and keyword args."""
        args: list[ast.Expr] = []
        kwargs: list[tuple] = []
        kinds = self.kinds
        while kinds[self.i] != close:
            i = self.i
            if kinds[i] == "NAME" and kinds[i + 1] == "=":
                self.i = i + 2
                kwargs.append((self.values[i], self.expr(), self.tok_loc(i)))
            else:
                if kwargs:  # positional after keyword: Lark's path says so
                    raise GiveUp
                args.append(self.expr())
            if kinds[self.i] != ",":
                break
            self.i += 1
        return tuple(args), tuple(kwargs)

    # -- statements ----------------------------------------------------------------------
    def annotations(self) -> tuple[ast.Annotation, ...]:
        out = []
        while self.kinds[self.i] == "@":
            first = self.i
            self.i += 1
            name = self.values[self.name()]
            args, kwargs = (), ()
            if self.kinds[self.i] == "(":
                self.i += 1
                args, kwargs = self.arglist(")")
                self.expect(")")
            out.append(ast.Annotation(name, args, kwargs, self.span(first, self.i - 1)))
        return tuple(out)

    def body(self, depth: int) -> tuple[ast.Stmt, ...]:
        self.expect("{")
        out = []
        kinds = self.kinds
        while kinds[self.i] != "}":
            s = self.stmt(depth)
            if s is not None:
                out.append(s)
        self.i += 1
        return tuple(out)

    def stmt(self, depth: int) -> ast.Stmt | None:
        """`_stmt` at parse-tree depth `depth`: an annotated statement or a statement."""
        first = self.i
        if self.kinds[first] == "@":
            anns = self.annotations()
            self._note_depth(depth, first)
            s = self.simple_stmt(depth + 1)
            if s is None:  # "an annotation must be followed by a statement"
                raise GiveUp
            return _annotate(s, anns)
        return self.simple_stmt(depth)

    def simple_stmt(self, depth: int) -> ast.Stmt | None:
        first = self.i
        k = self.kinds[first]
        if k == "NAME":
            targets = [self.values[first]]
            self.i += 1
            while self.kinds[self.i] == ",":
                self.i += 1
                targets.append(self.values[self.name()])
            self.expect("=")
            value = self.expr()
            self._note_depth(depth, first)
            return ast.Assign(self.tok_loc(first), tuple(targets), value)
        if k == "repeat":
            self.i += 1
            count = self.expr()
            var = None
            if self.kinds[self.i] == "as":
                self.i += 1
                var = self.values[self.name()]
            self._note_depth(depth, first)
            body = self.body(depth + 1)
            return ast.Repeat(self.span(first, self.i - 1), count, var, body)
        if k == "if":
            self.i += 1
            test = self.expr()
            self._note_depth(depth, first)
            body = self.body(depth + 1)
            orelse: tuple = ()
            if self.kinds[self.i] == "else":
                self.i += 1
                if self.kinds[self.i] == "if":
                    orelse = (self.simple_stmt(depth + 1),)
                else:
                    orelse = self.body(depth + 1)
            return ast.If(self.span(first, self.i - 1), test, body, orelse)
        if k == "return":
            self.i += 1
            values = self.expr_list()
            self._note_depth(depth, first)
            return ast.Return(self.span(first, self.i - 1), values)
        if k == ";":
            self.i += 1
            return None
        raise GiveUp

    def expr_list(self) -> tuple[ast.Expr, ...]:
        """expr ("," expr)*, no trailing comma."""
        out = [self.expr()]
        while self.kinds[self.i] == ",":
            self.i += 1
            out.append(self.expr())
        return tuple(out)

    def net_stmt(self, depth: int) -> ast.Stmt | None:
        first = self.i
        k = self.kinds[first]
        if k == "input":
            self.i += 1
            name = self.name()
            self.expect(":")
            dtype = self.name()
            self.expect("[")
            dims = self.items("]")
            self.expect("]")
            self._note_depth(depth, first)
            return ast.InputDecl(self.tok_loc(name), self.values[name], self.values[dtype],
                                 tuple(dims), self.tok_loc(dtype))
        if k == "output":
            self.i += 1
            values = self.expr_list()
            self._note_depth(depth, first)
            return ast.OutputDecl(self.span(first, self.i - 1), values)
        if k == "loss":
            self.i += 1
            value = self.expr()
            self._note_depth(depth, first)
            return ast.LossDecl(self.span(first, self.i - 1), value)
        if k == "parallel":
            self.i += 1
            settings = self.settings(depth + 1)
            return ast.ParallelDecl(self.span(first, self.i - 1), settings)
        return self.stmt(depth)

    def settings(self, depth: int) -> tuple[ast.Setting, ...]:
        self.expect("{")
        out = []
        while self.kinds[self.i] != "}":
            first = self.name()
            self.expect("=")
            value = self.expr()
            if self.kinds[self.i] == ";":
                self.i += 1
            self._note_depth(depth, first)
            out.append(ast.Setting(self.values[first], value, self.tok_loc(first)))
        self.i += 1
        return tuple(out)

    # -- top level -----------------------------------------------------------------------
    def module(self) -> list:
        items: list = []
        kinds = self.kinds
        while kinds[self.i] != _END:
            first = self.i
            k = kinds[first]
            if k == ";":
                self.i += 1
            elif k == "import":
                items.append(self.import_stmt())
            elif k == "train":
                self.i += 1
                settings = self.settings(3)
                items.append(ast.TrainDef(settings, self.span(first, self.i - 1)))
            else:
                anns = self.annotations()
                self._note_depth(2, first)
                k = kinds[self.i]
                if k == "block":
                    items.append(self.block_def(anns))
                elif k == "network":
                    self.i += 1
                    name = self.name()
                    self.expect("{")
                    body = []
                    while kinds[self.i] != "}":
                        s = self.net_stmt(3)
                        if s is not None:
                            body.append(s)
                    self.i += 1
                    items.append(ast.NetworkDef(self.values[name], tuple(body), anns,
                                                self.tok_loc(name)))
                else:
                    raise GiveUp
        return items

    def import_stmt(self) -> ast.Import:
        first = self.i
        self.i += 1
        k = self.kinds[self.i]
        if k == "STRING":
            path = self.values[self.i][1:-1]
            self.i += 1
            self.expect("as")
            alias = self.values[self.name()]
            return ast.Import(None, path, alias, self.span(first, self.i - 1))
        name = self.values[self.name()]
        alias = name
        if self.kinds[self.i] == "as":
            self.i += 1
            alias = self.values[self.name()]
        return ast.Import(name, None, alias, self.span(first, self.i - 1))

    def block_def(self, anns) -> ast.BlockDef:
        self.i += 1
        name = self.name()
        self.expect("(")
        params: list[ast.Param] = []
        seen: set[str] = set()
        while self.kinds[self.i] != ")":
            first = self.name()
            default = None
            if self.kinds[self.i] == "=":
                self.i += 1
                default = self.expr()
            pname = self.values[first]
            if pname in seen:  # "two parameters named ...": Lark's path says so
                raise GiveUp
            seen.add(pname)
            self._note_depth(3, first)
            params.append(ast.Param(pname, default, self.tok_loc(first)))
            if self.kinds[self.i] != ",":
                break
            self.i += 1
        self.expect(")")
        body = self.body(3)
        return ast.BlockDef(self.values[name], tuple(params), body, anns,
                            self.tok_loc(name), self.file)


def _annotate(stmt: ast.Stmt, anns: tuple) -> ast.Stmt:
    from dataclasses import replace
    return replace(stmt, annotations=anns + stmt.annotations)


def _unescape(literal: str) -> str:
    return unescape(literal, lambda i, ch: GiveUp())  # Lark's path says where and why


# parse trees deeper than this go to Lark's path, which refuses them past MAX_NESTING at
# the exact level; the bound above is within a factor of two of the real depth
_DEPTH_LIMIT = MAX_NESTING // 2


def parse_items(text: str, file: str) -> list | None:
    """The top-level items (imports, blocks, networks, train sections) of `text` as the
    Lark path builds them, or None where that path must decide (an error, deep nesting)."""
    try:
        p = _Parser(text, file)
        items = p.module()
    except (GiveUp, RecursionError, IndexError):
        return None
    if p.deepest > _DEPTH_LIMIT:
        return None
    return items
