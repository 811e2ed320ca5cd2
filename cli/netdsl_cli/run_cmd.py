"""`netdsl run`: train a network, with a progress bar, logs and checkpoints."""
from __future__ import annotations

import contextlib
import inspect
import io
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from netdsl.options import RunOptions
from netdsl.sizes import format_bytes, format_seconds
from netdsl_cli.common import (
    FileArg,
    JsonOpt,
    app,
    console,
    guard,
    load_network,
    print_json,
)
from netdsl_cli.options import options_from, with_options


class _Bar:
    """Runtime callback drawing a rich progress bar (to stderr, so --json stays clean)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.err = console(stderr=True)
        self.progress = None
        self.task = None
        self.seen = 0
        self.eval_task = None
        self.first_time = 0.0
        self.records: list[dict] = []  # every step's record, for --plot
        self.setup = None
        self.setup_task = None

    def preparing(self) -> None:
        """A spinner with the time spent while the step is built (a split of a deep network
        and its memory plan can take minutes); gone at the start."""
        if self.quiet:
            return
        self.setup = Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"),
                              TimeElapsedColumn(), console=self.err, transient=True)
        self.setup_task = self.setup.add_task("building the training step", total=None)
        self.setup.start()

    def on_phase(self, text: str) -> None:
        if self.setup is not None:
            self.setup.update(self.setup_task, description=text)

    def _prepared(self) -> None:
        if self.setup is not None:
            self.setup.stop()
            self.setup = None

    def on_start(self, info: dict) -> None:
        self._prepared()
        if self.quiet:
            return
        for w in info.get("warnings", ()):  # (on this bar's console)
            self.err.print(f"warning: {w}", style="yellow", highlight=False)
        self.total = info["total_steps"]
        split = f" ({info['split']})" if info.get("split") else ""  # e.g. microbatches=4
        profile = f", profile {info['profile']}" if info.get("profile") else ""
        precision = info.get("precision", "f32")
        mixed = f", {precision} mixed precision" if precision != "f32" else ""
        self.err.print(f"{info['network']}: {info['params']:,} parameters, backend "
                       f"{info['backend']} ({info['device']}){profile}{mixed}, "
                       f"batch {info['batch']}{split}, data {info['dataset']} "
                       f"({info['train_samples']:,} samples)")
        plan = info.get("memory_plan")
        if plan:
            d = plan["decisions"]
            per = plan.get("per_device")  # a split step: planned per device
            # in decimal units, as --mem budgets are written (21GB, not 19.6 GiB)
            held = (f"at most {format_bytes(max(v['peak_bytes'] for v in per.values()))} "
                    f"on each of {len(per)} devices" if per
                    else format_bytes(info['planned_peak_bytes']))
            self.err.print(
                f"memory plan ({plan['strategy']} on {plan['profile']}): "
                f"{held} of the {format_bytes(info['budget_bytes'])} budget; "
                f"{d.get('recompute', 0):,} values recomputed, {d.get('offload', 0):,} "
                f"offloaded, predicted {100 * plan['predicted_overhead']:+.1f}% step time")
        else:
            self.err.print(f"expected memory: about {format_bytes(info['planned_peak_bytes'])} "
                           "(state + activations kept for backward)")
        if info["start_step"]:
            self.err.print(f"resuming at step {info['start_step']} of {info['total_steps']}")
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[metrics]}"), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn(), console=self.err, transient=False)
        self.progress.start()
        self.task = self.progress.add_task("train", total=info["total_steps"],
                                           completed=info["start_step"], metrics="")

    def on_step(self, r: dict) -> None:
        self.records.append(r)
        if self.quiet:
            return
        m = f"loss {r['loss']:.4f}"
        if "accuracy" in r:
            m += f"  acc {r['accuracy']:.3f}"
        m += f"  {r['images_per_s']:.0f} img/s"
        if "data_wait_s" in r:  # (the time the step waited for its batch)
            m += f"  data wait {format_seconds(r['data_wait_s'])}"
        if "test_accuracy" in r:
            m += f"  test {r['test_accuracy']:.3f}"
        if "loss_scale" in r:  # f16: the scale this step used, and a step it skipped
            m += f"  scale {r['loss_scale']:g}" + (" (skipped)" if r["skipped"] else "")
        self.progress.update(self.task, completed=r["step"], metrics=m)
        # the first step of a run also allocates and warms up (often 10x a later step),
        # so the estimate is made from the second step of this run
        self.seen += 1
        if self.seen == 1:
            self.first_time = r["step_time_s"]
        elif self.seen == 2:
            left = (r["total_steps"] - r["step"]) * r["step_time_s"]
            self.progress.console.print(
                f"first step: {format_seconds(self.first_time)} (with set-up), then "
                f"{format_seconds(r['step_time_s'])} a step; ETA about {left:.0f} s")

    def on_eval(self, r: dict) -> None:
        pass

    def on_eval_progress(self, done: int, total: int) -> None:
        """A second bar for evaluation (a full pass can take minutes on a big network)."""
        if self.quiet or self.progress is None:
            return
        if self.eval_task is None:
            self.eval_task = self.progress.add_task("eval", total=total, metrics="held out")
        self.progress.update(self.eval_task, completed=done, total=total)
        if done >= total:
            self.progress.remove_task(self.eval_task)
            self.eval_task = None

    def on_end(self, result) -> None:
        if self.progress is not None:
            self.progress.stop()

    def close(self):
        self._prepared()
        if self.progress is not None:
            self.progress.stop()


def _run(file: Path, plot: Path | None, json_output: bool, **options) -> int | None:
    """Train a network on the CPU (NumPy) or a GPU (CuPy); `--json` prints a summary."""
    bar = _Bar(quiet=json_output)
    with guard(json_output):
        from netdsl.api import train
        opts = options_from(RunOptions, options)
        if plot is not None:  # before the run, not after it: matplotlib may be missing
            from netdsl.tooling.curves import require_matplotlib
            require_matplotlib()
        net = load_network(file)
        bar.preparing()
        try:
            result = train(net, opts, bar)
        finally:
            bar.close()
        log = Path(opts.log) if opts.log else None
        if plot is not None and _rank(opts.distributed) == 0:  # (every rank ran this)
            from netdsl.tooling.curves import read_log, run_from_records, write_png
            # after --resume the log holds the whole run (rewound to the checkpoint first)
            whole = log is not None and opts.resume and log.exists() and log.stat().st_size > 0
            write_png([read_log(log, result.network) if whole else
                       run_from_records(bar.records, result.network)], plot)
        if json_output:
            print_json({**result.to_json(), **({"plot": str(plot)} if plot else {})})
            return _exit_code(result)
        out = console()
        if result.final_loss is None:  # a resume past --steps
            out.print(f"{result.network}: {result.note}")
            return
        line = (f"{result.network}: {result.steps} steps, final loss {result.final_loss:.4f}, "
                f"{result.images_per_s:.1f} images/s "
                f"(median step {format_seconds(result.step_time_s)}), "
                f"peak memory {format_bytes(result.peak_bytes)}")
        if result.test_accuracy is not None:
            line += f", test accuracy {result.test_accuracy:.4f}"
        if result.loss_scale is not None:
            s = result.loss_scale
            line += (f"; f16 loss scale {s['scale']:g}, {s['skipped_steps']} step(s) skipped "
                     "for inf or NaN gradients")
        out.print(line)
        if opts.checkpoint:
            out.print(f"checkpoint: {Path(opts.checkpoint) / 'checkpoint.npz'}")
        if plot is not None:
            out.print(f"curves: {plot}")
        if result.interrupted:
            out.print(result.note)
        sys.stdout.flush()
        return _exit_code(result)


def _rank(distributed: bool) -> int:
    if not distributed:
        return 0
    from netdsl.runtime.mpi import world
    return world()[0]


def _exit_code(result) -> int | None:
    """130 for a run stopped by a signal (after its step, saved, reported), else None."""
    from netdsl_cli.common import EXIT_INTERRUPT
    return EXIT_INTERRUPT if result.interrupted else None


_PLOT = Annotated[Path | None, typer.Option(
    "--plot", help="at the end, write the training curves to this PNG (needs the plot extra)")]


@app.command("run")
@with_options(RunOptions,
              [inspect.Parameter("file", inspect.Parameter.KEYWORD_ONLY, annotation=FileArg)],
              [inspect.Parameter("plot", inspect.Parameter.KEYWORD_ONLY, annotation=_PLOT,
                                 default=None),
               inspect.Parameter("json_output", inspect.Parameter.KEYWORD_ONLY,
                                 annotation=JsonOpt, default=False)],
              exclude=("interconnect",))  # (its devices are this process's: shm)
def run(**kwargs) -> None:
    """Train a network on the CPU (NumPy) or a GPU (CuPy); `--json` prints a summary."""
    # with --distributed every rank runs this: rank 0 reports as a plain run does, the
    # others stay quiet; a rank that fails says so, naming itself, and stops every rank
    # (MPI_Abort), so none waits for it. A run stopped by a signal after a step (every
    # rank after the same one, saved) is not a failure: each rank exits 130 by itself.
    if not kwargs["distributed"]:
        code = _run(**kwargs)
    else:
        code = _run_rank(kwargs)
    if code:
        raise typer.Exit(code)


# how long a failed rank other than 0 waits for rank 0 to report a failure they share: a
# tenth of the time it has run, 3-30 s (ranks that planned a big split for minutes fail
# seconds apart); below the 60 s a waiting peer allows (NETDSL_COMM_TIMEOUT), so that a
# rank failing alone still says why first
_STARTED = time.monotonic()


def _grace_s() -> float:
    return min(30.0, max(3.0, 0.1 * (time.monotonic() - _STARTED)))


def _run_rank(kwargs) -> int | None:
    import netdsl.runtime.mpi as mpi
    with guard(kwargs["json_output"]):
        rank, size = mpi.world()
    quiet = rank != 0
    said = io.StringIO()  # a quiet rank's output: its error, as JSON, if it fails
    try:
        with contextlib.redirect_stdout(said) if quiet else contextlib.nullcontext():
            return _run(**{**kwargs, "json_output": kwargs["json_output"] or quiet})
    except typer.Exit as e:
        if e.exit_code and size > 1:  # (one process has no other rank to stop)
            if quiet:
                # most failures are every rank's (a budget no split meets): rank 0 reports
                # them as a plain run does (--json on stdout) and stops the rest meanwhile
                time.sleep(_grace_s())
                # else this rank fails alone: its reason, or only "rank 1 failed" reached
                # the user
                sys.stderr.write("".join(f"netdsl: rank {rank}: {m}\n"
                                         for m in _error_messages(said.getvalue())))
            sys.stderr.write(f"netdsl: rank {rank} failed; stopping every rank\n")
            sys.stderr.flush()
            mpi.abort(e.exit_code)
        raise


def _error_messages(text: str) -> list[str]:
    """The messages of the JSON error report in `text` (none if there is none)."""
    import json
    try:
        return [e["message"] for e in json.loads(text[text.index("{"):])["errors"]]
    except (ValueError, KeyError, TypeError):
        return []
