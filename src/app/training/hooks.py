"""The hook contract between the training loop and callbacks, and the dispatcher: beside the
loop that calls it (users import it as `app.callbacks.Callback`).

A callback subclasses `Callback` and overrides the hooks it needs; the loop calls only the
overridden ones. Hooks run on rank 0 unless the class lists them in `every_rank` (or sets it
to True): a hook that decides something every rank must agree on (early stopping) runs on
every rank, with the same reduced metrics there.

Order of the calls in a run (S = optimizer steps, V = validations, C = checkpoints):

    load_state_dict(state)            on resume, before on_train_start (every rank)
    on_train_start(run)
      on_step_end(run, step, loss)    after each optimizer step
      on_log(run, step, metrics)      on logging steps, before the metrics are written
      on_validation_end(run, step, metrics)   metrics reduced over ranks: val/loss, val/acc
      state_dict()                    at each checkpoint (rank 0, which writes it)
    on_train_end(run, error)          always; error is None after a normal end

A callback may keep state: what `state_dict` returns goes into the checkpoint under its name,
and comes back through `load_state_dict` on resume, so an exact resume stays exact.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app import dist
from app.config import AppConfig
from app.data import DataModule
from app.errors import UserError
from app.training.state import LoopState

log = logging.getLogger(__name__)

HOOKS = ("on_train_start", "on_step_end", "on_log", "on_validation_end", "on_train_end")


@dataclass
class Run:
    """What a callback may read about the run; `step` and `epoch` follow the loop (they are
    its `LoopState`'s, which the loop and the checkpoint share)."""

    cfg: AppConfig
    run_dir: Path
    device: torch.device
    model: nn.Module  # unwrapped (no DDP, no torch.compile)
    eval_model: nn.Module  # the weights that validate: the EMA's when ema=true
    optimizer: torch.optim.Optimizer
    data: DataModule
    global_batch: int  # samples per optimizer step over all ranks
    total_steps: int
    state: LoopState = field(default_factory=LoopState)
    stop_reason: str | None = field(default=None, repr=False)

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return self.state.step

    @property
    def epoch(self) -> int:
        """Epochs done."""
        return self.state.epoch

    def request_stop(self, reason: str) -> None:
        """Stop after the current validation, on every rank (a checkpoint is saved)."""
        self.stop_reason = reason


class Callback:
    """Override the hooks you need; see the module's docstring for when each is called."""

    every_rank: bool | tuple[str, ...] = False  # hooks run on every rank, not only rank 0

    def on_train_start(self, run: Run) -> None: ...

    def on_step_end(self, run: Run, step: int, loss: torch.Tensor) -> None:
        """`loss` is this rank's, still on the device: `.item()` here would wait for it. It is
        not checked yet: a non-finite loss stops the run up to 9 steps later (the loop reads
        the losses back in batches), so this hook may see a few non-finite ones first."""

    def on_log(self, run: Run, step: int, metrics: dict[str, float]) -> None:
        """Add entries to `metrics` to have them logged with the step's loss and lr."""

    def on_validation_end(self, run: Run, step: int, metrics: dict[str, float]) -> None: ...

    def on_train_end(self, run: Run, error: BaseException | None) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _runs_here(callback: Callback, hook: str) -> bool:
    if getattr(type(callback), hook) is getattr(Callback, hook):
        return False  # not overridden: never called
    every = callback.every_rank
    return dist.is_main() or every is True or (isinstance(every, tuple) and hook in every)


class Callbacks:
    """The run's callbacks in config order, each hook a list of the bound methods to call."""

    def __init__(self, named: dict[str, Callback]) -> None:
        self.named = named
        for hook in HOOKS:
            setattr(self, hook, [getattr(c, hook) for c in named.values() if _runs_here(c, hook)])
        # Only rank 0 ever writes; every rank loads, so every-rank hooks share one state.
        self._with_state = {n: c for n, c in named.items()
                            if type(c).state_dict is not Callback.state_dict}

    @classmethod
    def build(cls, cfg: AppConfig) -> Callbacks:
        from app.training.build import (
            instantiate_group,  # (app.training.build imports the loop's pieces)
        )

        named = {}
        for name, node in cfg.callbacks.items():
            if node is None:  # callbacks.NAME=null switches one off
                continue
            try:
                callback = instantiate_group(f"callbacks.{name}", node)
            except UserError as e:  # a callback's own check names its argument: key=value
                message = str(e)
                raise UserError(message if message.startswith("callbacks.")
                                else f"callbacks.{name}.{message}") from None
            if not isinstance(callback, Callback):
                raise UserError(f"callbacks.{name}._target_={node.get('_target_')} does not "
                                f"build an app.callbacks.Callback")
            named[name] = callback
        if named:
            log.info("callbacks: %s", ", ".join(named))
        return cls(named)

    def __bool__(self) -> bool:
        return bool(self.named)

    def state_dict(self) -> dict[str, Any]:
        """Rank 0's (the checkpoint's parts are taken on every rank; rank 0 writes them)."""
        return {n: c.state_dict() for n, c in self._with_state.items()} if dist.is_main() else {}

    def load_state_dict(self, states: dict[str, Any]) -> None:
        for name, callback in self._with_state.items():
            if name in states:
                callback.load_state_dict(states[name])

    @contextmanager
    def running(self, run: Run) -> Iterator[None]:
        """on_train_start on entry; on_train_end on exit, with the error when one ends it."""
        for hook in self.on_train_start:
            hook(run)
        try:
            yield
        except BaseException as e:
            self._train_end(run, e)
            raise
        self._train_end(run, None)

    def log(self, run: Run, step: int, metrics: dict[str, float]) -> None:
        for hook in self.on_log:
            hook(run, step, metrics)

    def validation_end(self, run: Run, step: int, metrics: dict[str, float]) -> str | None:
        """Calls the hooks; returns why to stop when any callback on any rank asked to."""
        for hook in self.on_validation_end:
            hook(run, step, metrics)
        if dist.world_size() > 1:  # every rank stops at the same step, or none does
            asked = dist.all_reduce_max(
                torch.tensor(float(run.stop_reason is not None), device=run.device))
            if asked.item() and run.stop_reason is None:
                run.stop_reason = "another rank's callback asked to stop"
        return run.stop_reason

    def _train_end(self, run: Run, error: BaseException | None) -> None:
        for hook in self.on_train_end:
            try:
                hook(run, error)
            except Exception:
                if error is None:
                    raise
                # The run's own error is the one to report; this one only goes to the log.
                log.exception("callback %s failed in on_train_end", hook.__self__)
