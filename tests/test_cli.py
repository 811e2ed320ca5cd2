"""The `netdsl` command line: exit codes, output, and the `--json` shape.

Most tests run the CLI against a stand-in `netdsl.api` (a hand-built graph, no front end)
so they test the CLI alone; the tests at the end use the real front end on real files
and skip while `netdsl.api` does not exist yet.
"""
from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from _toy_graphs import toy
from typer.testing import CliRunner

from netdsl.errors import Diagnostic, NetdslError, SourceLoc, register_source
from netdsl_cli.app import app, main

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


class FakeNetwork:
    def __init__(self, name, train_batch=None):
        self.name = name
        self.train = None if train_batch is None else types.SimpleNamespace(batch=train_batch)

    def lower(self, batch=None):
        g = toy(5)
        return g if batch is None else g.bind(batch)


def fake_load(path):
    """The file's first word says what to do: toy, toy8 (train batch 8), bad, bad2, crash,
    interrupt."""
    word = Path(path).read_text().split()[0]
    if word == "toy":
        return FakeNetwork("toy")
    if word == "toy8":
        return FakeNetwork("toy", train_batch=8)
    if word in ("bad", "bad2"):
        loc = SourceLoc(str(path), 1, 1, 1, 4)
        diags = [Diagnostic("unknown operator `bad`", loc)]
        if word == "bad2":
            diags.append(Diagnostic("second problem", SourceLoc(str(path), 1, 5)))
        raise NetdslError(diagnostics=diags)
    if word == "crash":
        raise ZeroDivisionError("oops")
    if word == "interrupt":
        raise KeyboardInterrupt
    raise AssertionError(word)


@pytest.fixture
def fake_api(monkeypatch):
    mod = types.ModuleType("netdsl.api")
    mod.load = fake_load
    monkeypatch.setitem(sys.modules, "netdsl.api", mod)
    import netdsl
    monkeypatch.setattr(netdsl, "api", mod, raising=False)
    return mod


@pytest.fixture
def files(tmp_path):
    def make(word: str) -> str:
        p = tmp_path / f"{word}.net"
        p.write_text(word + " rest of line\n")
        register_source(str(p), p.read_text())
        return str(p)
    return make


def invoke(*args, env=None):
    return runner.invoke(app, list(args), env=env)


# -- check -------------------------------------------------------------------------------

def test_check_ok(fake_api, files):
    f = files("toy")
    r = invoke("check", f)
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == f"{f}: ok — network toy, 2,770 params, 15 nodes"


def test_check_reports_every_file(fake_api, files):
    good, bad = files("toy"), files("bad2")
    r = invoke("check", bad, good)
    assert r.exit_code == 1
    assert f"{good}: ok" in r.stdout  # the good file is still checked after the bad one
    assert f"{bad}:1:1: error: unknown operator `bad`" in r.stderr
    assert "second problem" in r.stderr  # both diagnostics
    assert "^^^" in r.stderr  # the caret under the source line
    assert "Traceback" not in r.output


def test_check_json(fake_api, files):
    good, bad = files("toy"), files("bad")
    r = invoke("check", "--json", good, bad)
    assert r.exit_code == 1
    d = json.loads(r.stdout)
    assert d["ok"] is False
    assert [f["ok"] for f in d["files"]] == [True, False]
    assert d["files"][0]["params"] == 2770 and d["files"][0]["network"] == "toy"
    assert d["files"][1]["errors"][0]["message"] == "unknown operator `bad`"
    assert d["files"][1]["errors"][0]["location"]["line"] == 1


# -- show --------------------------------------------------------------------------------

def test_show_table(fake_api, files):
    r = invoke("show", files("toy"), env={"COLUMNS": "160"})
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "blk[0..4] x5" in out and "stage.blk[1]" not in out
    assert "total (15 ops, 6 convs)" in out
    assert "2,770" in out and "batch 1" in out
    assert "f32[1, 10]" in out  # output shapes, bound to the batch


def test_show_json_default_batch_from_train(fake_api, files):
    r = invoke("show", files("toy8"), "--json", "--depth", "1")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert {"network", "params", "flops_forward", "activation_bytes", "nodes", "convs",
            "batch", "rows"} <= set(d)
    assert d["batch"] == 8 and d["params"] == 2770 and d["nodes"] == 15 and d["convs"] == 6
    assert [row["name"] for row in d["rows"]] == ["stem", "stage", "flat", "fc", "loss"]
    r2 = invoke("show", files("toy8"), "--json", "--batch", "2")
    assert json.loads(r2.stdout)["batch"] == 2
    assert json.loads(r2.stdout)["flops_forward"] == 65144


def test_show_user_error_json(fake_api, files):
    r = invoke("show", files("bad"), "--json")
    assert r.exit_code == 1
    assert json.loads(r.stdout)["errors"][0]["message"] == "unknown operator `bad`"


# -- graph -------------------------------------------------------------------------------

def test_graph_formats(fake_api, files):
    f = files("toy")
    r = invoke("graph", f)
    assert r.exit_code == 0 and r.stdout == toy(5).to_text()
    r = invoke("graph", f, "--format", "json", "--batch", "3")
    assert r.exit_code == 0 and json.loads(r.stdout) == toy(5).bind(3).to_json()
    r = invoke("graph", f, "-f", "dot")
    assert r.exit_code == 0 and r.stdout.startswith('digraph "toy"')
    assert "blk[0..4] x5" in r.stdout
    assert invoke("graph", f, "-f", "png").exit_code != 0


# -- errors ------------------------------------------------------------------------------

def test_internal_error_exit_2_without_traceback(fake_api, files, monkeypatch):
    monkeypatch.delenv("NETDSL_DEBUG", raising=False)
    r = invoke("show", files("crash"))
    assert r.exit_code == 2
    assert "internal error: ZeroDivisionError: oops" in r.stderr
    assert "Traceback" not in r.output
    r = invoke("check", files("crash"), env={"NETDSL_DEBUG": "1"})
    assert r.exit_code == 2 and "Traceback" in r.stderr


def test_interrupt_exit_130(fake_api, files):
    assert invoke("check", files("interrupt")).exit_code == 130


def test_main_exit_codes(fake_api, files, capsys):
    def code(*argv):
        with pytest.raises(SystemExit) as e:
            main(list(argv))
        return e.value.code
    assert code("check", files("toy")) == 0
    assert code("check", files("bad")) == 1
    assert code("show", files("crash")) == 2
    assert code("check", files("interrupt")) == 130
    assert code("show", "--no-such-option", files("toy")) == 1  # usage errors are user errors
    assert code("--version") == 0
    assert "netdsl " in capsys.readouterr().out


def test_help_runs_without_front_end():
    r = subprocess.run([sys.executable, "-c", "from netdsl_cli.app import main; main()",
                        "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for cmd in ("check", "show", "graph"):
        assert cmd in r.stdout


def test_check_process_exits_with_its_code_and_output(tmp_path):
    """`netdsl check` ends its process without freeing the checked graphs (os._exit): the
    output is all there and the exit code is the command's."""
    good = Path(__file__).resolve().parent.parent / "examples" / "digits-mlp.net"
    bad = tmp_path / "bad.net"
    bad.write_text("network broken {\n    input x: f32[N, 4]\n    output relu(y)\n}\n")
    for files, want in (([good], 0), ([good, bad], 1)):
        r = subprocess.run([sys.executable, "-m", "netdsl_cli", "check", *map(str, files)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == want, r.stderr
        assert r.stdout.startswith(f"{good}: ok") and r.stdout.endswith("\n")
        assert ("bad.net:3:" in r.stderr) == (want == 1)


# -- with the real front end -------------------------------------------------------------

def _real_api():
    try:
        import netdsl.api as api
    except ImportError:
        pytest.skip("netdsl.api does not exist yet")
    return api


EXAMPLES = sorted((ROOT / "examples").glob("*.net"))
SMALL = [p for p in EXAMPLES if p.stat().st_size < 4000 and "2504" not in p.name][:3]


def test_real_check_syntax_error(tmp_path):
    _real_api()
    bad = tmp_path / "broken.net"
    bad.write_text("network broken {\n    input x: f32[N, 3\n    )))) !!\n")
    r = invoke("check", str(bad))
    assert r.exit_code == 1, r.output
    assert f"{bad}:" in r.stderr and "error" in r.stderr
    assert "Traceback" not in r.output
    r = invoke("check", "--json", str(bad))
    assert r.exit_code == 1 and json.loads(r.stdout)["files"][0]["errors"]


def test_real_missing_file(tmp_path):
    _real_api()
    r = invoke("check", str(tmp_path / "nope.net"))
    assert r.exit_code == 1, r.output  # a user error, not a crash
    assert "Traceback" not in r.output


SMALL_NET = """
block unit(x, c) {
    return relu(batchnorm(conv2d(x, c, kernel=3, padding=1, bias=false)))
}
network small {
    input x: f32[N, 3, 16, 16]
    input y: i64[N]
    h = unit(x, 8)
    repeat 4 {
        h = unit(h, 8)
    }
    logits = linear(flatten(global_avgpool(h)), 10)
    output logits
    loss softmax_cross_entropy(logits, y)
}
train {
    batch = 32
}
"""


def test_real_small_network(tmp_path):
    _real_api()
    f = tmp_path / "small.net"
    f.write_text(SMALL_NET)
    r = invoke("check", str(f))
    assert r.exit_code == 0, r.output
    # conv 3->8 3x3 (216) + BN (16); 4 x (conv 8->8 3x3 (576) + BN (16)); linear 8->10 (90)
    assert r.stdout.strip() == f"{f}: ok — network small, 2,690 params, 19 nodes"
    r = invoke("show", str(f), "--json")
    d = json.loads(r.stdout)
    assert d["batch"] == 32  # from the train section
    top = [(row["name"], row["count"], row["params"]) for row in d["rows"] if row["level"] == 0]
    assert top[:2] == [("unit", 1, 232), ("unit[1..4] x4", 4, 2368)]
    assert d["convs"] == 5
    # 2 x MACs: 32 x 8 x 16 x 16 outputs, 27 MACs each (first conv), 72 (the others)
    convs = 2 * 32 * 8 * 16 * 16 * (27 + 4 * 72)
    assert d["flops_forward"] > convs


@pytest.mark.parametrize("path", SMALL, ids=[p.name for p in SMALL])
def test_real_examples(path):
    _real_api()
    r = invoke("check", str(path))
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(f"{path}: ok — network ")
    r = invoke("show", str(path), "--json", "--batch", "2")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["batch"] == 2 and d["params"] > 0 and d["nodes"] > 0
    assert sum(row["params"] for row in d["rows"] if row["level"] == 0) == d["params"]
    for fmt in ("text", "json", "dot"):
        assert invoke("graph", str(path), "-f", fmt).exit_code == 0


def test_real_flagship_stays_short():
    _real_api()
    path = ROOT / "examples" / "resnet2504.net"
    if not path.exists():
        pytest.skip("examples/resnet2504.net does not exist")
    r = invoke("show", str(path), "--json", "--depth", "2")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["params"] == 922_870_056 and d["convs"] == 2507 and d["batch"] == 16
    assert len(d["rows"]) <= 30  # 8,356 ops, folded
    big = [row for row in d["rows"] if row["count"] == 789]
    assert [row["name"] for row in big] == ["bottleneck[1..789] x789"]
    r = invoke("graph", str(path), "-f", "dot")
    assert r.exit_code == 0 and r.stdout.count("\n") < 200
