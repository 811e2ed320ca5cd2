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


def example_feeds(g, seed: int = 0) -> dict:
    """Random data for a lowered example graph's inputs (integer inputs in {0, 1}, which
    any class count or vocabulary accepts); the optimizer's `lr` keeps its default."""
    import numpy as np
    rng = np.random.default_rng(seed)
    feeds = {}
    for n in g.by_op("input"):
        if n.name == "lr":
            continue
        if n.type.is_float:
            feeds[n.name] = rng.standard_normal(n.type.shape)
        else:
            feeds[n.name] = rng.integers(0, 2, n.type.shape)
    return feeds
