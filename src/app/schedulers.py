"""Learning-rate schedules, stepped once per optimizer step.

Each factory takes the optimizer and the run's total number of optimizer steps (known only at
run time, hence `_partial_: true` in `conf/scheduler/`). The rules are small classes rather
than lambdas so that LambdaLR can put their settings in its state dict.
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from app.errors import UserError


class _Constant:
    def __call__(self, step: int) -> float:
        return 1.0


class _Step:
    def __init__(self, step_size: int, gamma: float) -> None:
        self.step_size, self.gamma = step_size, gamma

    def __call__(self, step: int) -> float:
        return self.gamma ** (step // self.step_size)


class _WarmupCosine:
    def __init__(self, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> None:
        self.total_steps, self.warmup_steps, self.min_lr_ratio = (
            total_steps, warmup_steps, min_lr_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine


def constant(optimizer: Optimizer, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, _Constant())


def step(optimizer: Optimizer, total_steps: int, step_size: int, gamma: float = 0.1) -> LambdaLR:
    if step_size <= 0 or gamma <= 0:
        raise UserError(f"scheduler: step_size={step_size} and gamma={gamma} must be positive")
    return LambdaLR(optimizer, _Step(step_size, gamma))


def warmup_cosine(
    optimizer: Optimizer, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0
) -> LambdaLR:
    if warmup_steps < 0 or not 0 <= min_lr_ratio <= 1:
        raise UserError(
            f"scheduler: warmup_steps={warmup_steps} must be 0 or more and "
            f"min_lr_ratio={min_lr_ratio} in [0, 1]"
        )
    return LambdaLR(optimizer, _WarmupCosine(total_steps, warmup_steps, min_lr_ratio))
