"""The `netdsl` command: its entry point (`main`), and every command registered on it.

Exit codes: 0 success; 1 a user error (a `NetdslError`: bad source, shape mismatch, ...),
printed as its diagnostics on stderr, or as JSON on stdout with `--json`; 2 an internal
error (a bug in netdsl: a one-line message, the traceback with NETDSL_DEBUG=1);
130 interrupted.

Adding a command: write a module `NAME_cmd.py` with a function decorated with
`@app.command()` (netdsl_cli.common's app), import it below, do its work inside
`with guard(json_output):` (which maps errors to the exit codes above), load networks
with `load_network(path)`, take the shared options from `netdsl_cli.options` (declared
once in `netdsl.options`), and print human output through `console()` and JSON with
`print_json(obj)`. Only this package imports typer and rich; the work itself belongs in
`netdsl.api` or the layers under it.
"""
from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

# each command lives in its own module and registers itself on `app` (netdsl_cli.common),
# in the order `netdsl --help` lists them: check, show and graph first
import netdsl_cli.inspect_cmd  # noqa: F401
from netdsl_cli import (  # noqa: F401
    data_cmd,
    eval_cmd,
    fmt_cmd,
    lsp_cmd,
    onnx_cmd,
    plan_cmd,
    report_cmd,
    run_cmd,
    split_cmd,
)
from netdsl_cli.common import (  # noqa: F401  (the names commands and tests use)
    DEBUG_ENV,
    EXIT_INTERNAL,
    EXIT_INTERRUPT,
    EXIT_OK,
    EXIT_USER,
    LARGE,
    app,
    console,
    guard,
    internal_error,
    load_network,
    print_error,
    print_json,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version
        try:
            v = version("netdsl")
        except PackageNotFoundError:
            v = "unknown"
        sys.stdout.write(f"netdsl {v}\n")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="print the version and exit")] = False,
) -> None:
    """A declarative language for training deep networks."""


def _is_usage_error(e: BaseException) -> bool:
    # click's ClickException, from click itself or the copy newer typers vendor
    return any(c.__name__ == "ClickException" for c in type(e).__mro__) and hasattr(e, "show")


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `netdsl` script. Usage errors exit 1 like other user errors, so
    that 2 always means a bug."""
    try:
        code = app(args=argv, prog_name="netdsl", standalone_mode=False)
    except (KeyboardInterrupt, typer.Abort):
        sys.stderr.write("netdsl: interrupted\n")
        code = EXIT_INTERRUPT
    except Exception as e:
        if _is_usage_error(e):
            e.show()
            code = EXIT_USER
        else:  # escaped every guard: still a bug, still no traceback
            internal_error(e)
            code = EXIT_INTERNAL
    code = code if isinstance(code, int) else EXIT_OK
    if LARGE and argv is None:  # the `netdsl` process itself, not a test calling main()
        # a checked graph of millions of objects: let the OS take the memory back at once
        # (Python would free them one by one); nothing is left to write but the streams
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
