"""The `trainer=eval` mode: the validation metrics (app.training.validate) of a checkpoint."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from app import dist
from app.config import AppConfig
from app.files import write_text_atomically
from app.reporting.loggers import CSVLogger
from app.training.build import build_data, build_trained_model, build_val_loader
from app.training.validate import validate

log = logging.getLogger(__name__)


def run_eval(cfg: AppConfig, run_dir: Path, device: torch.device) -> float:
    data = build_data(cfg)
    model, (step, epoch) = build_trained_model(cfg, data)  # (0, 0) for a weights-only file
    metrics, count = validate(model.to(device), build_val_loader(data), device)
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
