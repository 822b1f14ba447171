"""One optimizer step: micro-batches under the chosen precision, gradient accumulation and
clipping, the optimizer, scheduler and EMA updates. Everything with state is checkpointed."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from app import dist, progress
from app.errors import AppError, UserError
from app.training.ema import ModelEMA
from app.training.sharding import LOW_PRECISION, buffer_broadcast


@contextlib.contextmanager
def _gradient_sync_off(model: Any) -> Iterator[None]:
    """FSDP2's `no_sync`: the micro-batch's gradients accumulate unreduced."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _finite_everywhere(loss: torch.Tensor) -> bool:
    """Whether the loss is finite on every rank (one waits for the device, and with several
    ranks, a small all-reduce): all ranks must skip the same steps, or the weights part."""
    bad = (~torch.isfinite(loss)).to(torch.int32)
    if dist.world_size() > 1:
        bad = dist.all_reduce_max(bad)
    with progress.waiting():  # a wait for the device, where NCCL waits for the others
        return not bool(bad)


class TrainStep:
    def __init__(self, model: nn.Module, train_model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any, device: torch.device, precision: str,
                 grad_clip_norm: float | None, ema: ModelEMA | None,
                 before_update: Callable[[], None] = lambda: None,
                 skip_nonfinite: bool = False, broadcast_buffers: bool = True) -> None:
        if precision == "16-mixed" and device.type == "cpu":
            raise UserError("precision=16-mixed needs an accelerator (float16 autocast and loss "
                            "scaling are for GPUs); on the CPU use precision=bf16-mixed")
        self.model, self.train_model = model, train_model
        self.optimizer, self.scheduler = optimizer, scheduler
        self.device = device
        self.grad_clip_norm, self.ema = grad_clip_norm, ema
        self.before_update = before_update  # called before weights, optimizer state, EMA change
        self.skip_nonfinite = skip_nonfinite
        self.skipped = 0  # steps skipped for a non-finite loss
        self.telemetry: Any = None  # (trainer.telemetry: app.training.telemetry marks its parts)
        self.input_dtype = torch.bfloat16 if precision == "bf16-true" else None
        # Loss scaling keeps small float16 gradients from flushing to zero (disabled, the
        # scaler passes everything through).
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "16-mixed")
        # Looked up once: the step runs thousands of times. A model sharded by FSDP2 casts by
        # its own mixed-precision policy (app.training.sharding), not by autocast.
        sharded = hasattr(model, "set_requires_gradient_sync")
        low = None if sharded else LOW_PRECISION.get(precision)
        self.autocast = torch.autocast(device.type, dtype=low) if low else contextlib.nullcontext()
        self.no_sync = (lambda: _gradient_sync_off(model)) if sharded else \
            getattr(train_model, "no_sync", None)
        # (DDP broadcasts rank 0's buffers itself.)
        self.sync_buffers = buffer_broadcast(model) if sharded and broadcast_buffers else None

    def __call__(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
                 ) -> torch.Tensor:
        """Train on `micro_batches` as one batch; returns their mean loss (detached)."""
        progress.tick()  # progress, for the stall watchdog
        n = len(micro_batches)
        losses = []
        for i, (x, y) in enumerate(micro_batches):
            x = x.to(self.device, dtype=self.input_dtype, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            # Gradients are averaged over ranks only after the last micro-batch: syncing each
            # one would cost a collective per micro-batch for the same result.
            last = i == n - 1
            with contextlib.nullcontext() if last or self.no_sync is None else self.no_sync():
                with self.autocast:
                    loss = F.cross_entropy(self.train_model(x), y)
                    if n > 1:
                        loss = loss / n
                self.scaler.scale(loss).backward()
            losses.append(loss.detach().float())
        if self.sync_buffers is not None:
            self.sync_buffers()
        if self.telemetry is not None:
            self.telemetry.mark("backward")
        total = losses[0] if n == 1 else torch.stack(losses).sum()
        if self.grad_clip_norm is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients
            nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip_norm)
        if self.skip_nonfinite and not _finite_everywhere(total):
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()  # the schedule keeps to the loop's step count
            self.skipped += 1
            if self.telemetry is not None:
                self.telemetry.mark("optimizer")
            return total
        self.before_update()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.ema is not None:
            self.ema.update(self.model)
        if self.telemetry is not None:
            self.telemetry.mark("optimizer")
        return total

    def changed_only_by_step(self) -> list[torch.Tensor]:
        """The tensors that nothing but the update (optimizer step, EMA) changes: the weights,
        the optimizer's state, the EMA's; not buffers (a forward changes them). A checkpoint
        copies them in the background until `before_update`."""
        tensors = list(self.model.parameters())
        tensors += [v for s in self.optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor)]
        if self.ema is not None:
            tensors += list(self.ema.module.state_dict().values())
        return tensors

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict(),
                "ema": self.ema.state_dict() if self.ema else None, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """`{}`: a checkpoint without the train step's state, or a fine-tune's new start
        from the model's weights (the EMA starts from them)."""
        self.skipped = state.get("skipped", 0)
        if state.get("scaler"):  # (a disabled scaler loads nothing)
            self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None:
            if state.get("ema"):
                self.ema.load_state_dict(state["ema"])
            else:  # a run that had no EMA (or a fine-tune): the average starts here
                self.ema.module.load_state_dict(self.model.state_dict())


class FiniteLosses:
    """Stops training at a non-finite loss, naming its step, without waiting for the device
    at each step: the losses are read back together, one copy from the device for up to
    `EVERY` steps, always one step late (so the host never waits for the step it has just
    queued); and all of them at each point where the loop reads the device anyway (`flush`: a
    logging step, a validation, a checkpoint), so no logged loss, validation or checkpoint
    comes from weights a non-finite loss made. With several ranks the read is of the losses
    summed over the ranks. (A `torch.isfinite` and a read every step cost a small model about a
    tenth of its step: `make bench`, "the loop's own work".)"""

    EVERY = 10

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, int]] = []

    def check(self, loss: torch.Tensor, step: int) -> None:
        self.pending.append((loss, step))
        if len(self.pending) > self.EVERY:
            self._raise_unless_finite(self.pending[:-1])
            del self.pending[:-1]

    def flush(self) -> None:
        if self.pending:
            self._raise_unless_finite(self.pending)
            self.pending.clear()

    @staticmethod
    def _raise_unless_finite(losses: list[tuple[torch.Tensor, int]]) -> None:
        stacked = torch.stack([loss for loss, _ in losses])
        if dist.world_size() > 1:
            # Every rank reads the same losses (a NaN of any rank's makes the sum's NaN), so
            # every rank names the same first bad step: another rank's loss turns NaN a step
            # after the averaged gradients carried it there.
            stacked = dist.all_reduce_sum(stacked)
        with progress.waiting():  # a wait for the device (a slow rank's, with NCCL)
            values = stacked.tolist()
        where = " on one rank at least" if dist.world_size() > 1 else ""
        for value, (_, step) in zip(values, losses, strict=True):
            if not math.isfinite(value):
                raise AppError(
                    f"the training loss was {value} at step {step}{where}: training stopped, "
                    f"and no checkpoint was written after it. Lower optimizer.lr, check the "
                    f"data, or set trainer.skip_nonfinite=true to skip such steps; "
                    f"python -m app.replay RUN_DIR names the module and samples (several "
                    f"ranks: run again with trainer.replay_nonfinite=true)")
