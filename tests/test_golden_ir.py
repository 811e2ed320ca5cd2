"""The IR printout of a small network, against a stored copy; and the JSON round trip of
every example.

When the printer or the front end changes the printout on purpose, regenerate with

    NETDSL_UPDATE_GOLDEN=1 /work/venv/bin/pytest tests/test_golden_ir.py

and review the diff of tests/golden/ before committing it.
"""
import os
from pathlib import Path

import pytest
from _examples import EXAMPLES, load

from netdsl.ir.graph import Graph

GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("NETDSL_UPDATE_GOLDEN") == "1"

# (example, golden file): small networks whose whole printout is worth pinning
CASES = [("digits-cnn.net", "digits-cnn.ir")]


@pytest.mark.parametrize("example,golden", CASES)
def test_golden_ir(example, golden):
    text = load(example).graph.to_text()
    path = GOLDEN / golden
    if UPDATE:
        path.write_text(text if text.endswith("\n") else text + "\n")
    assert path.exists(), f"no golden file {path}; run with NETDSL_UPDATE_GOLDEN=1"
    assert text.rstrip("\n") == path.read_text().rstrip("\n"), (
        f"the IR of {example} differs from {path}; if the change is intended, regenerate "
        "with NETDSL_UPDATE_GOLDEN=1")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_json_round_trip(path):
    g = load(path.name).graph
    back = Graph.from_json(g.to_json())
    assert back.to_text() == g.to_text()


def test_json_round_trip_keeps_locations():
    g = load("transformer-tiny.net").graph
    assert Graph.from_json(g.to_json()).to_text(locations=True) == g.to_text(locations=True)
