"""What the language server answers, without the server: hover, definitions, completion
and symbols from `netdsl.tooling.analysis`, and diagnostics in imported files mapped to
the call that led there (`netdsl.tooling.lsp.to_lsp_diagnostic`)."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from test_fuzz import FILE, SMALL, _mutations

from netdsl.tooling.analysis import Analysis

ROOT = Path(__file__).resolve().parents[1]
LIB = """\
# two convolutions
# (the second keeps the width)
block pair(x, width, k=3) {
    h = relu(conv2d(x, width, kernel=k, padding=k // 2))
    return relu(conv2d(h, width, kernel=k, padding=k // 2))
}
"""
NET = """\
import "lib.net" as lib

network n {
    input x: f32[N, 3, 16, 16]
    repeat 2 as i {
        x = lib.pair(x, width=8, k=3)
    }
    output x
}
"""


@pytest.fixture
def files(tmp_path):
    (tmp_path / "lib.net").write_text(LIB)
    (tmp_path / "net.net").write_text(NET)
    return tmp_path


def test_hover_and_definition_across_files(files):
    a = Analysis(NET, str(files / "net.net"))
    assert a.diagnostics == []
    # the block call, made twice by the repeat
    h = a.hover(6, 17)
    assert "block pair(x, width, k=3)" in h and "two convolutions\n(the second keeps" in h
    assert "returns `f32[N, 8, 16, 16]`" in h
    assert a.definition(6, 17).file.endswith("lib.net") and a.definition(6, 17).line == 3
    # a keyword argument: the parameter, with its default, and where it is declared
    h = a.hover(6, 34)
    assert "k = 3" in h and "parameter of `block pair(x, width, k=3)`" in h
    d = a.definition(6, 34)
    assert (Path(d.file).name, d.line, d.column) == ("lib.net", 3, 22)
    # the loop variable's uses and the tensor, with the node that made it
    h = a.hover(8, 12)
    assert "x: f32[N, 8, 16, 16]" in h
    assert "made by `relu` (node `pair[1].relu_1`) in block `pair`" in h
    # the import statement: the module
    assert a.definition(1, 10).file.endswith("lib.net")
    assert "blocks: `pair`" in a.hover(1, 10)


def test_inside_a_block_of_an_imported_file(files):
    lib = Analysis(LIB, str(files / "lib.net"))
    assert lib.diagnostics == []  # a library of blocks: no "defines no network"
    assert [s.name for s in lib.symbols()] == ["pair"]
    assert lib.symbols()[0].range[:3] == (3, 1, 6)


def test_completion(files):
    a = Analysis(NET, str(files / "net.net"))
    # after `lib.`: its blocks; inside `lib.pair(`: its parameters
    broken = NET.replace("x = lib.pair(x, width=8, k=3)", "x = lib.")
    items = a.completions(6, 17, broken)
    assert [c.label for c in items] == ["pair"] and items[0].detail == "block pair(x, width, k=3)"
    partial = NET.replace("x = lib.pair(x, width=8, k=3)", "x = lib.pair(x, ")
    labels = [c.label for c in a.completions(6, 25, partial)]
    assert labels[:3] == ["x=", "width=", "k="] and "conv2d" in labels
    # nested: the innermost open call counts
    nested = NET.replace("x = lib.pair(x, width=8, k=3)", "x = lib.pair(conv2d(x, ")
    labels = [c.label for c in a.completions(6, 32, nested)]
    assert "kernel=" in labels and "width=" not in labels


def test_errors_in_an_imported_file_point_at_the_call(files):
    pytest.importorskip("pygls")
    from netdsl.tooling.lsp import to_lsp_diagnostic

    (files / "lib.net").write_text(LIB.replace("kernel=k,", "kernel=k, strid=1,"))
    a = Analysis(NET, str(files / "net.net"))
    assert len(a.diagnostics) == 1
    d = to_lsp_diagnostic(a.diagnostics[0], str(files / "net.net"))
    assert "strid" in d.message and "lib.net:4" in d.message
    assert (d.range.start.line, d.range.start.character) == (5, 12)  # lib.pair in net.net
    related = [(Path(r.location.uri).name, r.location.range.start.line)
               for r in d.related_information]
    assert related[0] == ("lib.net", 3)  # the error itself
    assert ("net.net", 5) in related


def test_syntax_errors_leave_symbols_empty(files):
    a = Analysis("network n {", str(files / "x.net"))
    assert len(a.diagnostics) == 1 and "syntax error" in a.diagnostics[0].message
    assert a.symbols() == [] and a.hover(1, 1) is None


def check_errors(text: str, file: str) -> list:
    """The errors `netdsl check` reports for `text`: load, then bind the batch."""
    import netdsl
    from netdsl.errors import NetdslError
    try:
        netdsl.loads(text, file=file).lower(1)
    except NetdslError as e:
        return [(d.message, d.loc, d.stack) for d in e.diagnostics]
    return []


@settings(derandomize=True, deadline=None, database=None, max_examples=40,
          suppress_health_check=list(HealthCheck))
@given(_mutations(SMALL, 2))
def test_the_diagnostics_are_the_checkers(text):
    """For mutants of a program that uses most of the language, the server reports
    exactly what `netdsl check` does (a file of blocks only aside: no "no network")."""
    expected = check_errors(text, FILE)
    if any("defines no `network`" in m or "networks (" in m for m, _, _ in expected):
        return
    got = [(d.message, d.loc, d.stack) for d in Analysis(text, FILE).diagnostics]
    assert got == expected
