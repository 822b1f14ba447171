"""Where a job runs: the topology decision, then the worker that runs the chosen mode."""

from __future__ import annotations

import logging
from pathlib import Path

from app.config import AppConfig, Mode, UserError

log = logging.getLogger(__name__)


def worker(cfg: AppConfig, run_dir: Path) -> float | None:
    """Run the mode of `cfg.trainer` in this process; returns the monitored metric."""
    # Each mode's module is imported only when chosen: predict and export pull in extra
    # libraries (matplotlib, torch.export) that a training run should not pay for.
    if cfg.trainer.mode == Mode.trainval:
        from app.train import train as run
    elif cfg.trainer.mode == Mode.eval:
        from app.evaluate import run_eval as run
    elif cfg.trainer.mode == Mode.predict:
        from app.predict import run_predict as run
    else:
        from app.export import run_export as run
    return run(cfg, run_dir)


def launch(cfg: AppConfig, run_dir: Path) -> float | None:
    if cfg.devices * cfg.nodes > 1:
        raise UserError(
            f"devices={cfg.devices} nodes={cfg.nodes}: multi-process runs are not available "
            f"in this version; use devices=1 nodes=1"
        )
    return worker(cfg, run_dir)
