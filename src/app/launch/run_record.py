"""A command that fails before it trains leaves the run's record as it was.

Hydra writes the command's config into `.hydra/` before the run starts, and the run's owner
writes `result.json` when it ends. A command refused in a run directory that already holds a
run (`hydra.run.dir=DIR model=other`: its checkpoint does not fit) would otherwise leave that
run described by the refused command: `.hydra/config.yaml` of another model (which `run=`
then reads) and `result.json` "failed" for a run whose checkpoints are intact. So the owner
keeps those files as they were before Hydra wrote, and puts them back when the command ends
by an error without having changed the run: no checkpoint and no metrics row written (the
metric table is rewritten as training begins, so from then on the new command's record
stands). The error itself is on the console and in `train.log`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from app.errors import WriteFailed
from app.files import write_bytes_atomically

log = logging.getLogger(__name__)

RECORD = (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "result.json")

# run directory -> (its record files' contents, the state of what training writes)
_kept: dict[Path, tuple[dict[str, bytes], list[tuple]]] = {}


def _training_state(run_dir: Path) -> list[tuple]:
    """What a started training changes: the checkpoints (files and sharded folders) and the
    metric table, each by name, inode, size and modification time."""
    paths = [run_dir / "metrics.csv", *sorted((run_dir / "checkpoints").glob("*"))]
    state = []
    for path in paths:
        try:
            info = path.lstat()
        except FileNotFoundError:
            continue
        state.append((path.name, info.st_ino, info.st_size, info.st_mtime_ns))
    return state


def keep(run_dir: Path) -> None:
    """Before Hydra writes `.hydra/`: remember the record of the run already there, if any."""
    files = {}
    for name in RECORD:
        try:
            files[name] = (run_dir / name).read_bytes()
        except OSError:
            continue
    if files:
        _kept[run_dir] = (files, _training_state(run_dir))


def put_back(run_dir: Path) -> bool:
    """After an error: restore the kept record if the command changed no checkpoint and no
    metrics; whether it did."""
    kept = _kept.pop(Path(os.path.abspath(run_dir)), None)
    if kept is None or _training_state(run_dir) != kept[1]:
        return False
    files, _ = kept
    try:
        for name, content in files.items():
            write_bytes_atomically(run_dir / name, content)
        for name in set(RECORD) - set(files):  # (written by this command alone)
            (run_dir / name).unlink(missing_ok=True)
    except (OSError, WriteFailed) as e:
        log.warning("the run's record could not be put back: %s", e)
        return False
    log.info("this command trained nothing: %s keeps the record of the run it holds "
             "(.hydra/, result.json)", run_dir)
    return True
