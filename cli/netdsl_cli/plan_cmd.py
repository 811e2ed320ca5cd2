"""`netdsl plan`: decide keep / recompute / offload for a training step under a memory
budget, and `netdsl calibrate`: measure this machine into a device profile.

Exit 3 when no plan fits the budget (the message names the smallest budget that works
and what dominates it)."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from netdsl.sizes import format_seconds
from netdsl_cli.app import (
    BatchOpt,
    FileArg,
    JsonOpt,
    app,
    console,
    guard,
    load_network,
    print_json,
)

EXIT_INFEASIBLE = 3


@app.command()
def plan(
    file: FileArg,
    mem: Annotated[str | None, typer.Option(
        "--mem", help="device memory budget: 12GB, 300MB, 1.5GiB (KB/MB/GB decimal, "
        "KiB/MiB/GiB binary); default: the profile's memory (12 GB on k40-12gb)")] = None,
    batch: BatchOpt = None,
    profile: Annotated[str, typer.Option(help="device profile: k40-12gb, v100-16gb, "
                                         "a100-40gb, h200, cpu, or a JSON file from "
                                         "`netdsl calibrate -o`")] = "k40-12gb",
    strategy: Annotated[str, typer.Option(help="auto, none, checkpoint-sqrt, offload-all "
                                          "or recompute-all")] = "auto",
    depth: Annotated[int, typer.Option("--depth", "-d", min=1,
                                       help="block levels in the decision table")] = 2,
    plot: Annotated[Path | None, typer.Option(help="draw device memory over the schedule "
                                              "into this image (needs matplotlib)")] = None,
    offload_state: Annotated[bool, typer.Option(
        "--offload-state", help="let the plan keep optimizer state in host memory as a "
        "last resort (`netdsl run --mem --offload-state` executes it)")] = False,
    microbatches: Annotated[int, typer.Option(
        "--microbatches", min=1, help="accumulate the gradients over this many parts of "
        "the batch, one after the other, as `netdsl run --microbatches` does")] = 1,
    exact: Annotated[bool, typer.Option(help="also solve the exact program (SciPy HiGHS "
                                        "MILP; small networks) and report auto's gap")]
    = False,
    json_output: JsonOpt = False,
) -> None:
    """Plan a training step into a memory budget: what to keep, recompute or offload."""
    from netdsl.api import plan as plan_api
    from netdsl.memory.report import plan_json

    with guard(json_output):
        net = load_network(file)
        b = batch if batch is not None else net.default_batch
        if json_output:
            res = plan_api(net, mem, b, profile, strategy, offload_state=offload_state,
                           microbatches=microbatches)
        else:
            with Progress(TextColumn("[bold]plan"), BarColumn(), TimeElapsedColumn(),
                          console=console(stderr=True), transient=True) as bar:
                task = bar.add_task("plan", total=1.0)
                res = plan_api(net, mem, b, profile, strategy, offload_state=offload_state,
                               microbatches=microbatches,
                               progress=lambda f: bar.update(task, completed=f))
        fitting = None  # where no plan fits: more micro-batches that one would fit
        if not res.feasible:
            from netdsl.api import microbatches_to_fit
            with (contextlib.nullcontext() if json_output else
                  console(stderr=True).status("no plan fits: trying more micro-batches")):
                fitting = microbatches_to_fit(net, res, b, offload_state=offload_state,
                                              microbatches=microbatches)
        if plot is not None:
            from netdsl.tooling.memory_plot import plot_memory
            plot_memory(res, plot)
        extra = {}
        if exact:
            from netdsl.memory.milp import exact_plan
            x = exact_plan(res.prep.g, res.budget_bytes, res.profile, prefetch=res.prefetch)
            gap = res.predicted_step_s / x.predicted_step_s - 1 if x.feasible else None
            extra["exact"] = {"feasible": x.feasible, "planned_peak_bytes": x.planned_peak_bytes,
                              "predicted_step_s": x.predicted_step_s,
                              "predicted_overhead": x.predicted_overhead,
                              "solve_s": x.solve_s, "rounds": x.rounds, "auto_gap": gap}
        if json_output:
            print_json(plan_json(res, b, depth, {**extra, "fits_with_microbatches": fitting},
                                 microbatches))
        else:
            _print(res, b, depth, microbatches)
            if exact:
                e = extra["exact"]
                line = (f"exact (MILP)        step {format_seconds(e['predicted_step_s'])}, "
                        f"{100 * e['predicted_overhead']:+.1f}%; solved in "
                        f"{e['solve_s']:.2f} s; {res.strategy} is "
                        f"{100 * gap:+.2f}% against it" if e["feasible"] else
                        "exact (MILP)        found no plan that fits")
                console().print(Text(line))
        if not res.feasible:
            from netdsl.runtime.accumulate import fits_with
            from netdsl.sizes import format_decimal
            sys.stderr.write(
                f"netdsl: no plan fits {format_decimal(res.budget_bytes)}: the smallest "
                f"budget that works is {format_decimal(res.min_feasible_bytes)} "
                f"({res.min_feasible_bytes} bytes); it is dominated by {res.dominant}"
                f"{fits_with(fitting)}\n")
            raise typer.Exit(EXIT_INFEASIBLE)


def _print(res, batch: int, depth: int, microbatches: int = 1) -> None:
    from netdsl.ir.stats import fmt_si
    from netdsl.memory.report import decision_rows
    from netdsl.sizes import format_decimal as fb

    out = console()
    arena, bound = res.sim.arena()
    lines = [
        f"{res.network} at batch {batch}"
        + (f" in {microbatches} micro-batches" if microbatches > 1 else "")
        + f" on {res.profile.name}, strategy {res.strategy}"
        f" (planned in {res.plan_s:.2f} s)",
        f"budget              {fb(res.budget_bytes)}",
        f"peak without a plan {fb(res.baseline_peak_bytes)}",
        f"planned peak        {fb(res.planned_peak_bytes)}"
        + ("" if res.feasible else "  (over budget)")
        + f"  (state {fb(res.state_bytes)}, workspace {fb(res.workspace_bytes)})"
        + ("" if res.verified_peak_bytes is None else
           f"; the rewritten step's storage plan: {fb(res.verified_peak_bytes)} "
           f"(checked in {res.verify_s:.2f} s)"),
        f"predicted step      {format_seconds(res.predicted_step_s)}, "
        f"{100 * res.predicted_overhead:+.1f}% against the unconstrained "
        f"{format_seconds(res.baseline_step_s)}",
        f"to / from host      {fb(res.offload_bytes)} each way (host pool peak "
        f"{fb(res.host_bytes)}, prefetch {res.prefetch} nodes ahead)",
        f"recomputed          {fmt_si(res.recompute_flops, 'FLOP')}",
        f"optimizer state     {res.state_offloaded} of {res.state_buffers} buffers in the "
        "host pool, streamed in for their update",
        f"arena               {fb(arena)} for values alive at most {fb(bound)} at once "
        f"({100 * (arena / bound - 1) if bound else 0:.1f}% fragmentation)",
    ]
    for ln in lines:
        out.print(Text(ln), soft_wrap=True)
    t = Table(title=Text("decisions (retained forward values)"), show_edge=False,
              pad_edge=False)
    for col, just in (("block", "left"), ("layer type", "left"), ("keep", "right"),
                      ("recompute", "right"), ("offload", "right")):
        t.add_column(col, justify=just, no_wrap=True)
    for r in decision_rows(res, depth):
        first = True
        for lt, c in sorted(r.by_type.items()):
            t.add_row(Text("  " * r.level + r.label if first else ""), Text(lt),
                      Text(str(c.get("keep", 0))), Text(str(c.get("recompute", 0))),
                      Text(str(c.get("offload", 0))))
            first = False
    t.add_section()
    t.add_row(Text("total"), Text(""), *(Text(str(res.counts.get(k, 0)))
                                         for k in ("keep", "recompute", "offload")))
    out.print(t)


@app.command()
def calibrate(
    output: Annotated[Path | None, typer.Option("--output", "-o",
                                                help="write the profile (JSON) here")] = None,
    json_output: JsonOpt = False,
) -> None:
    """Measure this machine (GEMM rate, copy bandwidth) into a device profile."""
    from netdsl.memory.profiles import calibrate as measure
    from netdsl.memory.profiles import save_profile

    with guard(json_output):
        p = measure()
        if output is not None:
            save_profile(p, output)
        if json_output:
            print_json(p.to_json())
            return
        out = console()
        out.print(Text(f"GEMM {p.flops_per_s / 1e9:.1f} GFLOP/s, memory "
                       f"{p.mem_bw / 1e9:.1f} GB/s, host copy {p.link_bw / 1e9:.1f} GB/s, "
                       f"{p.op_overhead_s * 1e6:.1f} us per node, "
                       f"{p.capacity_bytes / 1e9:.1f} GB"))
        if output is not None:
            out.print(Text(f"profile: {output} (use it with --profile {output})"))
