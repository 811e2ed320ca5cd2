"""Text -> AST. Lark LALR parser; syntax errors become located `NetdslError`s in words."""
from __future__ import annotations

import math
import re
from functools import lru_cache

from lark import Lark, Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from netdsl.errors import NetdslError, SourceLoc, register_source
from netdsl.frontend import ast
from netdsl.frontend.deep import MAX_NESTING
from netdsl.frontend.descent import parse_items
from netdsl.frontend.resources import grammar_text
from netdsl.frontend.strings import unescape
from netdsl.ir.registry import INT_MAX

# Keywords are reserved words. The contextual lexer only tries the terminals the parser can
# accept next, so without this `h = output` would lex `output` as a NAME and the error
# would surface later, somewhere confusing. Re-typing a NAME that spells a keyword makes the
# parser reject it right there ("unexpected keyword `output`; expected an expression").
KEYWORDS = ("import", "as", "block", "network", "input", "output", "loss", "parallel",
            "train", "repeat", "if", "then", "else", "return", "and", "or", "not", "true",
            "false", "none")


def _reserve_keywords(tok: Token) -> Token:
    if tok.value in KEYWORDS:
        return Token.new_borrow_pos(tok.value.upper(), tok.value, tok)
    return tok


@lru_cache(maxsize=1)
def _parser() -> Lark:
    opts = dict(parser="lalr", lexer="contextual", propagate_positions=True,
                maybe_placeholders=True, lexer_callbacks={"NAME": _reserve_keywords})
    try:
        # Lark keeps the built tables in the temp folder, keyed by a hash of the grammar
        # and options: a new process then loads the parser instead of building it
        return Lark(grammar_text(), cache=True, **opts)
    except OSError:  # a read-only or full temp folder: build it each time
        return Lark(grammar_text(), **opts)


# what each terminal means, for "expected ..." in syntax errors
_WORDS = {
    "NAME": "a name", "INT": "an integer", "FLOAT": "a number", "STRING": "a string",
    "LPAR": "`(`", "RPAR": "`)`", "LBRACE": "`{`", "RBRACE": "`}`", "LSQB": "`[`",
    "RSQB": "`]`", "COMMA": "`,`", "EQUAL": "`=`", "COLON": "`:`", "SEMICOLON": "`;`",
    "DOT": "`.`", "AT": "`@`", "MINUS": "`-`", "COMP_OP": "a comparison", "POW": "`**`",
    "ADD_OP": "`+` or `-`", "MUL_OP": "`*`, `/`, `//` or `%`",
}


def _word(term: str) -> str:
    if term in _WORDS:
        return _WORDS[term]
    if term.isupper() and term.isalpha():  # keyword terminals are named after themselves
        return f"`{term.lower()}`"
    return term


def _describe_token(tok: Token) -> str:
    if tok.type == "$END":
        return "the end of the file"
    if tok.type == "NAME":
        return f"name `{tok}`"
    if tok.type in ("INT", "FLOAT"):
        return f"number {tok}"
    if tok.type == "STRING":
        return f"string {tok}"
    if tok.type.isupper() and tok.type.isalpha() and tok.type not in _WORDS:
        return f"keyword `{tok}`"
    return f"`{tok}`"


_EXPR_START = {"NAME", "INT", "FLOAT", "STRING", "LPAR", "LSQB", "MINUS", "TRUE", "FALSE",
               "NONE", "NOT", "IF"}
_OPERATORS = {"POW", "MUL_OP", "ADD_OP", "COMP_OP", "AND", "OR", "DOT", "LSQB", "LPAR"}
_STMT_START = {"NAME", "IF", "REPEAT", "RETURN", "AT", "SEMICOLON", "INPUT", "OUTPUT", "LOSS",
               "PARALLEL"}
_TOP_START = {"IMPORT", "BLOCK", "NETWORK", "TRAIN", "AT", "SEMICOLON"}


def _expected(terms) -> str:
    terms = set(terms) - {"$END"}
    words: list[str] = []
    # a whole class of tokens reads better as what it starts ("a statement"), and a long
    # list cut off with "..." does not help anyone
    if len(terms & _STMT_START) >= 4:
        terms -= _STMT_START
        words.append("a statement")
    if len(terms & _TOP_START) >= 4:
        terms -= _TOP_START
        words.append("`import`, `block`, `network` or `train`")
    if len(terms & _EXPR_START) >= 4:  # "a name, a number, `(`..." is just an expression
        terms -= _EXPR_START
        words.append("an expression")
    if len(terms & _OPERATORS) >= 3:  # after an operand: say "an operator", not all of them
        terms -= _OPERATORS
        words.append("an operator")
    words += sorted({_word(t) for t in terms}, key=lambda w: (w.startswith("`") and
                                                              w[1:-1].isalpha(), w))
    if len(words) > 7:
        words = words[:7] + ["..."]
    if not words:
        return ""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


_CLOSE = {"(": ")", "[": "]", "{": "}"}
_TOKEN_RE = re.compile(r'#[^\n]*|"(?:[^"\\\n]|\\.)*"?|[()\[\]{}]')


def _open_brackets(text: str, end: int) -> list[tuple[str, int]]:
    """The brackets still open at offset `end` (innermost last), skipping strings and
    comments; a closing bracket pops its opener if it matches."""
    stack: list[tuple[str, int]] = []
    for m in _TOKEN_RE.finditer(text, 0, end):
        ch = m.group()
        if ch in _CLOSE:
            stack.append((ch, m.start()))
        elif ch in ")]}" and stack and _CLOSE[stack[-1][0]] == ch:
            stack.pop()
    return stack


def _where_offset(text: str, pos: int) -> str:
    line = text.count("\n", 0, pos) + 1
    col = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return f"line {line}, column {col}"


_TERM = {")": "RPAR", "]": "RSQB", "}": "RBRACE"}


def _bracket_hint(text: str, pos: int, tok: str | None, expected=None) -> str:
    """Say which bracket is unbalanced, where that explains a syntax error at `pos`: an
    unmatched closer (`tok`), or an opener whose closer the parser was ready to accept
    (`expected`; None at the end of the file, where any open bracket is the culprit)."""
    stack = _open_brackets(text, pos)
    if tok in _TERM:
        if stack and _CLOSE[stack[-1][0]] == tok:
            return ""
        opener = {v: k for k, v in _CLOSE.items()}[tok]
        if not any(ch == opener for ch, _ in stack):
            if stack and stack[-1][0] != "{" and expected and \
                    _TERM[_CLOSE[stack[-1][0]]] in expected:
                ch, at = stack[-1]  # `relu(x]`: the `(` is the real problem
                return f" (the `{ch}` at {_where_offset(text, at)} is never closed)"
            return f" (there is no `{opener}` for this `{tok}` to close)"
        ch, at = stack[-1]
        return f" (`{tok}` does not match the `{ch}` at {_where_offset(text, at)})"
    if not stack:
        return ""
    ch, at = stack[-1]
    if expected is not None and _TERM[_CLOSE[ch]] not in expected:
        return ""
    # a `{` is "never closed" only when a new top-level item begins inside it; otherwise
    # `}` is merely one of the tokens the parser would accept, and the hint misleads
    if ch == "{" and expected is not None and tok not in ("block", "network", "train",
                                                          "import"):
        return ""
    return f" (the `{ch}` at {_where_offset(text, at)} is never closed)"


# an annotation (`@recompute`, `@stage(1)`) right before an offset, for `.search(text, 0, pos)`
_ANNOTATION_BEFORE = re.compile(r"@\w+\s*(\([^()]*\))?\s*$")


def _syntax_error(e: UnexpectedInput, file: str, text: str) -> NetdslError:
    line, col = max(getattr(e, "line", 1) or 1, 1), max(getattr(e, "column", 1) or 1, 1)
    if isinstance(e, UnexpectedCharacters):
        ch = text[e.pos_in_stream] if e.pos_in_stream < len(text) else "?"
        msg = f"unexpected character `{ch}`" if ch.isprintable() else \
            f"unexpected character U+{ord(ch):04X}"  # a control character, unprintable
        if ch == '"':
            msg = "unterminated string (a string must end with `\"` on the same line)"
    elif isinstance(e, UnexpectedEOF) or (isinstance(e, UnexpectedToken)
                                           and e.token.type == "$END"):
        # at the end of the file the parser's list of expected tokens is long and
        # misleading; an unclosed bracket is the usual cause, so name it instead
        hint = _bracket_hint(text, len(text), None)
        exp = "" if hint else _expected(e.expected)
        msg = "unexpected end of file" + (f"; expected {exp}" if exp else "") + hint
        # just after the last non-blank line; lines as the lexer counts them ("\n" only)
        lines = text.rstrip().split("\n")
        line, col = len(lines), len(lines[-1]) + 1
    elif isinstance(e, UnexpectedToken):
        exp = _expected(e.accepts or e.expected)
        msg = f"unexpected {_describe_token(e.token)}" + (f"; expected {exp}" if exp else "")
        pos = e.token.start_pos if e.token.start_pos is not None else len(text)
        if e.token.type in ("EQUAL", "COLON") and "RPAR" in e.expected:
            msg += " (keyword arguments are written `name=value` after a name)"
        elif e.token.type in ("INPUT", "OUTPUT", "LOSS", "PARALLEL") and \
                _ANNOTATION_BEFORE.search(text, 0, pos):
            msg = (f"an annotation cannot be put on `{e.token}`: annotations apply to "
                   "statements that compute (assignments, `if`, `repeat`) and to blocks; "
                   f"move it to the statement that computes the {e.token} value")
        elif e.token.type in ("INPUT", "OUTPUT", "LOSS", "PARALLEL") and "REPEAT" in e.expected:
            msg += (f" (`{e.token}` may only appear at the top level of a network, "
                    "not in a block, `if` or `repeat`)")
        else:
            msg += _bracket_hint(text, pos, str(e.token), set(e.expected))
    else:  # pragma: no cover - lark raises only the kinds above
        msg = str(e).splitlines()[0]
    return NetdslError(f"syntax error: {msg}", SourceLoc(file, line, col))


def _unescape(tok: Token, file: str) -> str:
    """The value of a string literal; an unknown escape is an error at its column."""
    def unknown(i: int, ch: str) -> Exception:
        return NetdslError(f"unknown escape `\\{ch}` in a string (use \\\\, \\\", \\n "
                           "or \\t)", SourceLoc(file, tok.line, tok.column + 1 + i))
    return unescape(str(tok), unknown)


def _loc(file, meta) -> SourceLoc:
    return SourceLoc(file, meta.line, meta.column, meta.end_line, meta.end_column)


def _tloc(file, tok: Token) -> SourceLoc:
    return SourceLoc(file, tok.line, tok.column, tok.end_line, tok.end_column)


@v_args(meta=True)
class _ToAst(Transformer):
    def __init__(self, file: str):
        super().__init__()
        self.file = file

    def L(self, meta) -> SourceLoc:
        return _loc(self.file, meta)

    # -- expressions ---------------------------------------------------------------------
    def name(self, meta, c):
        return ast.Name(self.L(meta), str(c[0]))

    def int_(self, meta, c):
        v = int(str(c[0]).replace("_", ""))
        if v > INT_MAX:  # every static integer is 64-bit signed (the sign is an operator)
            raise NetdslError(f"the integer {c[0]} does not fit in a 64-bit integer (at most "
                              f"{INT_MAX})", self.L(meta))
        return ast.Const(self.L(meta), v)

    def float_(self, meta, c):
        v = float(c[0])
        if math.isinf(v):  # 1e400 reads as inf
            raise NetdslError(f"the number {c[0]} is too large for a float (at most about "
                              "1.8e308)", self.L(meta))
        return ast.Const(self.L(meta), v)

    def string(self, meta, c):
        return ast.Const(self.L(meta), _unescape(c[0], self.file))

    def true(self, meta, c):
        return ast.Const(self.L(meta), True)

    def false(self, meta, c):
        return ast.Const(self.L(meta), False)

    def none(self, meta, c):
        return ast.Const(self.L(meta), None)

    def tuple_(self, meta, c):
        return ast.TupleExpr(self.L(meta), tuple(x for x in c if x is not None))

    def binop(self, meta, c):
        return ast.BinOp(self.L(meta), str(c[1]), c[0], c[2])

    def compare(self, meta, c):
        return ast.BinOp(self.L(meta), str(c[1]), c[0], c[2])

    def and_(self, meta, c):
        return ast.BinOp(self.L(meta), "and", c[0], c[1])

    def or_(self, meta, c):
        return ast.BinOp(self.L(meta), "or", c[0], c[1])

    def not_(self, meta, c):
        return ast.Unary(self.L(meta), "not", c[0])

    def neg(self, meta, c):
        return ast.Unary(self.L(meta), "-", c[0])

    def cond(self, meta, c):
        return ast.Cond(self.L(meta), c[0], c[1], c[2])

    def call(self, meta, c):
        func, arglist = c
        args, kwargs = arglist if arglist is not None else ((), ())
        # point at the callee (`conv2d`), like a compiler does, not the whole call
        loc = func.loc
        return ast.Call(loc, func, args, kwargs)

    def index(self, meta, c):
        return ast.Index(self.L(meta), c[0], c[1])

    def attr(self, meta, c):
        return ast.Attr(self.L(meta), c[0], str(c[1]))

    def kwarg(self, meta, c):
        return ("kw", str(c[0]), c[1], _tloc(self.file, c[0]))

    def arglist(self, meta, c):
        args, kwargs = [], []
        for a in c:
            if isinstance(a, tuple) and a and a[0] == "kw":
                kwargs.append(a[1:])
            else:
                if kwargs:
                    raise NetdslError("syntax error: a positional argument follows a keyword "
                                      "argument", a.loc)
                args.append(a)
        return tuple(args), tuple(kwargs)

    # -- statements ----------------------------------------------------------------------
    def annotation(self, meta, c):
        name, arglist = c
        args, kwargs = arglist if arglist is not None else ((), ())
        return ast.Annotation(str(name), args, kwargs, self.L(meta))

    def annotations(self, meta, c):
        return tuple(c)

    def body(self, meta, c):
        return tuple(s for s in c if s is not None)

    def empty(self, meta, c):
        return None

    def annotated_stmt(self, meta, c):
        anns, stmt = c
        if stmt is None:
            raise NetdslError("an annotation must be followed by a statement", anns[0].loc)
        from dataclasses import replace
        return replace(stmt, annotations=anns + stmt.annotations)

    def assign(self, meta, c):
        *targets, value = c
        return ast.Assign(_tloc(self.file, targets[0]), tuple(str(t) for t in targets), value)

    def repeat_stmt(self, meta, c):
        count, var, body = c
        return ast.Repeat(self.L(meta), count, str(var) if var is not None else None, body)

    def if_stmt(self, meta, c):
        test, body, orelse = c
        if isinstance(orelse, ast.If):
            orelse = (orelse,)
        return ast.If(self.L(meta), test, body, orelse or ())

    def return_stmt(self, meta, c):
        return ast.Return(self.L(meta), tuple(c))

    def input_decl(self, meta, c):
        name, (dtype, dims, dloc) = c
        return ast.InputDecl(_tloc(self.file, name), str(name), dtype, dims, dloc)

    def tensor_type(self, meta, c):
        dtype, *dims = c
        return str(dtype), tuple(d for d in dims if d is not None), _tloc(self.file, dtype)

    def output_decl(self, meta, c):
        return ast.OutputDecl(self.L(meta), tuple(c))

    def loss_decl(self, meta, c):
        return ast.LossDecl(self.L(meta), c[0])

    def setting(self, meta, c):
        return ast.Setting(str(c[0]), c[1], _tloc(self.file, c[0]))

    def parallel_decl(self, meta, c):
        return ast.ParallelDecl(self.L(meta), tuple(c))

    # -- top level -----------------------------------------------------------------------
    def param(self, meta, c):
        return ast.Param(str(c[0]), c[1], _tloc(self.file, c[0]))

    def param_list(self, meta, c):
        seen: dict[str, ast.Param] = {}
        for p in c:
            if p.name in seen:
                first = seen[p.name].loc
                raise NetdslError(f"the block has two parameters named `{p.name}` (the first "
                                  f"at line {first.line}, column {first.column}); rename "
                                  "one", p.loc)
            seen[p.name] = p
        return tuple(c)

    def block_def(self, meta, c):
        anns, name, params, body = c
        return ast.BlockDef(str(name), params or (), body, anns or (),
                            _tloc(self.file, name), self.file)

    def network_def(self, meta, c):
        anns, name, *stmts = c
        return ast.NetworkDef(str(name), tuple(s for s in stmts if s is not None), anns or (),
                              _tloc(self.file, name))

    def train_def(self, meta, c):
        return ast.TrainDef(tuple(c), self.L(meta))

    def import_module(self, meta, c):
        name, alias = c
        return ast.Import(str(name), None, str(alias or name), self.L(meta))

    def import_file(self, meta, c):
        path, alias = c
        return ast.Import(None, str(path)[1:-1], str(alias), self.L(meta))

    def start(self, meta, c):
        items = [x for x in c if x is not None and not isinstance(x, Token)]
        return items


def _transform(tf: Transformer, tree: Tree):
    """`tf.transform(tree)` without recursion: Lark's transformer recurses through a
    generator per level, which both needs a deep stack and slows down more than linearly
    with depth. A post-order walk with explicit stacks calls the same per-rule methods in
    the same order. Each rule's method is looked up once: Lark re-wraps it
    (functools.update_wrapper) at every lookup, a sizeable share of checking a big
    file."""
    methods: dict = {}
    values: list = []
    todo: list = [(tree, False)]
    while todo:
        node, ready = todo.pop()
        if not isinstance(node, Tree):  # a token or a `None` placeholder
            values.append(tf._call_userfunc_token(node) if isinstance(node, Token)
                          and hasattr(tf, node.type) else node)
        elif ready:
            n = len(node.children)
            children = values[len(values) - n:] if n else []
            del values[len(values) - n:]
            f = methods.get(node.data)
            if f is None:
                f = methods[node.data] = getattr(tf, node.data, False)
            if f is False:
                values.append(tf.__default__(node.data, children, node.meta))
            else:
                values.append(f.visit_wrapper(f, node.data, children, node.meta))
        else:
            todo.append((node, True))
            todo.extend((c, False) for c in reversed(node.children))
    return values[0]


_WRAPPERS = {"arglist", "body", "kwarg", "annotations", "param_list", "tensor_type"}


def _check_nesting(tree, file: str) -> None:
    """Refuse nesting deeper than MAX_NESTING where it is passed (iteratively: this runs
    before anything that recurses over the tree)."""
    todo = [(tree, 1)]
    while todo:
        node, depth = todo.pop()
        if node.data in _WRAPPERS:  # not a level the user writes: `relu(x)` is one
            depth -= 1
        if depth > MAX_NESTING:
            meta = node.meta
            loc = SourceLoc(file, getattr(meta, "line", 1), getattr(meta, "column", 1))
            raise NetdslError(f"the program nests more than {MAX_NESTING:,} levels deep here "
                              "(operators, calls, parentheses or statements inside one "
                              "another); split it with intermediate names", loc)
        todo.extend((c, depth + 1) for c in node.children if isinstance(c, Tree))


_TOO_DEEP = ("this file nests expressions too deeply to compile; split them with "
             "intermediate names")


def parse_tree(text: str, file: str = "<string>"):
    """Lark's parse tree of `.net` source: every token as written, with its position (for
    tools that keep the text, like the formatter). Raises NetdslError on a syntax error."""
    register_source(file, text)
    try:
        return _parser().parse(text)
    except UnexpectedInput as e:
        raise _syntax_error(e, file, text) from None


def parse(text: str, file: str = "<string>") -> ast.Module:
    """Parse `.net` source into an AST; raises NetdslError on a syntax error."""
    text = text.removeprefix("\ufeff")  # a byte-order mark (from an editor) is not code
    register_source(file, text)
    # the hand-written parser takes programs without errors, fast; Lark's takes the rest
    # and reports every error (see frontend/descent.py)
    items = parse_items(text, file)
    if items is None:
        items = lark_items(text, file)
    return _module(items, file)


def lark_items(text: str, file: str) -> list:
    """The top-level items of `text` by the Lark parser and the tree-to-AST transformer."""
    try:
        tree = _parser().parse(text)
    except UnexpectedInput as e:
        raise _syntax_error(e, file, text) from None
    _check_nesting(tree, file)
    try:
        return _transform(_ToAst(file), tree)
    except RecursionError:  # the transformer recurses once per nesting level
        raise NetdslError(_TOO_DEEP, SourceLoc(file, 1, 1)) from None
    except Exception as e:  # lark wraps errors raised in callbacks
        inner = getattr(e, "orig_exc", e)
        if isinstance(inner, NetdslError):
            raise inner from None
        if isinstance(inner, RecursionError):
            raise NetdslError(_TOO_DEEP, SourceLoc(file, 1, 1)) from None
        raise


def _module(items: list, file: str) -> ast.Module:
    imports = tuple(i for i in items if isinstance(i, ast.Import))
    blocks = tuple(i for i in items if isinstance(i, ast.BlockDef))
    nets = tuple(i for i in items if isinstance(i, ast.NetworkDef))
    seen: dict[str, ast.NetworkDef] = {}
    for n in nets:
        if n.name in seen:
            first = seen[n.name].loc
            raise NetdslError(f"a second network named `{n.name}` (the first is at line "
                              f"{first.line}); networks in one file need different names, "
                              "as they are chosen by name", n.loc)
        seen[n.name] = n
    trains = [i for i in items if isinstance(i, ast.TrainDef)]
    if len(trains) > 1:
        raise NetdslError("a file may have only one `train` section", trains[1].loc)
    return ast.Module(file, imports, blocks, nets, trains[0] if trains else None)
