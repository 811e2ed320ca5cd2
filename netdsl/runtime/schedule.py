"""Learning-rate schedules: a pure function of the step, so resuming needs no state."""
from __future__ import annotations

import math

from netdsl.config import Constant, Cosine, Step


def lr_at(schedule: Constant | Step | Cosine, base_lr: float, step: int, total: int) -> float:
    """Learning rate for 0-based `step` of `total`; linear warm-up first, if any."""
    warm = schedule.warmup
    if warm and step < warm:
        return base_lr * (step + 1) / warm
    if isinstance(schedule, Step):
        return base_lr * schedule.gamma ** ((step - warm) // schedule.step_size)
    if isinstance(schedule, Cosine):
        span = max(1, (schedule.steps or total) - warm)
        t = min(1.0, (step - warm) / span)
        return schedule.min_lr + (base_lr - schedule.min_lr) * 0.5 * (1 + math.cos(math.pi * t))
    return base_lr
