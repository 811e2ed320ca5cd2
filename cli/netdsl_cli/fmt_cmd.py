"""`netdsl fmt`: rewrite `.net` files in the canonical layout, or check that they are."""
from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Annotated

import typer

from netdsl_cli.common import EXIT_USER, JsonOpt, app, console, guard, print_error, print_json


def _sources(paths: list[Path]) -> list[Path]:
    """The files named, and the `.net` files under the folders named (sorted)."""
    from netdsl.errors import NetdslError
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            out += sorted(p.rglob("*.net"))
        elif p.exists():
            out.append(p)
        else:
            raise NetdslError(f"{p}: no such file or folder")
    return out


@app.command()
def fmt(
    paths: Annotated[list[Path], typer.Argument(
        help="`.net` files or folders (their .net files); `-` formats stdin to stdout",
        show_default=False)],
    check: Annotated[bool, typer.Option(
        "--check", help="change nothing; exit 1 listing the files that would change")] = False,
    diff: Annotated[bool, typer.Option(
        "--diff", help="change nothing; print what would change as a unified diff")] = False,
    json_output: JsonOpt = False,
) -> None:
    """Format `.net` files in place: one layout for every construct, comments kept.

    A file with errors is reported and left as it is (exit 1)."""
    from netdsl.errors import NetdslError
    from netdsl.frontend.format import format_source

    failed = changed_any = False
    results = []
    with guard(json_output):
        if [str(p) for p in paths] == ["-"]:
            sys.stdout.write(format_source(sys.stdin.read(), "<stdin>"))
            return
        for path in _sources(paths):
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise NetdslError(f"{path}: cannot read it ({e})") from None
            try:
                new = format_source(text, str(path))
            except NetdslError as e:
                failed = True
                results.append({"file": str(path), "ok": False, "changed": False,
                                **e.to_json()})
                if not json_output:
                    print_error(e)
                continue
            changed = new != text
            changed_any |= changed
            results.append({"file": str(path), "ok": True, "changed": changed})
            if not changed:
                continue
            if diff and not json_output:
                sys.stdout.writelines(difflib.unified_diff(
                    text.splitlines(keepends=True), new.splitlines(keepends=True),
                    f"{path} (before)", f"{path} (formatted)"))
            if check or diff:
                if check and not json_output:
                    console(stderr=True).print(f"would reformat {path}", soft_wrap=True)
            else:
                path.write_text(new, encoding="utf-8")
                if not json_output:
                    console().print(f"reformatted {path}", soft_wrap=True)
        if json_output:
            print_json({"ok": not failed and not (check and changed_any), "files": results})
        elif check and not changed_any and not failed:
            console().print(f"{len(results)} files already formatted", soft_wrap=True)
    if failed or (check and changed_any):
        raise typer.Exit(EXIT_USER)
