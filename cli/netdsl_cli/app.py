"""The `netdsl` command: check, show and print networks written in the netdsl language.

Exit codes: 0 success; 1 a user error (a `NetdslError`: bad source, shape mismatch, ...),
printed as its diagnostics on stderr, or as JSON on stdout with `--json`; 2 an internal
error (a bug in netdsl: a one-line message, the traceback with NETDSL_DEBUG=1);
130 interrupted.

Adding a command: write a function below decorated with `@app.command()`, do its work
inside `with guard(json_output):` (which maps errors to the exit codes above), load
networks with `load_network(path)`, and print human output through `console()` and JSON
with `print_json(obj)`. Only this package imports typer and rich; the work itself belongs
in `netdsl.api` or the layers under it.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from netdsl.errors import NetdslError

EXIT_OK, EXIT_USER, EXIT_INTERNAL, EXIT_INTERRUPT = 0, 1, 2, 130
DEBUG_ENV = "NETDSL_DEBUG"

app = typer.Typer(
    name="netdsl", no_args_is_help=True, add_completion=False,
    pretty_exceptions_enable=False, context_settings={"help_option_names": ["-h", "--help"]},
    help="A declarative language for training deep networks.")


# -- shared plumbing ------------------------------------------------------------------------

def console(stderr: bool = False) -> Console:
    # a fresh console per call follows redirections of sys.stdout (tests, pipes); markup
    # and emoji are off so names like `bottleneck[1..789]` print as they are
    stream = sys.stderr if stderr else sys.stdout
    # piped or captured output gets room for the whole table instead of rich's 80 columns
    width = None if stream.isatty() or os.environ.get("COLUMNS") else 160
    return Console(stderr=stderr, markup=False, emoji=False, highlight=False, width=width)


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def print_error(e: NetdslError) -> None:
    """A user error's diagnostics on stderr (the source line highlighted on a terminal)."""
    from netdsl_cli.diagnostics import print_error as _print
    _print(e)


def _internal_error(e: BaseException) -> None:
    sys.stderr.write(f"netdsl: internal error: {type(e).__name__}: {e}\n")
    if os.environ.get(DEBUG_ENV):
        traceback.print_exception(e, file=sys.stderr)
    else:
        sys.stderr.write(f"netdsl: this is a bug in netdsl; set {DEBUG_ENV}=1 to see the "
                         "traceback\n")


@contextmanager
def guard(json_output: bool = False) -> Iterator[None]:
    """Turn a NetdslError into exit 1 (diagnostics on stderr, or JSON on stdout), any
    other exception into exit 2, and Ctrl-C into 130."""
    try:
        yield
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except NetdslError as e:
        if json_output:
            print_json(e.to_json())
        else:
            print_error(e)
        raise typer.Exit(getattr(e, "exit_code", EXIT_USER)) from None
    except KeyboardInterrupt:
        sys.stderr.write("netdsl: interrupted\n")
        raise typer.Exit(EXIT_INTERRUPT) from None
    except BrokenPipeError:  # `netdsl graph big.net | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(EXIT_USER) from None
    except Exception as e:
        _internal_error(e)
        raise typer.Exit(EXIT_INTERNAL) from None


def load_network(path: str | Path):
    """`netdsl.api.load`, imported late so `netdsl --help` stays fast."""
    from netdsl.api import load
    return load(path)


def default_batch(net) -> int:
    """The train section's batch if there is one, else 1."""
    b = getattr(getattr(net, "train", None), "batch", None)
    return b if isinstance(b, int) and b > 0 else 1


def lower_bound(net, batch: int):
    """The network's graph bound to `batch`."""
    g = net.lower(batch)
    return g if isinstance(g.batch, int) else g.bind(batch)


class GraphFormat(StrEnum):
    text = "text"
    json = "json"
    dot = "dot"


class CountBar:
    """A rich progress bar on stderr counting done of total (the weights `export` writes,
    the batches `eval` runs); none with --json. Call it with (done, total), then close()."""

    def __init__(self, label: str, quiet: bool):
        self.label, self.quiet, self.progress, self.task = label, quiet, None, None

    def __call__(self, done: int, total: int) -> None:
        if self.quiet:
            return
        if self.progress is None:
            self.progress = Progress(TextColumn(f"[bold]{self.label}"), BarColumn(),
                                     MofNCompleteColumn(), TimeElapsedColumn(),
                                     console=console(stderr=True), transient=True)
            self.progress.start()
            self.task = self.progress.add_task(self.label, total=total)
        self.progress.update(self.task, completed=done)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


FileArg = Annotated[Path, typer.Argument(help="a .net file", show_default=False)]
BatchOpt = Annotated[int | None, typer.Option("--batch", "-b", min=1,
                                              help="batch size to bind N to")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")]
JobsOpt = Annotated[int | None, typer.Option(
    "--jobs", "-j", min=1, help="processes that build and predict the candidate splits "
    "(default: one a core, up to 8 and as many as the free memory holds, where the network "
    "is big enough to pay for starting them; 1: this process alone)")]


# -- commands ---------------------------------------------------------------------------------

@app.command()
def check(
    files: Annotated[list[Path], typer.Argument(help="one or more .net files",
                                                show_default=False)],
    json_output: JsonOpt = False,
) -> None:
    """Parse and type-check each file; print a one-line summary or its errors."""
    from netdsl.ir.bulk import gc_paused
    from netdsl.ir.stats import counts, fmt_count

    results, failed = [], False
    with guard(json_output):
        for f in files:
            try:
                # a big file keeps millions of objects alive, which the cyclic collector
                # would walk again and again; checking makes no cycles worth collecting
                with gc_paused():
                    net = load_network(f)
                    s = counts(net.lower())  # the symbolic graph: no copy
                    # ... nor afterwards (a full collection walks the whole graph again),
                    # and the graph is kept to the end: freeing it object by object took
                    # longer than the process's exit (see main)
                    gc.freeze()
                    _LARGE.append(net)
            except NetdslError as e:
                failed = True
                if json_output:
                    results.append({"file": str(f), "ok": False, **e.to_json()})
                else:
                    print_error(e)
                continue
            if json_output:
                results.append({"file": str(f), "ok": True, "network": net.name,
                                "params": s.params, "nodes": s.nodes, "convs": s.convs})
            else:
                console().print(Text(f"{f}: ok — network {net.name}, {fmt_count(s.params)} "
                                     f"params, {fmt_count(s.nodes)} nodes"), soft_wrap=True)
        if json_output:
            print_json({"ok": not failed, "files": results})
    if failed:
        raise typer.Exit(EXIT_USER)


@app.command()
def show(
    file: FileArg,
    batch: BatchOpt = None,
    depth: Annotated[int, typer.Option("--depth", "-d", min=0,
                                       help="block levels to expand (0: totals only)")] = 2,
    json_output: JsonOpt = False,
) -> None:
    """A table of parameters, forward FLOPs and output bytes, grouped by block."""
    from netdsl.ir.stats import summarize

    with guard(json_output):
        net = load_network(file)
        b = batch if batch is not None else default_batch(net)
        s = summarize(lower_bound(net, b))
        if json_output:
            print_json(s.to_json(depth))
        else:
            console().print(_show_table(s, depth))


def _show_table(s, depth: int) -> Table:
    from netdsl.ir.stats import fmt_bytes, fmt_count, fmt_si

    t = Table(title=Text(f"{s.network} (batch {s.batch}; FLOPs = 2 x MACs)"),
              show_edge=False, pad_edge=False)
    for col, just in (("name", "left"), ("op", "left"), ("output", "left"),
                      ("params", "right"), ("FLOPs", "right"), ("output bytes", "right")):
        t.add_column(col, justify=just, no_wrap=col != "name")
    for r in s.rows(depth):
        style = "bold" if r.kind == "block" else ""
        t.add_row(Text("  " * r.level + r.label, style=style), Text(r.op),
                  Text(str(r.type) if r.type is not None else ""),
                  Text(fmt_count(r.params)), Text(fmt_si(r.flops)), Text(fmt_bytes(r.out_bytes)))
    t.add_section()
    total = f"total ({fmt_count(s.nodes)} ops, {fmt_count(s.convs)} convs)"
    t.add_row(Text(total, style="bold"),
              Text(""), Text(""), Text(fmt_count(s.params), style="bold"),
              Text(fmt_si(s.flops_forward), style="bold"),
              Text(fmt_bytes(s.activation_bytes), style="bold"))
    t.caption = Text(f"parameters {fmt_bytes(s.param_bytes)}, buffers {fmt_count(s.buffers)} "
                     f"elements, largest workspace {fmt_bytes(s.workspace_peak)}")
    return t


@app.command()
def graph(
    file: FileArg,
    fmt: Annotated[GraphFormat, typer.Option("--format", "-f", help="output format")]
    = GraphFormat.text,
    batch: Annotated[int | None, typer.Option(
        "--batch", "-b", min=1, help="batch size to bind N to (default: keep N)")] = None,
    depth: Annotated[int | None, typer.Option(
        "--depth", "-d", min=0, help="dot: draw blocks deeper than this as one box")] = None,
    unfold: Annotated[bool, typer.Option("--unfold", help="dot: draw every repeat copy")]
    = False,
) -> None:
    """Print the lowered graph IR as text, JSON or Graphviz DOT."""
    with guard(fmt is GraphFormat.json):
        net = load_network(file)
        g = net.lower(batch)
        if batch is not None and not isinstance(g.batch, int):
            g = g.bind(batch)
        if fmt is GraphFormat.text:
            sys.stdout.write(g.to_text())
        elif fmt is GraphFormat.json:
            print_json(g.to_json())
        else:
            from netdsl.ir.dot import to_dot
            sys.stdout.write(to_dot(g, fold=not unfold, depth=depth))


# -- netdsl run, eval, export, import, fmt, lsp, report, plan, calibrate------------------------
# each in its own module (it registers itself on `app`); imported here, after the plumbing above
import netdsl_cli.fmt_cmd  # noqa: E402,F401  (the tools for .net files: fmt, lsp, report)
import netdsl_cli.lsp_cmd  # noqa: E402,F401
import netdsl_cli.report_cmd  # noqa: E402,F401
from netdsl_cli import eval_cmd, onnx_cmd, plan_cmd, run_cmd, split_cmd  # noqa: E402,F401


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
            _internal_error(e)
            code = EXIT_INTERNAL
    code = code if isinstance(code, int) else EXIT_OK
    if _LARGE and argv is None:  # the `netdsl` process itself, not a test calling main()
        # a checked graph of millions of objects: let the OS take the memory back at once
        # (Python would free them one by one); nothing is left to write but the streams
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


# graphs kept alive to the end of the process (`check` on big files: see main)
_LARGE: list = []


if __name__ == "__main__":
    # run as `python -m netdsl_cli`: executing this file as __main__ would make a second
    # `app` that the command modules (which import netdsl_cli.app) do not register on
    from netdsl_cli.app import main as _main
    _main()
