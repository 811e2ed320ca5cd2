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
from rich.table import Table
from rich.text import Text

from netdsl.memory.report import plan_json
from netdsl.sizes import format_bytes, format_seconds
from netdsl_cli.common import (
    FileArg,
    JsonOpt,
    app,
    console,
    fraction_bar,
    guard,
    keep_to_exit,
    load_network,
    print_json,
    warn,
)
from netdsl_cli.options import (
    DEFAULTS,
    BackendOpt,
    BatchOpt,
    MemOpt,
    MicrobatchesOpt,
    OffloadStateOpt,
    PrecisionOpt,
    ProfileOpt,
    StrategyOpt,
)

EXIT_INFEASIBLE = 3


@app.command()
def plan(
    file: FileArg,
    mem: MemOpt = DEFAULTS.mem,
    batch: BatchOpt = DEFAULTS.batch,
    profile: ProfileOpt = DEFAULTS.profile,
    backend: BackendOpt = DEFAULTS.backend,
    strategy: StrategyOpt = DEFAULTS.strategy,
    offload_state: OffloadStateOpt = DEFAULTS.offload_state,
    microbatches: MicrobatchesOpt = DEFAULTS.microbatches,
    precision: PrecisionOpt = DEFAULTS.precision,
    depth: Annotated[int, typer.Option("--depth", "-d", min=1,
                                       help="block levels in the decision table")] = 2,
    plot: Annotated[Path | None, typer.Option(help="draw device memory over the schedule "
                                              "into this image (needs matplotlib)")] = None,
    exact: Annotated[bool, typer.Option(help="also solve the exact program (SciPy HiGHS "
                                        "MILP; small networks) and report auto's gap")]
    = False,
    json_output: JsonOpt = False,
) -> None:
    """Plan a training step into a memory budget: what to keep, recompute or offload
    (default budget: the profile's memory)."""
    from netdsl.api import plan_step
    from netdsl.ir.bulk import gc_paused

    # (the whole command builds and drops whole steps, and exits: netdsl.ir.bulk)
    with guard(json_output), gc_paused():
        net = load_network(file)
        args = dict(mem=mem, batch=batch, profile=profile, strategy=strategy,
                    offload_state=offload_state, microbatches=microbatches, backend=backend,
                    precision=precision)
        with fraction_bar("plan", json_output) as progress:
            step = plan_step(net, progress=progress, **args)
        keep_to_exit(step)
        res, b, micro = step.memory_plan, step.request.batch, step.microbatches
        prec = step.request.precision
        if not json_output:
            warn(step.warnings)
        fitting = None  # where no plan fits: more micro-batches that one would fit
        if not res.feasible:
            from netdsl.api import microbatches_to_fit
            with (contextlib.nullcontext() if json_output else
                  console(stderr=True).status("no plan fits: trying more micro-batches")):
                fitting = microbatches_to_fit(step)
        if plot is not None:
            from netdsl.tooling.memory_plot import plot_memory
            plot_memory(res, plot)
        extra = {"exact": _exact(res)} if exact else {}
        if json_output:
            print_json(plan_json(res, b, depth, {
                **extra, "fits_with_microbatches": fitting, "warnings": step.warnings,
                "precision": prec,
                "planned_peak_bytes": step.planned_peak_bytes(),
                "search_peak_bytes": res.planned_peak_bytes}, micro))
        else:
            _print(res, b, depth, micro, step.planned_peak_bytes(), prec)
            if exact:
                _print_exact(res, extra["exact"])
        if not res.feasible:
            from netdsl.step.fit import fits_with
            sys.stderr.write(
                f"netdsl: no plan fits {format_bytes(res.budget_bytes)}: the smallest "
                f"budget that works is {format_bytes(res.min_feasible_bytes)} "
                f"({res.min_feasible_bytes} bytes); it is dominated by {res.dominant}"
                f"{fits_with(fitting)}\n")
            raise typer.Exit(EXIT_INFEASIBLE)


def _exact(res) -> dict:
    """The exact program's plan for the same budget, and auto's gap to it."""
    from netdsl.memory.milp import exact_plan
    x = exact_plan(res.prep.g, res.budget_bytes, res.profile, prefetch=res.prefetch)
    gap = res.predicted_step_s / x.predicted_step_s - 1 if x.feasible else None
    return {"feasible": x.feasible, "planned_peak_bytes": x.planned_peak_bytes,
            "predicted_step_s": x.predicted_step_s,
            "predicted_overhead": x.predicted_overhead,
            "solve_s": x.solve_s, "rounds": x.rounds, "auto_gap": gap}


def _print_exact(res, e: dict) -> None:
    line = (f"exact (MILP)        step {format_seconds(e['predicted_step_s'])}, "
            f"{100 * e['predicted_overhead']:+.1f}%; solved in {e['solve_s']:.2f} s; "
            f"{res.strategy} is {100 * e['auto_gap']:+.2f}% against it" if e["feasible"] else
            "exact (MILP)        found no plan that fits")
    console().print(Text(line))


def _print(res, batch: int, depth: int, microbatches: int, peak: int, precision: str) -> None:
    from netdsl.ir.stats import fmt_si
    from netdsl.memory.report import decision_rows
    fb = format_bytes

    out = console()
    arena, bound = res.sim.arena()
    lines = [
        f"{res.network} at batch {batch}"
        + (f" in {microbatches} micro-batches" if microbatches > 1 else "")
        + (f", {precision} mixed precision" if precision != "f32" else "")
        + f" for profile {res.profile.name}, strategy {res.strategy}"
        f" (planned in {res.plan_s:.2f} s)",
        f"budget              {fb(res.budget_bytes)}",
        f"peak without a plan {fb(res.baseline_peak_bytes)}",
        f"planned peak        {fb(peak)}" + ("" if res.feasible else "  (over budget)")
        + f"  (state {fb(res.state_bytes)}, workspace {fb(res.workspace_bytes)}; the "
        f"rewritten step's storage plan, checked in {res.verify_s:.2f} s)",
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
                       f"{format_bytes(p.capacity_bytes)}"))
        if output is not None:
            out.print(Text(f"profile: {output} (use it with --profile {output})"))
