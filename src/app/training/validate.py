"""Validation: mean loss and accuracy over the validation split, reduced over the ranks. The
training loop validates with it; the `trainer=eval` mode (app.modes.evaluate) reports it."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from app import dist, progress
from app.checkpoint.sharded import model_is_sharded


@torch.no_grad()
def validate(
    model: nn.Module, loader: DataLoader, device: torch.device
) -> tuple[dict[str, float], int]:
    """Mean loss and accuracy over the whole split, each sample counted once over all ranks;
    and the number of samples counted."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    dtype = next(model.parameters()).dtype  # bf16 under precision=bf16-true
    with progress.validating():  # (the place a stall verdict names)
        for x, y in _lockstep(loader, device) if model_is_sharded(model) else loader:
            progress.tick()  # progress, for the stall watchdog
            x, y = x.to(device, dtype, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            totals[0] += F.cross_entropy(logits, y, reduction="sum").double()
            totals[1] += (logits.argmax(1) == y).sum()
            totals[2] += y.numel()
        model.train(was_training)
        with progress.waiting():  # (with NCCL the host waits for the others at .tolist())
            loss_sum, correct, count = dist.all_reduce_sum(totals).tolist()
    return {"loss": loss_sum / count, "acc": correct / count}, int(count)


def _lockstep(loader: DataLoader, device: torch.device
              ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The loader's batches, then empty ones up to the longest rank's count: a sharded
    model's forward is a collective (its parameters are gathered), so every rank runs as
    many as the others (the split's samples do not always divide evenly over the ranks)."""
    most = int(dist.all_reduce_max(torch.tensor(len(loader), device=device)).item())
    x = y = None
    for x, y in loader:
        yield x, y
    if x is None:  # (this rank has no sample: an empty batch of the data's shape)
        first_x, first_y = loader.dataset[0]
        x, y = torch.as_tensor(first_x)[None], torch.as_tensor(first_y)[None]
    for _ in range(most - len(loader)):
        yield x[:0], y[:0]
