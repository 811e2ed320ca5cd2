"""`netdsl fmt`: the formatter keeps every comment, is idempotent, and keeps the meaning:
the formatted text parses to the same syntax tree (locations aside) and lowers to the same
IR, for every example and stdlib file and for generated and mutated programs."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fuzz import _TOKEN, FILE, RESNET, SMALL, _mutations

import netdsl
from netdsl.errors import NetdslError, SourceLoc
from netdsl.frontend import parse
from netdsl.frontend.format import WIDTH, format_source

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "examples").glob("*.net")) + sorted((ROOT / "stdlib").glob("*.net"))
SETTINGS = settings(derandomize=True, deadline=None, database=None, max_examples=40,
                    suppress_health_check=list(HealthCheck))


def shape(x):
    """The syntax tree without its source locations (what the elaborator's result depends
    on, beyond the error messages)."""
    if isinstance(x, SourceLoc):
        return None
    if dataclasses.is_dataclass(x):
        return (type(x).__name__,) + tuple(
            shape(getattr(x, f.name)) for f in dataclasses.fields(x) if f.name != "file")
    if isinstance(x, tuple | list):
        return tuple(shape(y) for y in x)
    if isinstance(x, float):
        return ("float", x)  # 1 and 1.0 are different constants
    return x


def comments(text: str) -> list[str]:
    return sorted(m.group().rstrip() for m in re.finditer(r'"(?:[^"\\\n]|\\.)*"|#[^\n]*', text)
                  if m.group().startswith("#"))


def assert_formats(text: str, file: str = "<string>") -> str:
    out = format_source(text, file)
    assert format_source(out, file) == out, "not idempotent"
    assert shape(parse(out, file)) == shape(parse(text, file)), "the meaning changed"
    assert comments(out) == comments(text), "comments lost or changed"
    assert all(not ln.endswith((" ", "\t")) for ln in out.split("\n"))
    return out


@pytest.mark.parametrize("path", SOURCES, ids=[p.name for p in SOURCES])
def test_every_example_and_stdlib_file(path):
    text = path.read_text()
    out = assert_formats(text, str(path))
    assert max(len(ln) for ln in out.split("\n")) <= WIDTH
    if path.parent.name == "examples":  # the same IR
        before = netdsl.loads(text, file=str(path)).graph.to_text()
        assert netdsl.loads(out, file=str(path)).graph.to_text() == before


def test_the_layout():
    src = ('import resnet\nimport "b.net" as b  # blocks\n@recompute block f(x, w=1,) '
           '{ ; return (x,) , [ ] }\n'
           'network n { input x: f32[N,3]\n parallel { data = 2; microbatches = 4 }\n'
           '@stage(1) h=relu( x )*-2**2\n\n\n h = if a then (b+c)*d else -(e-f)\n'
           ' if h { h = h } else if g { h = 1 } else { h = 2 }\n output h }\n'
           'train { optimizer=adam(lr=1e-3); batch=1_000 }')
    assert assert_formats(src) == """\
import resnet
import "b.net" as b  # blocks

@recompute
block f(x, w=1) {
    return (x,), []
}

network n {
    input x: f32[N, 3]
    parallel {
        data         = 2
        microbatches = 4
    }
    @stage(1)
    h = relu(x) * -2 ** 2

    h = if a then (b + c) * d else -(e - f)
    if h {
        h = h
    } else if g {
        h = 1
    } else {
        h = 2
    }
    output h
}

train {
    optimizer = adam(lr=1e-3)
    batch     = 1_000
}
"""


def test_long_lines_break_and_similar_calls_align():
    args = ", ".join(f"argument_{i}=value_{i}" for i in range(8))
    src = (f"network n {{\n h = stage(h, width=64, blocks=3)\n h = stage(h, width=128, "
           f"blocks=36, stride=2)\n h = f(x, {args})\n k = if cond_a and cond_b then "
           f"some_long_call(x, 1, 2, 3) else another_long_call(x, 4, 5, 6, 7, 8, 9, 10, 11)\n"
           f" output h\n}}\n")
    out = assert_formats(src)
    assert "    h = stage(h, width=64,  blocks=3)\n    h = stage(h, width=128, blocks=36, " \
           "stride=2)\n" in out
    assert "    h = f(\n        x,\n        argument_0=value_0,\n" in out
    assert "value_7,\n    )\n" in out
    assert "\n    k = if cond_a and cond_b then some_long_call(x, 1, 2, 3)\n" \
           "        else another_long_call(" in out
    assert max(len(ln) for ln in out.split("\n")) <= WIDTH


def test_comments_stay_where_they_were():
    src = ("# head\n\n# about f\nblock f(x) {  # opens\n    # first\n    h = x  # trail\n\n"
           "    # before return\n    return h\n    # at the end\n}\n# tail\n")
    assert assert_formats(src) == src
    # between the arguments of a call: kept after its argument, one argument per line
    inner = ("network n {\n    input x: f32[N, 4]\n    h = f(x,  # why\n          # two\n"
             "          2)\n    output h\n}\n")
    assert "    h = f(\n        x,  # why\n        # two\n        2,\n    )\n" in \
        assert_formats(inner)
    # inside an expression elsewhere: on the line before the statement
    inner = "network n {\n    input x: f32[N, 4]\n    h = x +  # why\n        x\n    output h\n}\n"
    assert "    # why\n    h = x + x\n" in assert_formats(inner)


def test_a_file_with_errors_is_an_error():
    with pytest.raises(NetdslError, match=r"syntax error") as e:
        format_source("network n {\n    h = relu(x\n}\n", "bad.net")
    assert e.value.loc.file == "bad.net" and e.value.loc.line == 3


# -- generated programs -----------------------------------------------------------------------

_NAMES = st.sampled_from(["a", "b", "x", "h"])
_ATOMS = st.one_of(_NAMES, st.sampled_from(["1", "2.5", "1e-3", "1_0", '"s"', "true", "none",
                                            "[]", "(a,)"]))


def _exprs():
    """Random expressions, fully parenthesized, so the formatter must find which
    parentheses the precedence needs."""
    def extend(sub):
        return st.one_of(
            st.tuples(sub, st.sampled_from(["+", "-", "*", "/", "//", "%", "**", "==", "<",
                                            "and", "or"]), sub).map(
                lambda t: f"({t[0]} {t[1]} {t[2]})"),
            sub.map(lambda e: f"(-{e})"), sub.map(lambda e: f"(not {e})"),
            st.tuples(sub, sub, sub).map(lambda t: f"(if {t[0]} then {t[1]} else {t[2]})"),
            st.tuples(_NAMES, st.lists(sub, max_size=3)).map(
                lambda t: f"{t[0]}({', '.join(t[1])})"),
            st.tuples(sub, sub).map(lambda t: f"({t[0]})[{t[1]}]"),
            sub.map(lambda e: f"({e}).attr"),
            st.lists(sub, max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]"),
        )
    return st.recursive(_ATOMS, extend, max_leaves=12)


@SETTINGS
@given(_exprs(), st.booleans())
def test_generated_expressions(expr, in_call):
    value = f"f(x, k={expr})" if in_call else expr
    assert_formats(f"block b(x) {{\n    h = {value}\n    return h\n}}\n")


def _with_comments(text: str, where: list[int]) -> str:
    """`text` with a comment (and so a line break) after some of its tokens."""
    cuts = sorted({m.end() for m in _TOKEN.finditer(text)
                   if not m.group().startswith("#") and m.group().strip() not in ("", ".")})
    out, last = [], 0
    for k, w in enumerate(sorted({w % len(cuts) for w in where})):
        out += [text[last:cuts[w]], f"  # c{k}\n"]
        last = cuts[w]
    return "".join(out) + text[last:]


@settings(SETTINGS, max_examples=30)
@given(st.sampled_from([SMALL, RESNET, (ROOT / "stdlib" / "resnet.net").read_text()]),
       st.lists(st.integers(0, 10**6), min_size=1, max_size=6))
def test_comments_anywhere(text, where):
    assert_formats(_with_comments(text, where), FILE)


def _formats_if_parses(text: str) -> None:
    try:
        parse(text, FILE)
    except NetdslError:
        with pytest.raises(NetdslError):
            format_source(text, FILE)
        return
    out = assert_formats(text, FILE)
    try:
        before = netdsl.loads(text, file=FILE).graph.to_text()
    except NetdslError as e:
        with pytest.raises(NetdslError) as again:
            netdsl.loads(out, file=FILE)
        unplaced = lambda err: [re.sub(r"line \d+, column \d+", "", d.message)  # noqa: E731
                                for d in err.diagnostics]
        assert unplaced(again.value) == unplaced(e)
        return
    assert netdsl.loads(out, file=FILE).graph.to_text() == before


@settings(SETTINGS, max_examples=60)
@given(_mutations(SMALL, 3))
def test_mutated_programs(text):
    _formats_if_parses(text)
