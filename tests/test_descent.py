"""The hand-written parser (frontend/descent.py) against the Lark parser it stands in for.

For every text: where Lark's path accepts it, the fast parser must accept it too and build
an equal AST (locations included: the dataclasses compare every field); where Lark's path
reports an error, the fast parser must give up (return None), so that the error is
Lark's, word for word. Texts: every program in the repository, generated programs that use
every rule of the grammar (spaced with newlines and comments), and mutations of them.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from netdsl.errors import NetdslError
from netdsl.frontend import parse
from netdsl.frontend.deep import MAX_NESTING, run_deep
from netdsl.frontend.descent import parse_items
from netdsl.frontend.parser import lark_items

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = settings(derandomize=True, deadline=None, database=None, max_examples=60,
                    suppress_health_check=list(HealthCheck))


def lark_or_error(text: str):
    try:
        return lark_items(text, "t.net")
    except NetdslError as e:
        return e


def same_as_lark(text: str) -> bool:
    """Asserts the contract; returns whether Lark accepted the text."""
    return run_deep(_same_as_lark, text)  # with the stack `parse` has, for deep ones


def _same_as_lark(text: str) -> bool:
    ref = lark_or_error(text)
    fast = parse_items(text, "t.net")
    if isinstance(ref, NetdslError):
        assert fast is None, f"the fast parser accepted what Lark rejects ({ref})"
        return False
    assert fast is not None, "the fast parser gave up on a valid program"
    assert fast == ref
    return True


def _repository_programs():
    files = sorted(p for d in ("examples", "stdlib") for p in (ROOT / d).rglob("*.net"))
    out = [(p.relative_to(ROOT).as_posix(), p.read_text(encoding="utf-8")) for p in files]
    md = (ROOT / "docs" / "language.md").read_text(encoding="utf-8")
    out += [(f"docs/language.md block {i}", b) for i, b in
            enumerate(re.findall(r"```[a-z]*\n(.*?)```", md, re.S))]
    return out


@pytest.mark.parametrize("name,text", _repository_programs(), ids=lambda x: str(x)[:40])
def test_repository_programs(name, text):
    same_as_lark(text)


def test_the_repository_programs_are_mostly_valid():
    # the comparison above is only worth something if most of them reach the AST
    valid = sum(not isinstance(lark_or_error(t), NetdslError) for _, t in
                _repository_programs())
    assert valid >= 25


# -- generated programs --------------------------------------------------------------------
NAMES = ["x", "h", "relu", "if_", "andy", "N", "_a1", "nota"]
NUMBERS = ["0", "16", "1_000", "2_", "9223372036854775807", "9223372036854775808", "0.5",
           "1e-3", "1.", ".5", "2.5E+2", "1e400", "3e5"]
STRINGS = ['"s"', '""', '"a\\nb\\t\\"q\\\\"', '"bad \\x"', '"é ü"']
OPS = ["+", "-", "*", "/", "//", "%", "**", "==", "!=", "<", "<=", ">", ">=", "and", "or"]


@st.composite
def expr(draw, depth: int = 0) -> list[str]:
    leaf = ["name", "number", "string", "const"]
    kind = draw(st.sampled_from(leaf if depth >= 3 else leaf + [
        "binop", "binop", "binop", "neg", "not", "call", "call", "index", "attr", "paren",
        "tuple", "list", "cond"]))

    def sub() -> list[str]:
        e = draw(expr(depth + 1))
        return ["(", *e, ")"] if len(e) > 1 and draw(st.booleans()) else e

    if kind == "name":
        return [draw(st.sampled_from(NAMES))]
    if kind == "number":
        return [draw(st.sampled_from(NUMBERS))]
    if kind == "string":
        return [draw(st.sampled_from(STRINGS))]
    if kind == "const":
        return [draw(st.sampled_from(["true", "false", "none"]))]
    if kind == "binop":
        return [*sub(), draw(st.sampled_from(OPS)), *sub()]
    if kind == "neg":
        return ["-", *sub()]
    if kind == "not":
        return ["not", *sub()]
    if kind == "call":
        return [*draw(st.sampled_from([["f"], ["b", ".", "g"], ["(", "f", ")"]])), "(",
                *args(draw, depth), ")"]
    if kind == "index":
        return [*sub(), "[", *draw(expr(depth + 1)), "]"]
    if kind == "attr":
        return [*sub(), ".", draw(st.sampled_from(NAMES))]
    if kind == "paren":
        return ["(", *draw(expr(depth + 1)), ")"]
    if kind == "tuple":
        n = draw(st.integers(1, 3))
        items = [draw(expr(depth + 1)) for _ in range(n)]
        return ["(", *_joined(items), ",", ")"] if n == 1 or draw(st.booleans()) else \
            ["(", *_joined(items), ")"]
    if kind == "list":
        items = [draw(expr(depth + 1)) for _ in range(draw(st.integers(0, 3)))]
        return ["[", *_joined(items), *([","] if items and draw(st.booleans()) else []), "]"]
    return ["if", *sub(), "then", *sub(), "else", *sub()]


def _joined(items: list[list[str]]) -> list[str]:
    out: list[str] = []
    for i, it in enumerate(items):
        out += ([","] if i else []) + it
    return out


def args(draw, depth: int) -> list[str]:
    items = [draw(expr(depth + 1)) for _ in range(draw(st.integers(0, 2)))]
    kws = [[draw(st.sampled_from(["bias", "axis", "k"])), "=", *draw(expr(depth + 1))]
           for _ in range(draw(st.integers(0, 2)))]
    if draw(st.integers(0, 9)) == 0:  # a positional argument after a keyword: an error
        kws, items = items, kws
    out = _joined(items + kws)
    return out + ([","] if out and draw(st.booleans()) else [])


@st.composite
def annotations(draw) -> list[str]:
    out: list[str] = []
    for _ in range(draw(st.integers(0, 2))):
        out += ["@", draw(st.sampled_from(["recompute", "stage"]))]
        if draw(st.booleans()):
            out += ["(", *args(draw, 1), ")"]
    return out


@st.composite
def stmt(draw, depth: int = 0) -> list[str]:
    kinds = ["assign", "assign", "assign", ";"] + (["if", "repeat", "return"] if depth < 2
                                                    else [])
    kind = draw(st.sampled_from(kinds))
    anns = draw(annotations()) if draw(st.integers(0, 3)) == 0 else []
    if kind == "assign":
        targets = draw(st.lists(st.sampled_from(NAMES[:3]), min_size=1, max_size=3))
        return anns + _joined([[t] for t in targets]) + ["=", *draw(expr())]
    if kind == ";":
        return anns + [";"]
    if kind == "return":
        return anns + ["return", *_joined([draw(expr()) for _ in range(draw(st.integers(1, 2)))])]
    if kind == "repeat":
        return anns + ["repeat", *draw(expr(2)), *(["as", "i"] if draw(st.booleans()) else []),
                       *body(draw, depth)]
    out = anns + ["if", *draw(expr(1)), *body(draw, depth)]
    while draw(st.integers(0, 2)) == 0:
        out += ["else", "if", *draw(expr(2)), *body(draw, depth)]
    if draw(st.booleans()):
        out += ["else", *body(draw, depth)]
    return out


def body(draw, depth: int) -> list[str]:
    return ["{", *sum((draw(stmt(depth + 1)) for _ in range(draw(st.integers(0, 3)))), []),
            "}"]


@st.composite
def settings_block(draw, keyword: str) -> list[str]:
    out = [keyword, "{"]
    for _ in range(draw(st.integers(0, 3))):
        out += [draw(st.sampled_from(["lr", "batch"])), "=", *draw(expr(1))]
        out += [";"] if draw(st.booleans()) else []
    return out + ["}"]


@st.composite
def program(draw) -> list[str]:
    out: list[str] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["import", "block", "network", "network", "train", ";"]))
        if kind == "import":
            out += draw(st.sampled_from([["import", "resnet"], ["import", "resnet", "as", "r"],
                                         ["import", '"lib/b.net"', "as", "b"]]))
        elif kind == "block":
            params = [[p, *(["=", *draw(expr(2))] if draw(st.booleans()) else [])]
                      for p in draw(st.lists(st.sampled_from(["x", "k", "x2"]), max_size=3))]
            out += draw(annotations()) + ["block", "blk", "(", *_joined(params),
                                          *([","] if params and draw(st.booleans()) else []),
                                          ")", *body(draw, 0)]
        elif kind == "network":
            out += draw(annotations()) + ["network", draw(st.sampled_from(["n", "m"])), "{"]
            for _ in range(draw(st.integers(0, 6))):
                which = draw(st.sampled_from(["input", "output", "loss", "parallel", "stmt",
                                              "stmt"]))
                if which == "input":
                    dims = [draw(expr(2)) for _ in range(draw(st.integers(0, 3)))]
                    out += ["input", "x", ":", "f32", "[", *_joined(dims), "]"]
                elif which == "output":
                    out += ["output", *_joined([draw(expr()) for _ in range(draw(
                        st.integers(1, 2)))])]
                elif which == "loss":
                    out += ["loss", *draw(expr())]
                elif which == "parallel":
                    out += draw(settings_block("parallel"))
                else:
                    out += draw(stmt())
            out += ["}"]
        elif kind == "train":
            out += draw(settings_block("train"))
        else:
            out += [";"]
    return out


SPACES = [" ", " ", "\n", "\n    ", "  # a comment (with `{` in it)\n", "\t", "\r\n", ""]


@st.composite
def spaced(draw, tokens: list[str]) -> str:
    """The tokens joined with random spacing; no space only where the tokens stay apart."""
    out = [tokens[0]] if tokens else []
    for a, b in zip(tokens, tokens[1:]):
        sep = draw(st.sampled_from(SPACES))
        if not sep and (a[-1].isalnum() or a[-1] in '_."') and (b[0].isalnum() or b[0] in '_."'):
            sep = " "
        if not sep and a + b in ("**", "//", "==", "<=", ">=", "!=", "*=", "/=", "<=", ">=",
                                 "*/", "**/", "*//"):
            sep = " "
        out += [sep, b]
    return "".join(out) + draw(st.sampled_from(["", "\n", "\n# trailing comment"]))


@SETTINGS
@given(st.data())
def test_generated_programs(data):
    same_as_lark(data.draw(spaced(data.draw(program()))))


@settings(SETTINGS, max_examples=200)
@given(st.data())
def test_generated_expressions(data):
    # one network, one statement: many more operator combinations per example
    e = data.draw(expr())
    same_as_lark(data.draw(spaced(["network", "n", "{", "h", "=", *e, "}"])))


def test_generated_programs_are_mostly_valid():
    # the properties above mean little if the generator only produces syntax errors
    valid = []

    @settings(SETTINGS, max_examples=60)
    @given(st.data())
    def run(data):
        valid.append(same_as_lark(data.draw(spaced(data.draw(program())))))

    run()
    assert sum(valid) >= len(valid) // 3, f"{sum(valid)} of {len(valid)} valid"


@SETTINGS
@given(st.data())
def test_mutated_programs(data):
    # a deleted, repeated or swapped token: mostly errors, which the fast parser must
    # leave to Lark
    tokens = data.draw(program())
    for _ in range(data.draw(st.integers(1, 2))):
        if len(tokens) < 2:
            break
        i = data.draw(st.integers(0, len(tokens) - 1))
        op = data.draw(st.sampled_from(["delete", "repeat", "swap", "insert"]))
        if op == "delete":
            del tokens[i]
        elif op == "repeat":
            tokens.insert(i, tokens[i])
        elif op == "swap" and i + 1 < len(tokens):
            tokens[i], tokens[i + 1] = tokens[i + 1], tokens[i]
        else:
            tokens.insert(i, data.draw(st.sampled_from(
                ["$", "!", "'", "(", ")", "{", "}", ",", "=", "input", "output", "if", "@x",
                 '"open', "1.2.3", "x.5", "\\"])))
    same_as_lark(data.draw(spaced(tokens)))


def test_deep_programs_go_to_lark_and_keep_its_error():
    # past the fast parser's depth bound the Lark path decides; past MAX_NESTING it
    # refuses the program at the exact level, as before
    n = MAX_NESTING + 5
    text = "network n {\n input x: f32[N, 4]\n h = " + "relu(" * n + "x" + ")" * n + \
        "\n output h\n}\n"
    assert run_deep(parse_items, text, "t.net") is None
    with pytest.raises(NetdslError, match="nests more than"):
        parse(text, "t.net")
    ok = 2_000  # well within the bound: the fast path, same AST
    text = "network n {\n h = " + "(" * ok + "x" + ")" * ok + " + " + "-" * ok + "x\n}\n"
    assert same_as_lark(text)
