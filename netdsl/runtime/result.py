"""What a training run reports: `RunResult` at its end, and the `Callback` hooks through
which a caller (the CLI's progress bar) follows it; the runtime prints nothing."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunResult:
    network: str
    steps: int
    final_loss: float | None  # None when nothing was trained (a resume past --steps)
    images_per_s: float
    # measured independently of the executor: the state's arrays plus the high-water mark
    # of what the steps allocated (tracemalloc on NumPy, the CuPy pool on a GPU), over the
    # first metered steps (their evaluations and checkpoint saves included)
    peak_bytes: int
    params: int
    backend: str
    device: str
    batch: int
    planned_peak_bytes: int  # the step's prediction, before the first step
    step_time_s: float
    profile: str = ""  # the device profile the step was predicted and planned for
    counted_peak_bytes: int = 0  # the executor's own count, which follows the plan
    # the host pool's peak (offloaded values, state streamed from the host); on NumPy the
    # pool is the same process memory, so `peak_bytes` includes it
    host_peak_bytes: int = 0
    budget_bytes: int | None = None  # --mem
    split: str | None = None  # --devices: the split made, e.g. "data=2"
    peak_by_device: dict[int, int] = field(default_factory=dict)  # counted, per device
    # --devices: the storage plan's peak per device (with --mem: each within the budget)
    planned_peak_by_device: dict[int, int] = field(default_factory=dict)
    comm_bytes_per_step: dict[int, int] = field(default_factory=dict)  # sent, counted
    memory_plan: dict | None = None  # the planner's summary, with --mem
    test_accuracy: float | None = None
    test_loss: float | None = None
    train_accuracy: float | None = None
    data_wait_s: float = 0.0  # the mean time a step waited for its batch
    skipped_samples: int = 0  # samples that could not be read, replaced (--bad-images skip)
    resumed_from: int | None = None
    # the signal that stopped the run after its step ("SIGINT", "SIGTERM"; see runtime.stop)
    interrupted: str | None = None
    precision: str = "f32"  # mixed precision: bf16 or f16 (netdsl.passes.precision)
    # f16: {"scale": the loss scale the next step would use, "skipped_steps": steps
    # skipped for inf or NaN gradients} (netdsl.runtime.loss_scale); None otherwise
    loss_scale: dict | None = None
    note: str | None = None
    warnings: list[str] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d.pop("losses")
        return d


class Callback:
    """Hooks for progress display; every method is optional."""

    def on_phase(self, text: str) -> None: ...  # what the set-up does now (before on_start)
    def on_start(self, info: dict) -> None: ...
    def on_step(self, record: dict) -> None: ...
    def on_eval(self, record: dict) -> None: ...
    def on_eval_progress(self, done: int, total: int) -> None: ...
    def on_end(self, result: RunResult) -> None: ...


def interrupted_note(signal_name: str | None, step: int, total: int,
                     checkpoint: str | None) -> str | None:
    """What a run stopped by a signal after its step says of itself."""
    if signal_name is None:
        return None
    saved = (f"the checkpoint in {checkpoint} holds it: --resume goes on from there"
             if checkpoint else "nothing was saved (no --checkpoint)")
    return f"stopped by {signal_name} after step {step} of {total}; {saved}"


def device_name(be) -> str:
    return "cpu" if be.name == "numpy" else f"cuda:{be.device}"

