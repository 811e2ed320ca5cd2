"""String literals: the one escape rule both parsers use. Only \\\\ \\" \\n \\t are escapes
(`unicode_escape` crashed on `"\\N"` and mangled non-ASCII text)."""
from __future__ import annotations

from collections.abc import Callable

ESCAPES = {"\\": "\\", '"': '"', "n": "\n", "t": "\t"}


def unescape(literal: str, unknown: Callable[[int, str], Exception]) -> str:
    """The value of the literal `"..."`; `unknown(i, ch)` makes the exception raised for
    an unknown escape `\\ch` at offset i of the body (the STRING terminal never ends in a
    lone backslash)."""
    body = literal[1:-1]
    if "\\" not in body:
        return body
    out, i = [], 0
    while i < len(body):
        ch = body[i]
        if ch == "\\":
            nxt = body[i + 1]
            if nxt not in ESCAPES:
                raise unknown(i, nxt)
            out.append(ESCAPES[nxt])
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)
