"""Validation metrics, and the `trainer=eval` mode."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from app import dist
from app.config import AppConfig
from app.files import write_text_atomically
from app.launch import watchdog
from app.reporting.loggers import CSVLogger
from app.training.build import build_data, build_trained_model, build_val_loader

log = logging.getLogger(__name__)


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: DataLoader, device: torch.device
) -> tuple[dict[str, float], int]:
    """Mean loss and accuracy over the whole split, each sample counted once over all ranks;
    and the number of samples counted."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    dtype = next(model.parameters()).dtype  # bf16 under precision=bf16-true
    for x, y in loader:
        watchdog.tick()  # progress, for the stall watchdog
        x, y = x.to(device, dtype, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        totals[0] += F.cross_entropy(logits, y, reduction="sum").double()
        totals[1] += (logits.argmax(1) == y).sum()
        totals[2] += y.numel()
    model.train(was_training)
    with watchdog.waiting():  # (with NCCL the host waits for the others at .tolist())
        loss_sum, correct, count = dist.all_reduce_sum(totals).tolist()
    return {"loss": loss_sum / count, "acc": correct / count}, int(count)


def run_eval(cfg: AppConfig, run_dir: Path, device: torch.device) -> float:
    data = build_data(cfg)
    model, (step, epoch) = build_trained_model(cfg, data)  # (0, 0) for a weights-only file
    metrics, count = evaluate(model.to(device), build_val_loader(data), device)
    if dist.is_main():
        CSVLogger(run_dir / "metrics.csv").log(step, epoch, "val", metrics)
        record = {"ckpt": str(cfg.ckpt), "step": step, "num_samples": count,
                  "world_size": dist.world_size(), **metrics}
        write_text_atomically(run_dir / "eval.json", json.dumps(record, indent=2) + "\n")
    log.info(
        "eval of %s (step %d) on %d validation samples: loss %.4f, acc %.4f",
        cfg.ckpt, step, count, metrics["loss"], metrics["acc"],
    )
    return metrics[cfg.trainer.monitor.split("/", 1)[-1]]
