"""docs/tutorial.md stays true: its files are written and its commands run, in order, in a
fresh folder; each command exits as the text says (0, or `# exits N`), and the output
shown under it appears in what it prints (`...` stands for anything)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from netdsl_cli.app import app

DOC = Path(__file__).resolve().parents[1] / "docs" / "tutorial.md"
_STEP = re.compile(r"<!-- file: (\S+) -->\n```net\n(.*?)```|```console\n(.*?)```", re.S)


def steps(text: str) -> list[tuple]:
    """("file", name, content) and ("run", argv, exit code, expected lines), in order."""
    out = []
    for m in _STEP.finditer(text):
        if m.group(1):
            out.append(("file", m.group(1), m.group(2)))
            continue
        cmd = None
        for line in m.group(3).rstrip("\n").split("\n"):
            if line.startswith("$ "):
                if cmd:
                    out.append(cmd)
                argv, _, note = line[2:].partition("#")
                code = int(re.fullmatch(r"\s*exits (\d+)\s*", note).group(1)) if note else 0
                cmd = ("run", shlex.split(argv), code, [])
            else:
                assert cmd is not None, f"output before any command: {line!r}"
                cmd[3].append(line)
        if cmd:
            out.append(cmd)
    return out


def _norm(s: str) -> str:
    return " ".join(s.split())


def shows(expected: list[str], output: str) -> str | None:
    """None if the expected lines appear in the output in order (`...` alone skips lines,
    inside a line matches anything); else the first line not found."""
    lines = [_norm(x) for x in output.split("\n")]
    k = 0
    for e in expected:
        if e.strip() == "...":
            continue
        pat = re.compile(".*".join(re.escape(part) for part in _norm(e).split("...")))
        while k < len(lines) and not pat.fullmatch(lines[k]):
            k += 1
        if k == len(lines):
            return e
        k += 1
    return None


STEPS = steps(DOC.read_text(encoding="utf-8"))


def test_the_tutorial_has_commands():
    runs = [s for s in STEPS if s[0] == "run"]
    assert len(runs) >= 10 and all(s[1][0] == "netdsl" for s in runs)
    assert {s[1][1] for s in runs} >= {"check", "show", "graph", "run", "report", "fmt"}


@pytest.mark.slow
def test_every_command_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "160")
    runner = CliRunner()
    for step in STEPS:
        if step[0] == "file":
            (tmp_path / step[1]).write_text(step[2])
            continue
        _, argv, code, expected = step
        r = runner.invoke(app, argv[1:])
        shown = f"$ {shlex.join(argv)}\n{r.output}"
        assert r.exit_code == code, shown
        missing = shows(expected, r.output)
        assert missing is None, f"not in the output: {missing!r}\n{shown}"
