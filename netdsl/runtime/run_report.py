"""What a training run reports at its end (`finished`, `nothing_to_do`), from what its
loop saw (`Progress`)."""
from __future__ import annotations

import statistics

from netdsl.runtime.result import RunResult, device_name, interrupted_note
from netdsl.runtime.run_memory import replay_warnings

# The memory meter (tracemalloc on NumPy) records every allocation, Python objects' too,
# which slows a step down while it runs, so the trainer has it watch the first steps
# only: the first allocates the optimizer's state and every later one repeats the
# second's allocations (the same graph by the same plan), so the high-water mark is theirs.
METERED_STEPS = 2


class Progress:
    """What the loop has seen so far."""

    def __init__(self):
        self.times: list[float] = []
        self.waits: list[float] = []  # each step's wait for its batch
        self.losses: list[float] = []
        self.train_accuracy: float | None = None
        self.metering = True


def skipped_warning(skipped: dict[int, str]) -> list[str]:
    """The samples --bad-images skip replaced, in one warning naming the first few."""
    if not skipped:
        return []
    first = "; ".join(why for _, why in sorted(skipped.items())[:3])
    more = f" (and {len(skipped) - 3} more)" if len(skipped) > 3 else ""
    return [f"skipped {len(skipped)} sample(s) that cannot be read, each replaced by the next "
            f"that can: {first}{more}"]


def finished(tr, run: Progress, meter, final_eval: dict, interrupted) -> RunResult:
    """The result of trainer `tr`'s run."""
    be, ex = tr.executor.backend, tr.executor
    steady = run.times[METERED_STEPS:] or run.times[1:] or run.times  # (metered: slower)
    median = statistics.median(steady) if steady else 0.0
    skipped = dict(tr.loader.skipped)
    return RunResult(
        network=tr.forward.name, steps=tr.step,
        final_loss=run.losses[-1] if run.losses else float("nan"),
        images_per_s=tr.batch / median if median else 0.0,
        peak_bytes=tr._state_bytes() + meter.read(), params=tr.stats.params,
        backend=be.name, device=device_name(be), batch=tr.batch,
        planned_peak_bytes=tr.planned_peak_bytes(), profile=tr.built.profile.name,
        counted_peak_bytes=ex.peak_bytes, budget_bytes=tr.budget, split=tr.split,
        peak_by_device=dict(sorted(ex.peak_by_device.items())),
        planned_peak_by_device=tr._planned_by_device(),
        comm_bytes_per_step={d: b // max(len(run.losses), 1)
                             for d, b in sorted(ex.comm.sent_bytes.items())},
        host_peak_bytes=ex.host_peak_bytes, memory_plan=tr.built.plan_summary(),
        step_time_s=median, test_accuracy=final_eval.get("test_accuracy"),
        test_loss=final_eval.get("test_loss"), train_accuracy=run.train_accuracy,
        data_wait_s=statistics.fmean(run.waits) if run.waits else 0.0,
        skipped_samples=len(skipped),
        resumed_from=tr.resumed_from, losses=run.losses, interrupted=interrupted,
        precision=tr.cfg.precision, loss_scale=tr.scale.summary(),
        note=interrupted_note(interrupted, tr.step, tr.total, tr.opts.checkpoint),
        warnings=list(tr.warnings) + replay_warnings(tr.executor) + skipped_warning(skipped))


def nothing_to_do(tr) -> RunResult:
    """A resumed run already at (or past) its last step: say so, train nothing."""
    be = tr.executor.backend
    result = RunResult(
        network=tr.forward.name, steps=tr.step, final_loss=None, images_per_s=0.0,
        peak_bytes=0, params=tr.stats.params, backend=be.name,
        device=device_name(be), batch=tr.batch,
        planned_peak_bytes=tr.planned_peak_bytes(), profile=tr.built.profile.name,
        budget_bytes=tr.budget, step_time_s=0.0, resumed_from=tr.resumed_from,
        precision=tr.cfg.precision, loss_scale=tr.scale.summary(),
        note=f"the checkpoint is at step {tr.step}, already at or past the "
             f"{tr.total} steps asked for; nothing to train (raise --steps to go on)",
        warnings=list(tr.warnings))
    tr.cb.on_end(result)
    return result
