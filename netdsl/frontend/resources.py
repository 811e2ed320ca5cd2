"""Finding the grammar and the stdlib, installed (package data) or in a source checkout."""
from __future__ import annotations

from importlib import resources
from pathlib import Path


def _package_dir(package: str, fallback: str) -> Path:
    try:
        p = Path(str(resources.files(package)))
        if p.is_dir():
            return p
    except (ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parents[2] / fallback


def grammar_text() -> str:
    return (_package_dir("netdsl.grammar", "grammar") / "netdsl.lark").read_text("utf-8")


def stdlib_dir() -> Path:
    return _package_dir("netdsl.stdlib", "stdlib")
