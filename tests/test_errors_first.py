"""Errors first (netdsl.frontend.repeats): a long repeat whose copies are all alike is
cut after two while the program is checked, so that an error after it is reported
without expanding it; what is reported is what the whole expansion reports, and a
program without errors gets every copy."""
from __future__ import annotations

import textwrap

import pytest

import netdsl
from netdsl.errors import NetdslError
from netdsl.frontend.elaborate import Elaborator


def program(body: str, blocks: str = "") -> str:
    return textwrap.dedent(blocks) + "network n {\n    input x: f32[N, 16]\n" + textwrap.indent(
        textwrap.dedent(body).strip("\n"), "    ") + "\n}\n"


def outcome(src: str, errors_first: bool, monkeypatch) -> tuple:
    """(the rendered diagnostics or None, the node count or None, repeats cut)."""
    cuts = []
    monkeypatch.setattr(Elaborator, "errors_first", errors_first)
    real = Elaborator._repeat

    def counted(self, st, n, frame):
        before = self.cut_repeats
        real(self, st, n, frame)
        cuts.append(self.cut_repeats - before)
    monkeypatch.setattr(Elaborator, "_repeat", counted)
    try:
        net = netdsl.loads(src, file="p.net")
    except NetdslError as e:
        return e.render(), None, sum(cuts)
    return None, len(net.graph.nodes), sum(cuts)


# each: a long repeat, then a mistake (or none) after it
PROGRAMS = {
    "relus then a misspelt name": ("""
        h = x
        repeat 20000 {
            h = relu(h)
        }
        output linear(hh, 10)
    """, True),
    "a shape error after the repeat": ("""
        h = x
        repeat 6000 {
            a = relu(h)
            h = a + h
        }
        output conv2d(h, 4)
    """, True),
    "no mistake": ("""
        h = x
        repeat 6000 {
            h = relu(h) * 2
        }
        output h
    """, True),
    "copies that differ: pooling halves the length": ("""
        h = reshape(x, (-1, 1, 16))
        repeat 10000 {
            h = maxpool1d(h, 2)
        }
        output h
    """, False),
    "a static value that changes": ("""
        h = x
        k = 1
        repeat 6000 {
            h = relu(h)
            k = k + 1
        }
        output linear(h, k)
    """, False),
    "an index": ("""
        h = x
        repeat 20000 as i {
            h = relu(h)
        }
        output linear(hh, 10)
    """, False),
    "parameters in the body": ("""
        h = x
        repeat 2000 {
            h = relu(linear(h, 16))
        }
        output linear(hh, 10)
    """, False),
}


@pytest.mark.parametrize("name", PROGRAMS)
def test_a_cut_check_reports_what_the_whole_expansion_reports(name, monkeypatch):
    src, cut = PROGRAMS[name]
    src = program(src)
    whole = outcome(src, False, monkeypatch)
    fast = outcome(src, True, monkeypatch)
    assert fast[:2] == whole[:2]
    assert whole[2] == 0 and (fast[2] > 0) == cut


def test_a_tied_weight_that_a_later_copy_cannot_find_is_not_cut(monkeypatch):
    """The first copy reads `h.weight` of the linear before the loop; the second reads it
    of the first copy's relu, which has none: the second copy fails, as it would in the
    whole expansion, so nothing is cut."""
    src = program("""
        h = linear(x, 16)
        repeat 6000 {
            h = relu(linear(h, 16, weight=h.weight))
        }
        output h
    """)
    whole = outcome(src, False, monkeypatch)
    assert whole[0] is not None and "weight" in whole[0]
    assert outcome(src, True, monkeypatch) == whole


def test_a_misspelt_name_after_a_million_copies_is_found_before_expanding_them(
        monkeypatch):
    """The check stops at two copies of the million: the error is reported with a graph
    of a handful of nodes built."""
    made = []
    real = Elaborator._run

    def run(self):
        try:
            return real(self)
        finally:
            made.append(len(self.g.nodes))
    monkeypatch.setattr(Elaborator, "_run", run)
    src = program("""
        h = x
        repeat 1_000_000 {
            h = relu(h)
        }
        output linear(hh, 10)
    """)
    with pytest.raises(NetdslError) as e:
        netdsl.loads(src, file="p.net")
    assert e.value.diagnostics[0].message == "`hh` is not defined; did you mean `h`?"
    assert made == [3]  # the input and two relus

