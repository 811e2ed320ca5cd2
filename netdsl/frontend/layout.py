"""A small Wadler-style layout engine: a document of text, groups and line breaks, printed
within a width. A group is printed on one line when it fits, else its breaks become
newlines. The formatter (`format.py`) builds documents; this module only places them.

Documents are nested lists of: `str`, `LINE` (a space or a newline), `SOFT` (nothing or a
newline), `HARD` (always a newline; its enclosing groups break), `Group`, `Nest` (indent
the lines inside by n), `Align` (indent them to the current column) and `IfBreak` (one
text when the enclosing group breaks, another when it is flat).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Line:
    flat: str  # what it prints as when its group fits on one line
    hard: bool = False


LINE, SOFT, HARD = Line(" "), Line(""), Line("", hard=True)


@dataclass(frozen=True)
class Group:
    doc: object


@dataclass(frozen=True)
class Nest:
    indent: int
    doc: object


@dataclass(frozen=True)
class Align:
    doc: object


@dataclass(frozen=True)
class IfBreak:
    broken: str
    flat: str = ""


_FLAT, _BREAK = 0, 1


def _has_hard(doc, memo: dict) -> bool:
    key = id(doc)
    if key in memo:
        return memo[key]
    if isinstance(doc, Line):
        r = doc.hard
    elif isinstance(doc, list | tuple):
        r = any(_has_hard(d, memo) for d in doc)
    elif isinstance(doc, Group | Nest | Align):
        r = _has_hard(doc.doc, memo)
    else:
        r = False
    memo[key] = r
    return r


def _fits(width: int, col: int, first, rest: list) -> bool:
    """Whether `first` (flat), followed by the rest up to its next possible newline, ends
    within `width`."""
    todo = [(_FLAT, first)]
    k = len(rest)
    while col <= width:
        if not todo:
            if k == 0:
                return True
            k -= 1
            _, mode, d = rest[k]
            todo.append((mode, d))
            continue
        mode, d = todo.pop()
        if isinstance(d, str):
            col += len(d)
        elif isinstance(d, list | tuple):
            todo.extend((mode, x) for x in reversed(d))
        elif isinstance(d, Line):
            if mode == _BREAK or d.hard:
                return True
            col += len(d.flat)
        elif isinstance(d, IfBreak):
            col += len(d.broken if mode == _BREAK else d.flat)
        elif isinstance(d, Group):
            todo.append((_FLAT if mode == _FLAT else _FLAT, d.doc))
        else:  # Nest, Align
            todo.append((mode, d.doc))
    return False


def render(doc, width: int = 100) -> str:
    """Print `doc` within `width` columns (where it can); lines carry no trailing spaces."""
    out: list[str] = []
    col = 0
    memo: dict = {}
    stack = [(0, _BREAK, doc)]  # (indent, mode, doc); the next item is at the end
    while stack:
        indent, mode, d = stack.pop()
        if isinstance(d, str):
            out.append(d)
            col += len(d)
        elif isinstance(d, list | tuple):
            stack.extend((indent, mode, x) for x in reversed(d))
        elif isinstance(d, Line):
            if mode == _FLAT and not d.hard:
                out.append(d.flat)
                col += len(d.flat)
            else:
                while out and out[-1].endswith(" "):  # no trailing blanks before a newline
                    out[-1] = out[-1].rstrip(" ")
                out.append("\n" + " " * indent)
                col = indent
        elif isinstance(d, IfBreak):
            s = d.broken if mode == _BREAK else d.flat
            out.append(s)
            col += len(s)
        elif isinstance(d, Group):
            flat = mode == _FLAT or (not _has_hard(d.doc, memo)
                                     and _fits(width, col, d.doc, stack))
            stack.append((indent, _FLAT if flat else _BREAK, d.doc))
        elif isinstance(d, Nest):
            stack.append((indent + d.indent, mode, d.doc))
        elif isinstance(d, Align):
            stack.append((col, mode, d.doc))
        else:  # pragma: no cover - a bug in the formatter
            raise TypeError(f"not a layout document: {d!r}")
    text = "".join(out)
    return "\n".join(line.rstrip(" ") for line in text.split("\n"))
