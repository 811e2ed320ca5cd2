"""Test-session hooks: compile the fused CPU kernels beside the first tests, and say which
whole test modules were skipped and why.

Without torch (or CuPy), the PyTorch comparison modules skip at import; pytest's summary
line then only says "5 skipped". This names each skipped module and its reason, so a run
that silently compared nothing against PyTorch is visible."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

# Every fused kernel group in both dtypes, loaded as an executor loads them: from Numba's
# on-disk cache, or on a fresh clone (CI) compiled and written there.
_WARM = """
import os
os.nice(10)
from netdsl.backends.numpy import load_fused
from netdsl.backends.numpy_fused import KERNEL_GROUPS
f = load_fused()
if f is not None:
    f.load(list(KERNEL_GROUPS))
"""
_warming: subprocess.Popen | None = None


def pytest_sessionstart(session):
    """On a fresh clone nothing is in Numba's cache and the tests compile each kernel when
    one first calls it, one at a time, while the front-end tests before them leave a core
    idle. A background process of low priority compiles them all into the cache meanwhile
    (Numba writes each entry to a temporary file and renames it: safe beside the tests'
    own compiles, as MPI ranks are); it ends on its own, or with the session."""
    global _warming
    if importlib.util.find_spec("numba") is None or os.environ.get(
            "NETDSL_FUSED_KERNELS", "1") == "0":
        return
    _warming = subprocess.Popen([sys.executable, "-c", _WARM], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)


def pytest_sessionfinish(session, exitstatus):
    if _warming is not None and _warming.poll() is None:
        _warming.kill()
        _warming.wait()


def skipped_modules(stats: dict) -> dict[str, str]:
    """{module path: reason} for modules skipped as a whole (at collection)."""
    out: dict[str, str] = {}
    for rep in stats.get("skipped", []):
        if getattr(rep, "when", None) not in (None, "collect") or "::" in rep.nodeid:
            continue
        longrepr = rep.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        out[rep.nodeid or str(rep.fspath)] = reason.removeprefix("Skipped: ")
    return out


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    mods = skipped_modules(terminalreporter.stats)
    if not mods:
        return
    terminalreporter.write_sep("-", f"{len(mods)} test module(s) skipped")
    for mod, reason in sorted(mods.items()):
        terminalreporter.write_line(f"SKIPPED MODULE {mod}: {reason}")
    if any("torch" in r for r in mods.values()):
        terminalreporter.write_line("(the PyTorch comparisons need torch: pip install "
                                    "torch==2.13.0, as in the README's test command)")
