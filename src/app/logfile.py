"""The run's log files, `train.log` and `logs/rank{N}.log`, on a disk that fills up.

logging's FileHandler reports each record it fails to write with a traceback on stderr: a run
on a full disk printed thousands. `LogFile` keeps its first failure instead and prints
nothing; the training loop stops at its next step with a checkpoint (app.training.stop) and
the run ends with one line naming the file and the reason, exit status 1 (WriteFailed).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from app.rundir.writable import check


class LogFile(logging.FileHandler):
    def __init__(self, filename: str | Path, *args: Any, **kwargs: Any) -> None:
        # Hydra's job logging makes this handler once it made the run directory, before it
        # writes `.hydra/` there: in a job of a sweep, the first code of app's to run there.
        check(Path(filename).parent)
        super().__init__(filename, *args, **kwargs)
        self.error: OSError | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.error is None:  # (after a failure the run is stopping: no retry per record)
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)  # a mistake in a log call: logging's own report
        elif self.error is None:
            self.error = error


def failure() -> str | None:
    """`PATH could not be written (REASON)` for a log file of this process's run that failed
    (the root logger's handlers: Hydra replaces them for each job of a sweep)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, LogFile) and handler.error is not None:
            return f"{handler.baseFilename} could not be written " \
                   f"({handler.error.strerror or handler.error})"
    return None
