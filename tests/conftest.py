"""Test-session hooks: say which whole test modules were skipped and why.

Without torch (or CuPy), the PyTorch comparison modules skip at import; pytest's summary
line then only says "5 skipped". This names each skipped module and its reason, so a run
that silently compared nothing against PyTorch is visible."""
from __future__ import annotations


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
