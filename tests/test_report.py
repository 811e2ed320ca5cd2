"""`netdsl report` and `netdsl run --plot`: curves from real logs, as valid PNGs of the
documented size, an HTML report, summaries that match the log, and clear errors for bad
logs and a missing matplotlib."""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from netdsl.tooling.curves import DPI, FIG_INCHES
from netdsl_cli.app import app

runner = CliRunner()
MLP = str(Path(__file__).resolve().parents[1] / "examples" / "digits-mlp.net")
SIZE = (int(FIG_INCHES[0] * DPI), int(FIG_INCHES[1] * DPI))


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real run of the digits MLP: its log and the --plot it wrote."""
    d = tmp_path_factory.mktemp("run")
    log, plot = d / "mlp.jsonl", d / "curves.png"
    r = runner.invoke(app, ["run", MLP, "--steps", "12", "--eval-every",
                            "6", "--log", str(log), "--plot", str(plot), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["plot"] == str(plot)
    return log, plot


def test_run_plot_writes_a_png(trained):
    _, plot = trained
    assert png_size(plot.read_bytes()) == SIZE


def test_report_overlays_runs(trained, tmp_path):
    log, _ = trained
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"step": s, "loss": 3.0 / s, "lr": 0.1}) + "\n"
                             for s in range(1, 6)))
    png, page = tmp_path / "c.png", tmp_path / "r.html"
    r = runner.invoke(app, ["report", str(log), str(other), "--png", str(png),
                            "--html", str(page), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    mlp, oth = out["runs"]
    assert mlp["run"] == "mlp" and mlp["steps"] == 12
    assert mlp["final_loss"] == records[-1]["loss"]
    assert mlp["min_loss"] == min(x["loss"] for x in records)
    assert mlp["test_accuracy"] == records[-1]["test_accuracy"]
    assert oth == {**oth, "run": "other", "steps": 5, "final_loss": 0.6, "accuracy": None}
    assert png_size(png.read_bytes()) == SIZE
    text = page.read_text()
    assert text.startswith("<!doctype html>") and "data:image/png;base64," in text
    assert "<td>mlp</td>" in text and "<td>other</td>" in text
    r = runner.invoke(app, ["report", str(log)])
    assert r.exit_code == 0 and "mlp" in r.stdout and "final loss" in r.stdout


@pytest.mark.parametrize("content, message", [
    ('{"step": 1, "loss": 2.0}\nnot json\n', ":2: not a JSON line"),
    ('{"step": "one", "loss": 2.0}\n', ":1: a log line must be an object"),
    ("\n", "the log is empty"),
])
def test_bad_logs(tmp_path, content, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    r = runner.invoke(app, ["report", str(f)])
    assert r.exit_code == 1 and message in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["report", str(tmp_path / "missing.jsonl")])
    assert r.exit_code == 1 and "cannot read the log" in r.output


def test_a_missing_matplotlib_is_a_clear_error(trained, tmp_path, monkeypatch):
    log, _ = trained
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    r = runner.invoke(app, ["report", str(log), "--png", str(tmp_path / "x.png")])
    assert r.exit_code == 1 and "pip install 'netdsl[plot]'" in r.output
    assert not (tmp_path / "x.png").exists()
    r = runner.invoke(app, ["run", MLP, "--steps", "1", "--plot",
                            str(tmp_path / "y.png")])
    assert r.exit_code == 1 and "matplotlib" in r.output and "steps" not in r.output


def test_run_plot_after_a_resume_draws_the_whole_run(tmp_path, monkeypatch):
    """--plot with --resume and --log draws the log (every step since the first run, the
    log rewound to the checkpoint), not only the steps this process trained."""
    import netdsl.tooling.curves as curves
    drawn = []
    monkeypatch.setattr(curves, "write_png", lambda runs, path: drawn.extend(runs))
    log, ck = tmp_path / "mlp.jsonl", tmp_path / "ck"
    common = [MLP, "--log", str(log), "--checkpoint", str(ck), "--eval-samples", "0"]
    assert runner.invoke(app, ["run", *common, "--steps", "3"]).exit_code == 0
    r = runner.invoke(app, ["run", *common, "--steps", "5", "--resume", "--plot",
                            str(tmp_path / "c.png")])
    assert r.exit_code == 0, r.output
    [run] = drawn
    assert [s for s, _ in run.series["loss"]] == [1, 2, 3, 4, 5]
