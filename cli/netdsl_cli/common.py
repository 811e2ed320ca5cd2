"""What every command shares: the Typer `app` they register on, the consoles, JSON
output, `guard` (errors to exit codes), network loading, a counting progress bar, and
the parameters every command spells the same way.

Exit codes: 0 success; 1 a user error (a `NetdslError`: bad source, shape mismatch, ...),
printed as its diagnostics on stderr, or as JSON on stdout with `--json`; 2 an internal
error (a bug in netdsl: a one-line message, the traceback with NETDSL_DEBUG=1);
130 interrupted.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

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


def warn(warnings: list[str]) -> None:
    """Warnings on stderr, one a line (with --json they are in the JSON instead)."""
    err = console(stderr=True)
    for w in warnings:
        err.print(f"warning: {w}", style="yellow", highlight=False)


def print_error(e: NetdslError) -> None:
    """A user error's diagnostics on stderr (the source line highlighted on a terminal)."""
    from netdsl_cli.diagnostics import print_error as _print
    _print(e)


def internal_error(e: BaseException) -> None:
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
        internal_error(e)
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


@contextmanager
def fraction_bar(label: str, quiet: bool) -> Iterator:
    """A progress bar on stderr that a library call reports the fraction done to: yields
    that callback (None when `quiet`, e.g. with --json)."""
    if quiet:
        yield None
        return
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), TimeElapsedColumn(),
                  console=console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=1.0)
        yield lambda f: bar.update(task, completed=f)


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
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")]


# graphs kept alive to the end of the process (`check` on big files: see app.main)
LARGE: list = []


def keep_to_exit(obj) -> None:
    """Keep `obj` (a checked network, a built step) alive to the end of the process, and
    every object alive now out of the cyclic collector's walks: a full collection walks
    a deep network's millions of objects again, and freeing them one by one takes longer
    than the process's exit (app.main). The compile path makes no cycles worth
    collecting (netdsl.ir.bulk)."""
    import gc
    gc.freeze()
    LARGE.append(obj)
