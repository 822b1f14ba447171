"""The run's log files, `train.log` and `logs/rank{N}.log`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from app.rundir.writable import check


class LogFile(logging.FileHandler):
    def __init__(self, filename: str | Path, *args: Any, **kwargs: Any) -> None:
        # Hydra's job logging makes this handler once it made the run directory, before it
        # writes `.hydra/` there: in a job of a sweep, the first code of app's to run there.
        check(Path(filename).parent)
        super().__init__(filename, *args, **kwargs)
