"""`netdsl report`: summarise training logs and draw their curves (PNG, HTML)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from netdsl_cli.common import JsonOpt, app, console, guard, print_json


@app.command()
def report(
    logs: Annotated[list[Path], typer.Argument(
        help="JSONL logs written by `netdsl run --log`; several are overlaid",
        show_default=False)],
    png: Annotated[Path | None, typer.Option(
        "--png", help="write the curves (loss, accuracy, lr, images/s) to this PNG")] = None,
    html: Annotated[Path | None, typer.Option(
        "--html", help="write a self-contained HTML report (curves and table) here")] = None,
    json_output: JsonOpt = False,
) -> None:
    """A table of each run (steps, losses, accuracy, speed), and its curves with --png/--html.

    Drawing needs matplotlib (`pip install 'netdsl[plot]'`)."""
    with guard(json_output):
        from netdsl.tooling.curves import read_log, unique_names, write_html, write_png

        if png is not None or html is not None:
            from netdsl.tooling.curves import require_matplotlib
            require_matplotlib()
        runs = [read_log(p, name) for p, name in zip(logs, unique_names(logs))]
        written = []
        if png is not None:
            written.append(str(write_png(runs, png)))
        if html is not None:
            written.append(str(write_html(runs, html)))
        if json_output:
            print_json({"runs": [r.summary() for r in runs], "written": written})
            return
        out = console()
        out.print(_table(runs))
        for w in written:
            out.print(Text(f"wrote {w}"), soft_wrap=True)


def _num(v, fmt: str) -> Text:
    return Text("-" if v is None else format(v, fmt))


def _table(runs) -> Table:
    t = Table(show_edge=False, pad_edge=False)
    for col in ("run", "steps", "final loss", "min loss", "accuracy", "test acc.", "lr",
                "images/s"):
        t.add_column(col, justify="left" if col == "run" else "right")
    for r in runs:
        s = r.summary()
        t.add_row(Text(s["run"]), Text(str(s["steps"])), _num(s["final_loss"], ".4f"),
                  _num(s["min_loss"], ".4f"), _num(s["accuracy"], ".3f"),
                  _num(s["test_accuracy"], ".3f"), _num(s["final_lr"], ".3g"),
                  _num(s["images_per_s"], ",.1f"))
    return t
