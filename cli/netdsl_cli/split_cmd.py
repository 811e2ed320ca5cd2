"""`netdsl split`: split a training step across devices and show, per device, what it
computes, holds and sends, with the predicted step time, speed-up and pipeline bubble;
`--verify` runs the equivalence gate; `--mem` plans each device's part (recompute,
offload) when a split does not fit. Exit 3 for splits that cannot be made or fit."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

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
    BnOpt,
    InterconnectOpt,
    JobsOpt,
    MemOpt,
    MicrobatchesOpt,
    OffloadStateOpt,
    PrecisionOpt,
    ProfileOpt,
    ScheduleOpt,
    ShardOpt,
    SplitOpt,
    VirtualStagesOpt,
)


@app.command()
def split(
    file: FileArg,
    devices: Annotated[int | None, typer.Option(
        "--devices", "-n", min=1, help="devices to split over (default: the file's "
        "`parallel` declaration)")] = None,
    split: SplitOpt = DEFAULTS.split,
    batch: BatchOpt = DEFAULTS.batch,
    microbatches: MicrobatchesOpt = DEFAULTS.microbatches,
    mem: MemOpt = DEFAULTS.mem,
    offload_state: OffloadStateOpt = DEFAULTS.offload_state,
    profile: ProfileOpt = DEFAULTS.profile,
    backend: BackendOpt = DEFAULTS.backend,
    interconnect: InterconnectOpt = DEFAULTS.interconnect,
    bn: BnOpt = DEFAULTS.bn,
    shard: ShardOpt = DEFAULTS.shard,
    schedule: ScheduleOpt = DEFAULTS.schedule,
    virtual_stages: VirtualStagesOpt = DEFAULTS.virtual_stages,
    precision: PrecisionOpt = DEFAULTS.precision,
    verify: Annotated[bool, typer.Option(help="run the split and the single-device step on "
                                         "one batch in float64 and compare every "
                                         "gradient and updated value")] = False,
    mpi: Annotated[bool, typer.Option("--mpi", help="predict and plan the split as `run "
                                      "--distributed` runs it: one process per device, "
                                      "MPI holding each message sent until its peer has "
                                      "it (a pipeline's stages hold more)")] = False,
    plot: Annotated[Path | None, typer.Option(help="draw the schedule (Gantt chart per "
                                              "device) into this image")] = None,
    jobs: JobsOpt = DEFAULTS.jobs,
    json_output: JsonOpt = False,
) -> None:
    """Split a training step across devices: per-device work, memory and communication."""
    from netdsl.api import split as split_api
    from netdsl.config import ParallelConfig
    from netdsl.ir.bulk import gc_paused

    # (the whole command builds and drops whole steps, and exits: netdsl.ir.bulk)
    with guard(json_output), gc_paused():
        net = load_network(file)
        n = devices if devices is not None else ParallelConfig(**net.graph.parallel).devices
        kw = dict(devices=n, strategy=split, batch=batch, microbatches=microbatches,
                  mem=mem, profile=profile, interconnect=interconnect, bn=bn, verify=verify,
                  schedule=schedule, mpi=mpi, jobs=jobs, backend=backend,
                  precision=precision, shard=shard, offload_state=offload_state,
                  virtual_stages=virtual_stages)
        with fraction_bar("split", json_output) as progress:
            res = split_api(net, progress=progress, **kw)
        keep_to_exit(res)
        if plot is not None:
            from netdsl.parallel.predict import get_interconnect, simulate
            from netdsl.tooling.schedule_plot import plot_schedule
            timeline = simulate(res.chosen.best.graph, res.profile,
                                get_interconnect(interconnect)).timeline
            plot_schedule(timeline, plot, title=f"{net.name}: {res.chosen.best.spec.describe()}")
        if json_output:
            print_json(res.to_json())
        else:
            warn(res.warnings)
            _print(res)
        if res.gate is not None and not res.gate.ok:
            raise typer.Exit(1)


def _print(res) -> None:
    out = console()
    best = res.chosen.best
    _print_devices(out, res)
    _print_step(out, best)
    if len(res.chosen.considered) > 1:
        _print_considered(out, res.chosen.considered, best)
    if res.chosen.reason:
        out.print(res.chosen.reason)
    for why in res.chosen.unavailable:
        out.print(f"cannot be made: {why}")
    if res.chosen.skipped:
        out.print("not built (more micro-batches of a pipeline, already slower than a split "
                  "that fits or changing the numbers where an exact split fits): "
                  + "; ".join(s.describe() for s in res.chosen.skipped))
    if res.gate is not None:
        _print_gate(out, res.gate)


def _print_devices(out, res) -> None:
    """The chosen split's table, a row per device."""
    best = res.chosen.best
    rep = best.report
    t = Table(title=f"{best.graph.name} on {rep.devices} device(s): {best.spec.describe()} "
                    f"(batch {res.batch}"
                    f"{f', {res.precision} mixed precision' if res.precision != 'f32' else ''}"
                    f"{', one process a device over MPI' if res.mpi else ''})")
    mem = best.memory.per_device if best.memory is not None else None
    cols = ["device", "nodes", "params", "GFLOPs", "peak memory", "state", "sends",
            "collectives", "sent / step"]
    if mem is not None:
        cols += ["recomputed", "offloaded"]
    for col in cols:
        t.add_column(col, justify="right")
    for d in rep.per_device:
        row = [str(d.device), f"{d.nodes:,}", f"{d.params:,}", f"{d.flops / 1e9:,.2f}",
               format_bytes(d.peak_bytes), format_bytes(d.state_bytes), str(d.sends),
               str(d.collectives),
               format_bytes(d.comm_bytes)]
        if mem is not None:
            m = mem.get(d.device, {})
            row += [f"{m.get('recompute', 0):,} ({format_bytes(m.get('recompute_bytes', 0))})",
                    f"{m.get('offload', 0):,} ({format_bytes(m.get('offload_bytes', 0))})"]
        t.add_row(*row)
    out.print(t)


def _print_step(out, best) -> None:
    """What the chosen split holds besides, its plan, its predicted step and bubble."""
    rep = best.report
    reserve = max(d.outside_plan_bytes for d in rep.per_device)
    if reserve:
        out.print(f"each device's process also holds up to {format_bytes(reserve)} besides "
                  "its peak memory (its inputs and interpreter objects), counted where the split "
                  "is fitted to memory")
    if best.memory is not None:
        p = best.memory
        out.print(f"memory plan ({p.strategy} on {p.profile.name}): every device within "
                  f"{format_bytes(p.budget_bytes)}; {p.counts.get('recompute', 0):,} values "
                  f"recomputed, {p.counts.get('offload', 0):,} offloaded "
                  f"({format_bytes(p.offload_bytes)} to the hosts); unplanned the split "
                  "would need "
                  f"{format_bytes(best.unplanned_peak_bytes + reserve)} and take "
                  f"{format_seconds(best.unplanned_step_s)}")
    out.print(f"predicted step {format_seconds(rep.predicted_step_s)} on {rep.profile} over "
              f"{rep.interconnect} (one device: {format_seconds(rep.single_step_s)}), "
              f"speed-up {rep.predicted_speedup:.2f}x"
              + ("; slower than one device: this split divides the memory, not the time"
                 if rep.predicted_speedup < 1 else ""))
    if rep.ideal_bubble is not None:
        split = best.graph.meta["split"]
        formula = {"zb-h1": "(p-1)/(3m+p-1)"}.get(split["schedule"], "(p-1)/(m+p-1)")
        if split.get("virtual_stages", 1) > 1:
            formula = "(p-1)/(vm+p-1)"
        out.print(f"pipeline bubble {rep.bubble:.1%} ({best.spec.describe()}; its formula "
                  f"{formula} = {rep.ideal_bubble:.1%} with equal stage times)")
    out.print(f"sent per step {format_bytes(rep.comm_bytes_total)} (ring lower bound "
              f"{format_bytes(rep.comm_bytes_lower_bound)})")


def _print_considered(out, considered, best) -> None:
    alt = Table(title="considered")
    for col in ("split", "fits", "exact", "step", "speed-up", "bubble", "max peak"):
        alt.add_column(col, justify="right")
    for c in sorted(considered, key=lambda c: c.report.predicted_step_s):
        fits = "no" if not c.fits else "planned" if c.memory is not None else "yes"
        alt.add_row(c.spec.describe() + (" *" if c is best else ""),
                    fits, "yes" if c.exact else "no",
                    format_seconds(c.report.predicted_step_s),
                    f"{c.report.predicted_speedup:.2f}x", f"{c.report.bubble:.1%}",
                    format_bytes(max(d.peak_bytes for d in c.report.per_device)))
    out.print(alt)


def _print_gate(out, g) -> None:
    verdict = "equal" if g.ok else "DIFFERENT"
    out.print(f"verify: {verdict} to the {g.reference} within {g.rtol:g} (loss "
              f"{g.loss_rel:.2g}, gradients {g.grad_rel:.2g}, state {g.state_rel:.2g}; "
              f"largest: {g.worst or '-'}); sent "
              f"{format_bytes(sum(g.comm_bytes.values()))} as counted by the "
              "communicator (float64)")
    if g.first_divergence:
        out.print(f"first difference: {g.first_divergence}")
