"""A run or sweep directory that cannot be written (read-only, another user's, a full disk):
one line naming it and the OS's reason, exit status 2, before Hydra writes into it.

Hydra makes the directory, opens the job's log file and writes `.hydra/` there before app's
task runs, and reports a failure of any of them with a traceback. So the check is made by the
app code that runs before each: the run's lock (app.rundir.lock, a single run), the sweep
summary's callback (the sweep directory), and the log file handler (app.logfile: each job of
a sweep, once Hydra has made its directory).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import NoReturn


def refuse(directory: Path, e: OSError, what: str = "run directory") -> NoReturn:
    # SystemExit, not an Exception: Hydra's handling of a callback's or a log handler's error
    # and its report of the job's would each turn it into a warning or a traceback.
    print(f"cannot write the {what} {directory}: {e.strerror or e}", file=sys.stderr)
    sys.exit(2)


def check(directory: Path, what: str = "run directory") -> None:
    """Make `directory` and write a byte there, or `refuse` it."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory) as f:  # (nameless: nothing is left behind)
            os.write(f.fileno(), b"\0")  # a full disk lets a file be made, not written
    except OSError as e:
        refuse(directory, e, what)
