"""`netdsl check`, `show` and `graph`: a network checked, summarised, printed."""
from __future__ import annotations

import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from netdsl.errors import NetdslError
from netdsl_cli.common import (
    EXIT_USER,
    FileArg,
    JsonOpt,
    app,
    console,
    default_batch,
    guard,
    keep_to_exit,
    load_network,
    lower_bound,
    print_error,
    print_json,
)
from netdsl_cli.options import BatchOpt, PrecisionOpt


class GraphFormat(StrEnum):
    text = "text"
    json = "json"
    dot = "dot"


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
                    keep_to_exit(net)  # ... nor afterwards
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
    precision: PrecisionOpt = None,
    json_output: JsonOpt = False,
) -> None:
    """A table of parameters, forward FLOPs and output bytes, grouped by block; each op's
    mixed-precision rule (column `amp`: runs in the 2-byte type, in f32, or as its input);
    with --precision, the forward pass as that precision computes it (its casts too)."""
    from netdsl.ir.stats import summarize

    with guard(json_output):
        net = load_network(file)
        b = batch if batch is not None else default_batch(net)
        g = lower_bound(net, b)
        if precision is not None:
            from netdsl.options import StepOptions, conflicts
            from netdsl.passes.pipeline import run_pipeline
            conflicts(StepOptions(precision=precision))  # (a precision it knows)
            g = run_pipeline(g, [("precision", {"dtype": precision})])
        s = summarize(g)
        if json_output:
            print_json(s.to_json(depth))
        else:
            console().print(_show_table(s, depth))


def _show_table(s, depth: int) -> Table:
    from netdsl.ir.stats import fmt_count, fmt_si
    from netdsl.sizes import format_bytes

    t = Table(title=Text(f"{s.network} (batch {s.batch}; FLOPs = 2 x MACs)"),
              show_edge=False, pad_edge=False)
    for col, just in (("name", "left"), ("op", "left"), ("amp", "left"), ("output", "left"),
                      ("params", "right"), ("FLOPs", "right"), ("output bytes", "right")):
        t.add_column(col, justify=just, no_wrap=col != "name")
    for r in s.rows(depth):
        style = "bold" if r.kind == "block" else ""
        t.add_row(Text("  " * r.level + r.label, style=style), Text(r.op),
                  Text(_AMP.get(r.precision, "")),
                  Text(str(r.type) if r.type is not None else ""),
                  Text(fmt_count(r.params)), Text(fmt_si(r.flops)), Text(format_bytes(r.out_bytes)))
    t.add_section()
    total = f"total ({fmt_count(s.nodes)} ops, {fmt_count(s.convs)} convs)"
    t.add_row(Text(total, style="bold"),
              Text(""), Text(""), Text(""), Text(fmt_count(s.params), style="bold"),
              Text(fmt_si(s.flops_forward), style="bold"),
              Text(format_bytes(s.activation_bytes), style="bold"))
    t.caption = Text(f"parameters {format_bytes(s.param_bytes)}, buffers {fmt_count(s.buffers)} "
                     f"elements, largest workspace {format_bytes(s.workspace_peak)}; amp: "
                     "under --precision bf16/f16 the op runs in the 2-byte type (low), in f32 "
                     "(f32), or in its inputs' type (blank)")
    return t


# `show`'s column of each op's mixed-precision rule (OpDef.precision)
_AMP = {"reduced": "low", "f32": "f32"}


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
