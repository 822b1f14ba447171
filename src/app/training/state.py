"""Where the training loop is (`LoopState`, which the loop, the callbacks' `Run` and the
checkpoint share), and the rules for what it does at a step: log, validate, checkpoint, finish."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from app.config import MonitorMode, TrainerConfig


@dataclass
class LoopState:
    """The loop's counters, checkpointed with `state_dict` for an exact resume."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # epochs done
    batch_in_epoch: int = 0  # optimizer steps done in the current epoch
    best: float | None = None  # the best monitored value so far
    stopped_early: str | None = None  # why a callback ended the run (early stopping)

    def advance(self, steps_per_epoch: int) -> None:
        """Count one optimizer step (and the end of an epoch, when it was its last)."""
        self.step += 1
        self.batch_in_epoch += 1
        if self.batch_in_epoch == steps_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    @property
    def epoch_end(self) -> bool:
        """Whether the step just counted ended an epoch."""
        return self.batch_in_epoch == 0 and self.step > 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "batch": self.batch_in_epoch,
                "stopped_early": self.stopped_early, "best": self.best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch"]
        self.stopped_early = state.get("stopped_early")
        self.best = state.get("best")


def _every(n: int | None, count: int) -> bool:
    return n is not None and count % n == 0


def finished(state: LoopState, t: TrainerConfig) -> bool:
    return state.stopped_early is not None or (
        t.max_steps is not None and state.step >= t.max_steps) or (
        t.max_epochs is not None and state.epoch >= t.max_epochs)


def should_log(state: LoopState, t: TrainerConfig, done: bool) -> bool:
    return done or _every(t.log_every_n_steps, state.step)


def should_validate(state: LoopState, t: TrainerConfig, done: bool) -> bool:
    return done or _every(t.val_every_n_steps, state.step) or (
        state.epoch_end and _every(t.val_every_n_epochs, state.epoch))


def should_checkpoint(state: LoopState, t: TrainerConfig, is_best: bool) -> bool:
    """Periodic checkpoints and a new best (the loop adds the last step and a stop request)."""
    return is_best or _every(t.ckpt_every_n_steps, state.step) or (
        state.epoch_end and _every(t.ckpt_every_n_epochs, state.epoch))


def improved(value: float, best: float | None, mode: MonitorMode) -> bool:
    """Whether `value` beats `best` (a NaN never does; anything beats none or NaN)."""
    if best is None or math.isnan(best):
        return not math.isnan(value)
    return value > best if mode == MonitorMode.max else value < best
