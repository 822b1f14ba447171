"""LoopState and the loop's rules for when to log, validate, checkpoint and finish, in-process."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from app.callbacks import Run
from app.config import MonitorMode, TrainerConfig
from app.training.state import (
    LoopState,
    finished,
    improved,
    last_step,
    should_checkpoint,
    should_log,
    should_validate,
)


def _trainer(**kwargs) -> TrainerConfig:
    off = {"max_epochs": None, "max_steps": None, "log_every_n_steps": None,
           "val_every_n_epochs": None, "val_every_n_steps": None,
           "ckpt_every_n_epochs": None, "ckpt_every_n_steps": None}
    return TrainerConfig(**{**off, **kwargs})


def _after(steps: int, steps_per_epoch: int) -> LoopState:
    state = LoopState()
    for _ in range(steps):
        state.advance(steps_per_epoch)
    return state


def test_state_dict_round_trip() -> None:
    state = LoopState(step=12, epoch=3, batch_in_epoch=2, best=0.5, stopped_early="patience")
    state.global_batch, state.steps_per_epoch = 64, 22
    saved = state.state_dict()
    assert saved == {"step": 12, "epoch": 3, "batch": 2, "stopped_early": "patience",
                     "best": 0.5, "global_batch": 64, "steps_per_epoch": 22}
    restored = LoopState()
    restored.load_state_dict(saved)
    assert restored == state


def test_advance_counts_steps_and_rolls_the_epoch_over() -> None:
    state = _after(2, steps_per_epoch=3)
    assert (state.step, state.epoch, state.batch_in_epoch, state.epoch_end) == (2, 0, 2, False)
    state.advance(3)
    assert (state.step, state.epoch, state.batch_in_epoch, state.epoch_end) == (3, 1, 0, True)
    assert not LoopState().epoch_end  # no step yet: no epoch ended


def test_finished_by_steps_epochs_or_a_stop() -> None:
    assert finished(_after(4, 10), _trainer(max_steps=4))
    assert not finished(_after(3, 10), _trainer(max_steps=4))
    assert finished(_after(6, 3), _trainer(max_epochs=2))
    assert not finished(_after(5, 3), _trainer(max_epochs=2))
    assert finished(LoopState(stopped_early="early stopping"), _trainer(max_steps=100))


def _saved(step: int, epoch: int, batch: int, global_batch: int | None,
           steps_per_epoch: int | None) -> LoopState:
    """A loop state as a checkpoint restores it."""
    state = LoopState()
    state.load_state_dict({"step": step, "epoch": epoch, "batch": batch, "best": None,
                           "global_batch": global_batch, "steps_per_epoch": steps_per_epoch})
    return state


def test_a_resume_in_steps_of_another_size_counts_on_from_the_samples_trained_on() -> None:
    # 2 ranks x 64 -> 1 x 64: step 5 of 11 (640 samples into the epoch) is step 10 of 22.
    state = _saved(5, 0, 5, global_batch=128, steps_per_epoch=11)
    assert state.rebatch(64, 22) == _saved(5, 0, 5, 128, 11)
    assert (state.step, state.epoch, state.batch_in_epoch) == (5, 0, 10)
    assert (state.global_batch, state.steps_per_epoch) == (64, 22)
    assert last_step(state, _trainer(max_epochs=2), 22) == 5 + 12 + 22  # (not 44)
    # 1 x 64 -> 2 x 64: step 15 of 22 (960 samples) is step 7 of 11 (896: 64 seen twice).
    # Kept at 15, it was past the 11 steps of an epoch, which then never ended.
    state = _saved(15, 0, 15, global_batch=64, steps_per_epoch=22)
    assert state.rebatch(128, 11) is not None
    assert (state.step, state.epoch, state.batch_in_epoch) == (15, 0, 7)
    # Less than a step of this run's left of the epoch: the next one starts.
    state = _saved(9, 0, 9, global_batch=10, steps_per_epoch=10)
    state.rebatch(45, 2)
    assert (state.step, state.epoch, state.batch_in_epoch) == (9, 1, 0)


def test_a_resume_in_steps_of_the_same_size_changes_nothing() -> None:
    state = _saved(5, 1, 5, global_batch=128, steps_per_epoch=11)
    assert state.rebatch(128, 11) is None
    assert state == _saved(5, 1, 5, 128, 11)
    old = _saved(5, 1, 5, None, None)  # a checkpoint from before the sizes were saved
    assert old.rebatch(128, 11) is None
    assert (old.step, old.epoch, old.batch_in_epoch, old.global_batch) == (5, 1, 5, 128)


def test_last_step_counts_from_where_the_run_is() -> None:
    assert last_step(LoopState(), _trainer(max_epochs=3), 10) == 30
    assert last_step(LoopState(), _trainer(max_epochs=3, max_steps=25), 10) == 25
    assert last_step(LoopState(), _trainer(max_steps=25), 10) == 25
    assert last_step(_after(7, 4), _trainer(max_epochs=3), 10) == 7 + 10 + 7
    assert last_step(_after(9, 3), _trainer(max_epochs=2), 3) == 9  # (lowered: done)


def test_log_every_n_steps_and_at_the_end() -> None:
    t = _trainer(log_every_n_steps=5)
    assert [s for s in range(1, 12) if should_log(_after(s, 100), t, done=False)] == [5, 10]
    assert should_log(_after(7, 100), t, done=True)
    assert not should_log(_after(5, 100), _trainer(), done=False)


def test_validate_every_n_steps_every_n_epochs_and_at_the_end() -> None:
    by_steps = _trainer(val_every_n_steps=4)
    assert [s for s in range(1, 10) if should_validate(_after(s, 3), by_steps, False)] == [4, 8]
    by_epochs = _trainer(val_every_n_epochs=2)
    assert [s for s in range(1, 13) if should_validate(_after(s, 3), by_epochs, False)] == [6, 12]
    assert should_validate(_after(1, 3), _trainer(), done=True)


def test_checkpoint_every_n_steps_every_n_epochs_and_at_a_new_best() -> None:
    t = _trainer(ckpt_every_n_steps=5, ckpt_every_n_epochs=1)
    assert [s for s in range(1, 11) if should_checkpoint(_after(s, 4), t, False)] == [4, 5, 8, 10]
    assert should_checkpoint(_after(1, 4), _trainer(), is_best=True)
    assert not should_checkpoint(_after(1, 4), _trainer(), is_best=False)


@pytest.mark.parametrize(("value", "best", "mode", "expected"), [
    (0.5, None, MonitorMode.max, True), (0.5, 0.4, MonitorMode.max, True),
    (0.4, 0.4, MonitorMode.max, False), (0.3, 0.4, MonitorMode.min, True),
    (math.nan, None, MonitorMode.max, False), (0.1, math.nan, MonitorMode.min, True),
])
def test_improved(value, best, mode, expected) -> None:
    assert improved(value, best, mode) is expected


def test_run_reads_the_loops_state_by_reference() -> None:
    state = LoopState()
    model = torch.nn.Linear(1, 1)
    run = Run(None, Path("."), torch.device("cpu"), model, model, None, None,
              global_batch=1, total_steps=10, state=state)
    state.advance(steps_per_epoch=1)
    assert (run.step, run.epoch) == (1, 1)
    assert run.state is state
