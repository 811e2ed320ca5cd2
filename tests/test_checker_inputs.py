"""Whole-file inputs: deep nesting and long chains, encodings, empty files, and the
messages for mistakes that used to confuse (two networks of one name, an annotation
before `output`, float overflow)."""
from __future__ import annotations

import gc
import sys

import pytest
from test_errors import fails, net

import netdsl
from netdsl.errors import NetdslError
from netdsl.frontend.deep import MAX_NESTING, run_deep

HEAD = "network n {\n    input x: f32[N, 4]\n"


def nested_calls(n: int) -> str:
    return HEAD + "    h = " + "relu(" * n + "x" + ")" * n + "\n    output h\n}\n"


def nested_ifs(n: int) -> str:
    body = "if true {\n" * n + "h = x\n" + "}\n" * n
    return HEAD + body + "    output h\n}\n"


def nested_repeats(n: int) -> str:
    body = "repeat 1 {\n" * n + "h = relu(x)\n" + "}\n" * n
    return HEAD + body + "    output h\n}\n"


def chain(n: int) -> str:
    return (HEAD + "    k = " + " + ".join(["1"] * n) + "\n    h = " + " + ".join(["x"] * n)
            + "\n    m = " + "-(" * n + "2" + ")" * n + "\n    output h\n}\n")


@pytest.mark.parametrize("make,nodes", [
    (nested_calls, 5000), (nested_ifs, 0), (nested_repeats, 1), (chain, 4999)],
    ids=["calls", "ifs", "repeats", "chains"])
def test_5000_levels_compile(make, nodes):
    g = netdsl.loads(make(5000), file="deep.net").graph
    assert len([n for n in g.nodes if n.op != "input"]) == nodes


@pytest.mark.parametrize("make,line", [(nested_calls, 3), (nested_ifs, MAX_NESTING + 1)],
                         ids=["calls", "ifs"])
def test_beyond_the_limit_is_reported_where_it_is_passed(make, line):
    with pytest.raises(NetdslError) as info:
        netdsl.loads(make(MAX_NESTING + 50), file="deep.net")
    d = info.value.diagnostics[0]
    assert f"more than {MAX_NESTING:,} levels" in d.message
    assert d.loc.line == line
    if make is nested_calls:  # at a call, near MAX_NESTING calls in (the network, the
        # statement and the assignment are levels too)
        k, rest = divmod(d.loc.column - len("    h = ") - 1, len("relu("))
        assert rest == 0 and MAX_NESTING - 10 <= k < MAX_NESTING


def test_the_front_end_leaves_the_interpreter_as_it_found_it():
    limit, enabled = sys.getrecursionlimit(), gc.isenabled()
    seen = {}

    def probe():
        seen["gc"], seen["limit"] = gc.isenabled(), sys.getrecursionlimit()
        return 7
    assert run_deep(probe) == 7
    # inside: a deep stack, and no garbage collection walking the growing parse tree
    assert seen["limit"] > 10 * MAX_NESTING and seen["gc"] is False
    assert sys.getrecursionlimit() == limit and gc.isenabled() == enabled
    with pytest.raises(ZeroDivisionError):  # errors come back to the caller's thread
        run_deep(lambda: 1 // 0)
    assert sys.getrecursionlimit() == limit and gc.isenabled() == enabled


def test_a_byte_order_mark_is_accepted(tmp_path):
    p = tmp_path / "bom.net"
    p.write_bytes(b"\xef\xbb\xbf" + (HEAD + "    output x\n}\n").encode())
    assert netdsl.load(p).name == "n"
    assert netdsl.loads("\ufeff" + HEAD + "    output x\n}\n").name == "n"


@pytest.mark.parametrize("bom", [b"", b"\xef\xbb\xbf"])
def test_bytes_that_are_not_utf8_are_located(tmp_path, bom):
    p = tmp_path / "latin1.net"
    p.write_bytes(bom + HEAD.encode() + "    # café ".encode() + b"\xe9t\xe9\n    output x\n}\n")
    with pytest.raises(NetdslError) as info:
        netdsl.load(p)
    d = info.value.diagnostics[0]
    assert "not UTF-8" in d.message and "0xE9" in d.message
    assert (d.loc.line, d.loc.column) == (3, 12)
    assert "^" in info.value.render()  # the quoted line survives the bad byte


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "  # two\n# comments"])
def test_an_empty_file_says_so(text):
    e = fails(text)
    assert "is empty (or holds only comments)" in e.message and "network NAME" in e.message


def test_two_networks_of_one_name():
    e = fails(HEAD + "    output x\n}\n" + HEAD + "    output x\n}\n")
    assert "a second network named `n` (the first is at line 1)" in e.message
    assert (e.loc.line, e.loc.column) == (5, 9)


@pytest.mark.parametrize("ann", ["@recompute", "@stage(1)", "@keep\n"])
@pytest.mark.parametrize("kw", ["output x", "loss mse(x, x)"])
def test_an_annotation_before_output_or_loss(ann, kw):
    e = fails(net(f"{ann} {kw}"))
    assert f"an annotation cannot be put on `{kw.split()[0]}`" in e.message
    assert "top level" not in e.message


def test_float_overflow_is_in_words():
    e = fails(net("k = 10.0 ** 400\noutput x"))
    assert e.message == "the result of `10.0 ** 400` is too large for a float"


@pytest.mark.parametrize("name,phrase", [
    ("upsample", "netdsl has no `upsample` operator"),
    ("dense", "netdsl calls this `linear`"),
    ("Dense", "netdsl calls this `linear`"),
    ("cross_entropy", "netdsl calls this `softmax_cross_entropy`"),
    ("cat", "netdsl calls this `concat`"),
    ("view", "netdsl calls this `reshape`"),
    ("BatchNorm2d", "netdsl calls this `batchnorm`"),
    ("swish", "netdsl calls this `silu`"),
    ("rleu", "did you mean `relu`?"),  # not a known word: by spelling
])
def test_unknown_operators_are_suggested_by_meaning(name, phrase):
    from netdsl.ir import registry
    if name in registry.load_all():  # an operator added since (the ops issue)
        pytest.skip(f"`{name}` is an operator now")
    e = fails(net(f"h = {name}(x)\noutput h"))
    assert e.message.startswith(f"`{name}` is not defined; {phrase}")
    assert "transpose" not in e.message


def test_the_synonym_table_points_at_real_names_or_future_ones():
    """Every word's first choice is a netdsl name that exists, or one an operator may take
    later (then a later choice exists or the message says there is none)."""
    from netdsl.frontend.synonyms import SYNONYMS
    from netdsl.ir import registry
    registry.load_all()
    builtins = {"parameter", "split"}
    for word, choices in SYNONYMS.items():
        assert word == word.lower() and choices
        assert word not in registry.OPS or word in choices, word
        assert all(c.isidentifier() for c in choices)
    assert any(c in registry.OPS or c in builtins
               for choices in SYNONYMS.values() for c in choices)


def test_without_room_for_a_big_stack_the_front_end_still_runs(monkeypatch):
    """Where a thread with a large stack cannot start (a `ulimit -v`), the front end runs
    on the caller's thread: ordinary programs check as before."""
    import threading

    def refuse(self):
        raise RuntimeError("can't start new thread")
    monkeypatch.setattr(threading.Thread, "start", refuse)
    limit = sys.getrecursionlimit()
    assert netdsl.loads(net("output relu(x)")).graph["relu"].op == "relu"
    assert sys.getrecursionlimit() == limit and gc.isenabled()
