"""docs/language.md stays true: its examples parse, its operator table matches the registry."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import netdsl
from netdsl.frontend import parse

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "language.md"
BLOCKS = re.findall(r"```net\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)


def test_the_reference_has_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("src", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_net_code_blocks_parse(src):
    parse(src, file="docs/language.md")  # every ```net block is valid syntax
    if re.search(r"^\s*network\s", src, re.M):  # a complete program: it loads and checks
        netdsl.loads(src, file=str(ROOT / "docs" / "example.net"))


def test_operator_table_is_generated_from_the_registry():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import gen_ops
    finally:
        sys.path.pop(0)
    assert gen_ops.current() == gen_ops.block(), \
        "docs/language.md's operator table is stale: run python docs/gen_ops.py --write"


def test_gen_ops_runs_as_a_script():
    out = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_ops.py")],
                         capture_output=True, text=True, check=True).stdout
    assert "| `conv2d(x, out_channels, kernel=1" in out
