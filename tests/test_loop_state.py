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
    saved = state.state_dict()
    assert saved == {"step": 12, "epoch": 3, "batch": 2, "stopped_early": "patience", "best": 0.5}
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
