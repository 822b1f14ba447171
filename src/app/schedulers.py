"""Learning-rate schedules, stepped once per optimizer step.

Each factory takes the optimizer and the run's total number of optimizer steps (known only at
run time, hence `_partial_: true` in `conf/scheduler/`). The rules are small classes rather
than lambdas so that LambdaLR can put their settings in its state dict.
"""

from __future__ import annotations

import logging
import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from app.errors import UserError

log = logging.getLogger(__name__)


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
        # [step, progress]: where `respread` took the decay up, to end at total_steps from
        # there (None: from the warm-up's end at 0). Kept in the state dict, as the rest.
        self.knot: list[float] | None = None

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        cosine = 0.5 * (1.0 + math.cos(math.pi * self._progress(step)))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine

    def _progress(self, step: int) -> float:
        start, done = self.knot or (self.warmup_steps, 0.0)
        return min(1.0, done + (1.0 - done) * (step - start) / max(1, self.total_steps - start))

    def respread(self, step: int, total_steps: int) -> None:
        """End the decay at `total_steps`, going on from where it is at `step`."""
        if step > self.warmup_steps:
            self.knot = [step, self._progress(step)]
        self.total_steps = total_steps


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
    if warmup_steps > total_steps:
        peak = optimizer.param_groups[0]["lr"]
        log.warning("scheduler.warmup_steps=%d is longer than the run's %d steps: the learning "
                    "rate climbs to %.3g, never to its peak %.3g (optimizer.lr); set "
                    "scheduler.warmup_steps=%d, say", warmup_steps, total_steps,
                    peak * total_steps / warmup_steps, peak, math.ceil(total_steps / 10))
    return LambdaLR(optimizer, _WarmupCosine(total_steps, warmup_steps, min_lr_ratio))


def respread(scheduler: LRScheduler, step: int, made_for: int, total_steps: int) -> None:
    """After a resume in steps of another size (another number of ranks, batch size or
    accumulation): a schedule made to end at the run's end, `made_for` as the saved run
    counted it, ends at the same point in this run's steps, `total_steps`, going on from
    where it is at `step`. One made for another length (resumed with another
    trainer.max_epochs, which the resume warns of) goes on as saved; the constant and step
    schedules have no length."""
    for rule in getattr(scheduler, "lr_lambdas", ()):
        if isinstance(rule, _WarmupCosine) and rule.total_steps == made_for != total_steps:
            rule.respread(step, total_steps)
