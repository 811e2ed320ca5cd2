"""Text -> AST. Lark LALR parser; syntax errors become located `NetdslError`s in words."""
from __future__ import annotations

from functools import lru_cache

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from netdsl.errors import NetdslError, SourceLoc, register_source
from netdsl.frontend import ast
from netdsl.frontend.resources import grammar_text


@lru_cache(maxsize=1)
def _parser() -> Lark:
    return Lark(grammar_text(), parser="lalr", lexer="contextual", propagate_positions=True,
                maybe_placeholders=True)


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


def _expected(terms) -> str:
    terms = set(terms) - {"$END"}
    words: list[str] = []
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


def _syntax_error(e: UnexpectedInput, file: str, text: str) -> NetdslError:
    line, col = max(getattr(e, "line", 1) or 1, 1), max(getattr(e, "column", 1) or 1, 1)
    if isinstance(e, UnexpectedCharacters):
        ch = text[e.pos_in_stream] if e.pos_in_stream < len(text) else "?"
        msg = f"unexpected character `{ch}`"
        if ch == '"':
            msg = "unterminated string (a string must end with `\"` on the same line)"
    elif isinstance(e, UnexpectedEOF) or (isinstance(e, UnexpectedToken)
                                           and e.token.type == "$END"):
        exp = _expected(e.expected)
        msg = "unexpected end of file" + (f"; expected {exp}" if exp else "")
        for term, ch in (("RPAR", ")"), ("RSQB", "]"), ("RBRACE", "}")):
            if term in e.expected:
                msg += f" (a `{ch}` is probably missing)"
                break
        lines = text.splitlines() or [""]
        line, col = len(lines), len(lines[-1]) + 1
    elif isinstance(e, UnexpectedToken):
        exp = _expected(e.accepts or e.expected)
        msg = f"unexpected {_describe_token(e.token)}" + (f"; expected {exp}" if exp else "")
        if e.token.type == "EQUAL" and "RPAR" in e.expected:
            msg += " (keyword arguments are written `name=value` after a name)"
    else:  # pragma: no cover - lark raises only the kinds above
        msg = str(e).splitlines()[0]
    return NetdslError(f"syntax error: {msg}", SourceLoc(file, line, col))


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
        return ast.Const(self.L(meta), int(str(c[0]).replace("_", "")))

    def float_(self, meta, c):
        return ast.Const(self.L(meta), float(c[0]))

    def string(self, meta, c):
        s = str(c[0])[1:-1]
        return ast.Const(self.L(meta), s.encode().decode("unicode_escape"))

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


def parse(text: str, file: str = "<string>") -> ast.Module:
    """Parse `.net` source into an AST; raises NetdslError on a syntax error."""
    register_source(file, text)
    try:
        tree = _parser().parse(text)
    except UnexpectedInput as e:
        raise _syntax_error(e, file, text) from None
    try:
        items = _ToAst(file).transform(tree)
    except Exception as e:  # lark wraps errors raised in callbacks
        inner = getattr(e, "orig_exc", e)
        if isinstance(inner, NetdslError):
            raise inner from None
        raise
    imports = tuple(i for i in items if isinstance(i, ast.Import))
    blocks = tuple(i for i in items if isinstance(i, ast.BlockDef))
    nets = tuple(i for i in items if isinstance(i, ast.NetworkDef))
    trains = [i for i in items if isinstance(i, ast.TrainDef)]
    if len(trains) > 1:
        raise NetdslError("a file may have only one `train` section", trains[1].loc)
    return ast.Module(file, imports, blocks, nets, trains[0] if trains else None)
