"""Errors on a terminal: the message in colour and the quoted source line highlighted
with the `.net` Pygments lexer. Piped or captured, they stay the plain text of
`NetdslError.render()` (what tests and editors parse)."""
from __future__ import annotations

import sys

from rich.console import Console
from rich.text import Text

from netdsl.errors import Diagnostic, NetdslError, source_line


def _highlighted(d: Diagnostic) -> Text:
    from rich.syntax import Syntax

    from netdsl.tooling.lexer import NetdslLexer

    lines = d.render().split("\n")
    out = Text()
    head = lines[0]
    where, sep, msg = head.partition("error: ")
    out.append(where, style="bold")
    out.append(sep, style="bold red")
    out.append(msg + "\n", style="bold")
    rest = lines[1:]
    code = source_line(d.loc.file, d.loc.line) if d.loc is not None else None
    if code is not None and rest:
        gutter = rest[0][:len(rest[0]) - len(code)]
        out.append(gutter, style="blue")
        syntax = Syntax("", lexer=NetdslLexer(), theme="ansi_dark")
        line = syntax.highlight(code)
        line.rstrip()  # in place
        out.append_text(line)
        out.append("\n")
        caret = rest[1]
        out.append(caret[:caret.index("|") + 1], style="blue")
        out.append(caret[caret.index("|") + 1:] + "\n", style="bold red")
        rest = rest[2:]
    for ln in rest:
        out.append(ln + "\n", style="dim" if ln.lstrip().startswith("in block") else "")
    out.rstrip()
    return out


def print_error(e: NetdslError) -> None:
    """Print an error's diagnostics on stderr, highlighted when stderr is a terminal."""
    err = Console(stderr=True, markup=False, emoji=False, highlight=False, soft_wrap=True)
    if not err.is_terminal:
        sys.stderr.write(e.render().rstrip("\n") + "\n")
        return
    for d in e.diagnostics:
        err.print(_highlighted(d))
