"""Logging of one rank: every rank writes `logs/rank{N}.log`; only rank 0 writes to the
console and to the run's `train.log`."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from app.logfile import LogFile

FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
FAILURE_LOGGER = "app.failure"


class ConsoleHandler(logging.StreamHandler):
    """The console handler of rank 0 (and of Hydra's job logging, conf/config.yaml): while a
    progress bar is shown, a record is printed above the bar (tqdm.write clears the bar's line
    and redraws it below) instead of onto the end of the bar's line."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm = sys.modules.get("tqdm")  # no bar can be shown before tqdm is imported
        if tqdm is None or not getattr(tqdm.tqdm, "_instances", None):
            return super().emit(record)
        try:
            tqdm.tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:
            self.handleError(record)


def setup_rank_logging(run_dir: Path, rank: int, keep_handlers: bool) -> None:
    """`keep_handlers`: rank 0 of a job whose Hydra logging (console, train.log) is already set."""
    root = logging.getLogger()
    if not keep_handlers:
        # A spawned worker starts bare, a forked one inherits the parent's handlers, and under
        # torchrun each rank's Hydra set them up: none of that is wanted except on rank 0.
        root.handlers = []
        if rank == 0:
            console = ConsoleHandler(sys.stdout)
            train_log = LogFile(run_dir / "train.log")
            for handler in (console, train_log):
                handler.setFormatter(logging.Formatter(FORMAT))
                root.addHandler(handler)
    own = LogFile(run_dir / "logs" / f"rank{rank}.log")
    own.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(own)
    root.setLevel(logging.INFO)
    # A worker's failure goes to its own log only; the launching process reports it once.
    failures = logging.getLogger(FAILURE_LOGGER)
    failures.propagate, failures.handlers = False, [own]
