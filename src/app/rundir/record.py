"""A command that fails before it trains, or finds the run completed, leaves the run's record
as it was.

Hydra writes `.hydra/` before the run starts, and the owner writes `result.json` at its end: a
command refused in a directory that holds a run (`hydra.run.dir=DIR model=other`: the checkpoint
does not fit) would leave that run described by the refused command (`run=` reads its config).
So the owner keeps those files, and puts them back after an error if the command wrote no
checkpoint and no metrics row (the metric table is rewritten as training begins: from then on
the new command's record stands).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path

import psutil

from app.errors import WriteFailed
from app.files import write_bytes_atomically

log = logging.getLogger(__name__)

# Its log record: app.sweeps.summary counts no wall time for such a command.
TRAINED_NOTHING = "this command trained nothing"
RECORD = (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "result.json")

# run directory -> (its record files' contents, the state of what training writes)
_kept: dict[Path, tuple[dict[str, bytes], list[tuple]]] = {}


def _training_state(run_dir: Path) -> list[tuple]:
    """The checkpoints (files and sharded folders) and the metric table, each by name, inode,
    size and modification time."""
    state = []
    for path in [run_dir / "metrics.csv", *sorted((run_dir / "checkpoints").glob("*"))]:
        with contextlib.suppress(FileNotFoundError):
            info = path.lstat()
            state.append((path.name, info.st_ino, info.st_size, info.st_mtime_ns))
    return state


_IMPORTED = time.time()  # (early in the entry: before this command's Hydra writes .hydra/)


def _command_started() -> float:
    """When this command began: for a rank that torchrun, srun or mpirun started, when its
    starter did (its peers are this command too); else when this process imported this."""
    from app.env import this_process

    if this_process().is_rank:
        with contextlib.suppress(psutil.Error, AttributeError):  # (no parent: None)
            return psutil.Process().parent().create_time()
    return _IMPORTED


def keep(run_dir: Path) -> None:
    """Before Hydra writes `.hydra/`: remember the record of the run already there, if any.
    Not files written since this command started: under torchrun or srun the other ranks of
    this command write `.hydra/` too (kept, an error's put_back removed the run's result.json
    for the record of a run that never was)."""
    started = _command_started()
    files = {name: (run_dir / name).read_bytes() for name in RECORD
             if (run_dir / name).exists() and (run_dir / name).stat().st_mtime < started}
    if files:
        _kept[run_dir] = (files, _training_state(run_dir))


def _status(result: bytes) -> object:
    with contextlib.suppress(ValueError, AttributeError):
        return json.loads(result).get("status")
    return None


def put_back(run_dir: Path, completed_only: bool = False) -> bool:
    """After an error, or (`completed_only`) after a command that found the run it holds
    completed already (a re-run: "nothing to train"): restore the kept record if the command
    changed no checkpoint and no metrics; whether it did."""
    kept = _kept.pop(Path(os.path.abspath(run_dir)), None)
    if kept is None or _training_state(run_dir) != kept[1] or completed_only and \
            _status(kept[0].get("result.json", b"")) != "completed":
        return False
    try:
        for name in RECORD:
            if name in kept[0]:
                write_bytes_atomically(run_dir / name, kept[0][name])
            else:  # (written by this command alone)
                (run_dir / name).unlink(missing_ok=True)
    except (OSError, WriteFailed) as e:
        log.warning("the run's record could not be put back: %s", e)
        return False
    log.info("%s: %s keeps the record of the run it holds (.hydra/, result.json)",
             TRAINED_NOTHING, run_dir)
    return True
