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


def test_the_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"Run the tests.*?```\n(.*?)\n```", readme, re.S)
    assert m, "README.md lost its test command"
    command = m.group(1).strip()
    assert "pip install torch==" in command  # so the PyTorch comparisons run
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert command in ci, f"README's `{command}` is not what .ci/run runs"


def test_pytest_names_the_modules_it_skipped(tmp_path):
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_needs_x.py").write_text(
        "import pytest\nx = pytest.importorskip('netdsl_no_such_module')\n"
        "def test_x():\n    pass\n")
    (tmp_path / "test_ok.py").write_text("def test_ok():\n    pass\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                          str(tmp_path)], capture_output=True, text=True, cwd=tmp_path,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 test module(s) skipped" in out.stdout
    assert "SKIPPED MODULE test_needs_x.py: could not import 'netdsl_no_such_module'" in \
        out.stdout, out.stdout
