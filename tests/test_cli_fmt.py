"""`netdsl fmt`: rewrites files in place, `--check` and `--diff` change nothing, a file
with errors is reported and left alone, and examples/ and stdlib/ are formatted."""
from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from netdsl_cli.app import app

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()
UGLY = "network n{input x:f32[N,2]\n  h=relu( x ) ;output h}\n"
PRETTY = "network n {\n    input x: f32[N, 2]\n    h = relu(x)\n    output h\n}\n"


def test_fmt_rewrites_in_place(tmp_path):
    f = tmp_path / "a.net"
    f.write_text(UGLY)
    r = runner.invoke(app, ["fmt", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert f.read_text() == PRETTY and "reformatted" in r.output
    r = runner.invoke(app, ["fmt", "--check", str(f)])
    assert r.exit_code == 0 and "already formatted" in r.output


def test_check_and_diff_change_nothing(tmp_path):
    f = tmp_path / "a.net"
    f.write_text(UGLY)
    r = runner.invoke(app, ["fmt", "--check", str(f)])
    assert r.exit_code == 1 and f"would reformat {f}" in r.output
    r = runner.invoke(app, ["fmt", "--diff", str(f)])
    assert r.exit_code == 0 and "+    h = relu(x)\n" in r.output and "-  h=relu( x )" in r.output
    assert f.read_text() == UGLY


def test_a_file_with_errors_is_reported_not_rewritten(tmp_path):
    bad, good = tmp_path / "bad.net", tmp_path / "good.net"
    bad.write_text("network n {\n    h = relu(x\n}\n")
    good.write_text(UGLY)
    r = runner.invoke(app, ["fmt", str(bad), str(good)])
    assert r.exit_code == 1
    assert f"{bad}:3:1: error: syntax error" in r.output and "Traceback" not in r.output
    assert bad.read_text() == "network n {\n    h = relu(x\n}\n"
    assert good.read_text() == PRETTY  # the others are still formatted
    r = runner.invoke(app, ["fmt", "--check", "--json", str(bad), str(good)])
    out = json.loads(r.stdout)
    assert r.exit_code == 1 and out["ok"] is False
    assert [f["ok"] for f in out["files"]] == [False, True]
    assert out["files"][0]["errors"][0]["location"]["line"] == 3


def test_stdin_and_missing_files(tmp_path):
    r = runner.invoke(app, ["fmt", "-"], input=UGLY)
    assert r.exit_code == 0 and r.stdout == PRETTY
    r = runner.invoke(app, ["fmt", str(tmp_path / "nope.net")])
    assert r.exit_code == 1 and "no such file" in r.output



def test_examples_and_stdlib_are_formatted():
    r = runner.invoke(app, ["fmt", "--check", str(ROOT / "examples"), str(ROOT / "stdlib")])
    assert r.exit_code == 0, r.output
