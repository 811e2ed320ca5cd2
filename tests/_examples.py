"""The example networks, each loaded once per test session (shared by the test files)."""
from functools import cache
from pathlib import Path

import pytest

import netdsl

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.net"))


@cache
def load(name: str) -> netdsl.Network:
    """`load("resnet50.net")`: the checked network of examples/<name>."""
    try:
        return netdsl.load(ROOT / "examples" / name)
    except netdsl.NetdslError as e:  # pragma: no cover - shows the diagnostics on failure
        pytest.fail(e.render())


def n_params(g) -> int:
    return sum(n.type.numel() for n in g.params())
