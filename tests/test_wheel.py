"""The built wheel works on its own: grammar and stdlib are package data, `netdsl` runs.

Builds the wheel from a copy of the source tree (so no build/ lands in the checkout),
installs it with no dependencies into a new venv that borrows this environment's
site-packages for the dependencies (fast, no network), and runs `netdsl check` from
another directory.
"""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache",
             ".hypothesis", "runs", "checkpoints"}


def _setuptools_ok() -> bool:
    try:
        return int(version("setuptools").split(".")[0]) >= 68
    except (PackageNotFoundError, ValueError):
        return False


def _run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert r.returncode == 0, f"{cmd} failed:\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=lambda d, names: [
        n for n in names if n in SKIP_DIRS or n.endswith(".egg-info")])
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp / "dist"),
           str(src)]
    if _setuptools_ok():  # else pip builds in an isolated env (needs the index)
        cmd.insert(4, "--no-build-isolation")
    _run(cmd)
    (whl,) = (tmp / "dist").glob("netdsl-*.whl")
    return whl


def test_wheel_has_grammar_and_stdlib(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "netdsl_cli/app.py" in names and "netdsl/ir/stats.py" in names
    assert "netdsl/grammar/__init__.py" in names and "netdsl/stdlib/__init__.py" in names
    lark = sorted(p.name for p in (ROOT / "grammar").glob("*.lark"))
    stdlib = sorted(p.name for p in (ROOT / "stdlib").glob("*.net"))
    assert lark, "grammar/ has no .lark file"
    for name in lark:
        assert f"netdsl/grammar/{name}" in names
    for name in stdlib:
        assert f"netdsl/stdlib/{name}" in names
    entry = [n for n in names if n.endswith("entry_points.txt")]
    assert entry and "netdsl = netdsl_cli.app:main" in zipfile.ZipFile(wheel).read(
        entry[0]).decode()


def test_installed_wheel_runs(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    vpy = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(vpy), "install", "--no-deps", "-q",
          str(wheel)])
    # the dependencies come from this environment's site-packages (a .pth adds them after
    # the venv's own), which holds netdsl only as an editable finder that is not loaded
    purelib = Path(_run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
                        ).stdout.strip())
    deps = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib"),
            *site.getsitepackages()}
    (purelib / "_netdsl_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    where = tmp_path / "elsewhere"
    where.mkdir()
    probe = ("import importlib.resources as r, netdsl, netdsl.grammar, netdsl.stdlib;"
             "print(netdsl.__file__);"
             "print(sorted(p.name for p in r.files('netdsl.grammar').iterdir()));"
             "print(sorted(p.name for p in r.files('netdsl.stdlib').iterdir()))")
    out = _run([str(vpy), "-c", probe], cwd=where, env=env).stdout.splitlines()
    assert out[0].startswith(str(venv)), f"netdsl imported from {out[0]}, not the wheel"
    for p in (ROOT / "grammar").glob("*.lark"):
        assert p.name in out[1]
    for p in (ROOT / "stdlib").glob("*.net"):
        assert p.name in out[2]
    r = subprocess.run([str(venv / "bin" / "netdsl"), "--help"], cwd=where, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "check" in r.stdout, r.stderr

    examples = sorted((ROOT / "examples").glob("*.net"))
    if not examples:
        pytest.skip("examples/ has no .net file yet")
    ex = min(examples, key=lambda p: p.stat().st_size)
    # run from another directory: the stdlib must come from the installed package data
    r = subprocess.run([str(venv / "bin" / "netdsl"), "check", str(ex)], cwd=where, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith(f"{ex}: ok — network ")
