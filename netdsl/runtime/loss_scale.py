"""The f16 dynamic loss scale, by torch.amp.GradScaler's rule, for the trainer.

The step's graph (netdsl.passes.precision's `loss_scale` pass) scales the loss by the fed
`loss_scale` input, checks the gradients for inf and NaN (`outputs["found_inf"]`),
unscales them, and skips the optimizer's updates where the check failed. Here the scale
itself moves as GradScaler moves it (`torch/amp/grad_scaler.py`, `update`, with
`torch._amp_update_scale_`): it starts at 2**16; a step whose gradients held inf or NaN
is skipped and halves it; after 2,000 clean steps in a row it doubles. The scale is an
f32, as GradScaler's tensor is, so its values are GradScaler's bit for bit.

The scale, the clean steps counted towards the next growth and the skipped steps are
the run's state: they go into checkpoints (`header`, `restore`), so a resumed run goes
on with the scale it stopped at.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from netdsl.errors import CheckpointError

INIT_SCALE = 2.0 ** 16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


@dataclass
class LossScale:
    scale: float = INIT_SCALE
    growth_tracker: int = 0  # clean steps since the scale last changed
    skipped: int = 0  # steps skipped for inf or NaN gradients, over the whole run
    growth_factor: float = GROWTH_FACTOR
    backoff_factor: float = BACKOFF_FACTOR
    growth_interval: int = GROWTH_INTERVAL

    def update(self, found_inf: bool) -> None:
        """After a step: GradScaler.update's rule (`_amp_update_scale_`)."""
        f32 = np.float32
        if found_inf:
            self.scale = float(f32(self.scale) * f32(self.backoff_factor))
            self.growth_tracker = 0
            self.skipped += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            with np.errstate(over="ignore"):
                grown = f32(self.scale) * f32(self.growth_factor)
            if np.isfinite(grown):  # (GradScaler keeps the scale where it would overflow)
                self.scale = float(grown)
            self.growth_tracker = 0

    def state(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "skipped": self.skipped}

    def load(self, state: dict) -> None:
        try:
            self.scale = float(state["scale"])
            self.growth_tracker = int(state["growth_tracker"])
            self.skipped = int(state["skipped"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"the checkpoint's loss scale is unreadable ({e!r})") from None


class StepScale:
    """What the trainer does about the loss scale each step: feed it, read the step's
    flag, move the scale, record both; and put it into checkpoints and take it back.
    A step with no `loss_scale` input (f32, bf16) makes this do nothing."""

    def __init__(self, graph):
        self.input = next((n.name for n in graph.nodes if n.op == "input"
                           and n.attrs.get("role") == "loss_scale"), None)
        self.scale = LossScale() if self.input is not None else None

    def feed(self, feeds: dict) -> None:
        if self.scale is not None:
            feeds[self.input] = np.float32(self.scale.scale)

    def after(self, out: dict, record: dict, executor) -> None:
        """The step's flag read, the scale moved, the step's scale and whether it was
        skipped recorded (the log and --json). The flag is the one the executor read to
        skip the updates (every device's: summed over them), or the step's output."""
        if self.scale is None:
            return
        if executor.gates:
            found = any(executor.gates.values())
        elif "found_inf" in out:
            found = float(executor.backend.to_host(out["found_inf"][0])) > 0
        else:  # (an MPI rank that holds no parameter: rank 0 has the flag)
            return
        record["loss_scale"] = self.scale.scale
        record["skipped"] = found
        self.scale.update(found)

    def header(self) -> dict:
        return {} if self.scale is None else {"loss_scale": self.scale.state()}

    def restore(self, header: dict) -> None:
        if self.scale is not None and "loss_scale" in header:
            self.scale.load(header["loss_scale"])

    def summary(self) -> dict | None:
        """For the run's result: the scale the next step would use, and the steps skipped."""
        return None if self.scale is None else {"scale": self.scale.scale,
                                                "skipped_steps": self.scale.skipped}
