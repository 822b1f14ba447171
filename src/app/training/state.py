"""Where the training loop is (`LoopState`, which the loop, the callbacks' `Run` and the
checkpoint share), and the rules for what it does at a step: log, validate, checkpoint, finish."""

from __future__ import annotations

import dataclasses
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
    # The size of its steps: samples per optimizer step over all ranks, and steps an epoch
    # (None: a checkpoint written before they were saved).
    global_batch: int | None = None
    steps_per_epoch: int | None = None

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
                "stopped_early": self.stopped_early, "best": self.best,
                "global_batch": self.global_batch, "steps_per_epoch": self.steps_per_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch"]
        self.stopped_early = state.get("stopped_early")
        self.best = state.get("best")
        self.global_batch = state.get("global_batch")
        self.steps_per_epoch = state.get("steps_per_epoch")

    def rebatch(self, global_batch: int, steps_per_epoch: int) -> LoopState | None:
        """Count on in steps of this run's size, from a checkpoint whose steps may have had
        another (another number of ranks, batch size or accumulation): the steps done in the
        epoch become the samples trained on, in this run's steps, rounded down (a few samples
        trained on twice rather than some never). An epoch's order of samples is the same on
        any number of ranks (DistributedSampler's), so the rest of the epoch follows on.
        Returns the position as it was saved when the size differs, else None."""
        saved = dataclasses.replace(self)
        self.global_batch, self.steps_per_epoch = global_batch, steps_per_epoch
        if saved.global_batch is not None:
            self.batch_in_epoch = self.batch_in_epoch * saved.global_batch // global_batch
        if self.batch_in_epoch >= steps_per_epoch:  # (what is left of the epoch: no whole step)
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        same = saved.global_batch in (None, global_batch) and \
            saved.steps_per_epoch in (None, steps_per_epoch)
        return None if same else saved


def _every(n: int | None, count: int) -> bool:
    return n is not None and count % n == 0


def last_step(state: LoopState, t: TrainerConfig, steps_per_epoch: int) -> int:
    """The step the run ends at, early stopping aside: counted on from where `state` is, at
    `steps_per_epoch`, to trainer.max_epochs, or trainer.max_steps if that comes first."""
    to_epochs = math.inf if t.max_epochs is None else max(
        0, (t.max_epochs - state.epoch) * steps_per_epoch - state.batch_in_epoch)
    return int(min(t.max_steps or math.inf, state.step + to_epochs))


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
