"""Checkpoint files: one plain dict of state dicts per file, written atomically.

Periodic checkpoints are `step-NNNNNNNN.pt`; `last.pt` and `best.pt` are hard links to one of
them (a copy where the file system has no hard links), so a checkpoint is written once
whatever names it gets. Every name is put in place with `os.replace`, so a crash at any
moment leaves the previous file under each name intact. `last.pt` is named before `best.pt`,
and each checkpoint records whether it was the best: a crash between the two names leaves a
`last.pt` that says so, and a resume names it `best.pt` (`layout.repair_names`).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from app.errors import AppError, UserError
from app.files import sync_dir


def save(state: dict[str, Any], path: Path) -> None:
    """Write `state` to `path` atomically; on failure the temporary file is removed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # (prune: `.*.tmp`)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        put(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if reason(e) is not None:
            raise not_written(path, reason(e)) from e
        raise


def reason(e: BaseException) -> str | None:
    """Why a write failed, when the user can fix it: a full or read-only disk, a quota, a file
    size limit (torch.save reports a failed write as a RuntimeError from its zip writer)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    if isinstance(e, OSError) or (isinstance(e, RuntimeError) and "unexpected pos" in str(e)):
        return "a write failed: is the disk full?"
    return None


def not_written(path: Path, reason: str | None) -> AppError:
    return AppError(f"checkpoint {path} could not be written ({reason}); the checkpoints "
                    f"already on disk are intact")


def put(new: Path, name: Path) -> None:
    """Rename `new` (a file or a directory) to `name`, replacing what has that name. A
    directory (a sharded checkpoint of the same step), or a file where a directory comes,
    cannot be renamed over: it is renamed aside first and removed once `new` has its place,
    so `name` is never half-deleted."""
    aside = None
    if not name.is_symlink() and (name.is_dir() or new.is_dir() and name.is_file()):
        aside = name.with_name(f".{name.name}.{os.getpid()}.old.tmp")
        os.replace(name, aside)
    os.replace(new, name)
    sync_dir(name.parent)
    if aside is not None:
        remove(aside)


def link(source: Path, name: Path) -> None:
    """Give the checkpoint `source` a second name, atomically: a hard link to a file, a
    symbolic link (relative: the run directory may move) to a sharded checkpoint's directory."""
    tmp = name.with_name(f".{name.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    if source.is_dir():
        os.symlink(os.path.relpath(source.resolve(), name.parent.resolve()), tmp)
    else:
        try:
            os.link(source, tmp)
        except OSError:  # no hard links here (some network file systems): copy instead
            shutil.copyfile(source, tmp)
    put(tmp, name)


def is_checkpoint(path: Path) -> bool:
    """A checkpoint file, or a sharded checkpoint's directory (one with DCP's index)."""
    return path.is_file() or (path / ".metadata").is_file()


def periodic_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def remove(path: Path) -> None:
    """Delete a file, a link, or a directory (renamed out of its name first: a kill while it
    is deleted leaves no half-deleted checkpoint under a name that is read)."""
    if path.is_dir() and not path.is_symlink():
        if not path.name.endswith(".tmp"):
            aside = path.with_name(f".{path.name}.{os.getpid()}.old.tmp")
            os.replace(path, aside)
            path = aside
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def prune(directory: Path, keep: int) -> None:
    """Delete all but the newest `keep` periodic checkpoints (last.pt and best.pt stay: a
    file's other names keep it; a directory they link to is kept), and what a crash left
    behind under a temporary name."""
    named = {(directory / n).resolve() for n in ("last.pt", "best.pt")
             if (directory / n).is_symlink()}
    periodic = sorted(directory.glob("step-*.pt"))
    for old in periodic[: max(0, len(periodic) - keep)]:
        if old.resolve() not in named:
            remove(old)
    # Files only: another rank may have begun the next sharded checkpoint's directory.
    for stale in directory.glob(".*.tmp"):
        if not stale.is_dir() or stale.is_symlink():
            stale.unlink(missing_ok=True)


def read(path: Path) -> Any:
    """Read a checkpoint file with `weights_only=True`; a user-facing error if it cannot be."""
    if path.is_dir():
        if (path / "meta.pt").is_file() or any(path.glob("*.distcp")):
            raise UserError(f"checkpoint {path}: a sharded checkpoint's directory without "
                            f"its index (.metadata): not a whole checkpoint")
        raise UserError(f"checkpoint {path}: a directory, not a checkpoint file (a run keeps "
                        f"its checkpoints in checkpoints/: give one, such as last.pt)")
    if not path.is_file():
        try:
            os.stat(path)
        except OSError as e:  # (a link that leads back to itself is no file, nor a missing one)
            if e.errno == errno.ELOOP:
                raise UserError(f"checkpoint {path}: a symbolic link loop (its links lead back "
                                f"to themselves, never to a file)") from None
        raise UserError(f"checkpoint {path}: file not found")
    # Garbage bytes make the unpickler raise almost anything (IndexError, KeyError,
    # UnicodeDecodeError, ...): every one of them means the file is not a readable checkpoint.
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        # A pickle of objects names the global it refused ("Unsupported global: GLOBAL ...",
        # "unsupported GLOBAL posix.system"); bytes it cannot read do not.
        # (Garbage may start with the GLOBAL opcode too, `c`: then its "name" is no dotted
        # Python name, as for a file starting "cut short".)
        named = re.search(r"GLOBAL (.+?) was not an allowed global", str(e))
        if "Weights only load failed" in str(e) and "GLOBAL" in str(e) and not (
                named and not all(part.isidentifier() for part in named[1].split("."))):
            raise UserError(
                f"checkpoint {path}: refused: it holds Python objects other than tensors and "
                f"plain values, and loading those could run code (nothing was run). Load only "
                f"checkpoints written by app, or by code you trust") from e
        # (Some say only a number or an errno: "105", "[Errno 22] Invalid argument"; the
        # weights-only unpickler's own line is the one after its advice.)
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        said = next((line for line in lines if line.startswith("Unsupported")), None) or \
            (lines[0] if lines and "Weights only load failed" not in lines[0] else "")
        why = f"{type(e).__name__}: {said}" if said else type(e).__name__
        raise UserError(f"checkpoint {path}: not a readable checkpoint file (cut short, or not "
                        f"written by torch.save: {why})") from e


def check_layout(directory: Path) -> None:
    """Before training: every name the run writes checkpoints under is free or a file (a
    directory called last.pt would fail the first save, after training, not before)."""
    if directory.exists() and not directory.is_dir():
        raise UserError(f"{directory} is a file, not a directory: the run keeps its "
                        f"checkpoints there; move it away")
    # A step directory with shards but no DCP index is a sharded checkpoint cut short: a
    # resume skips it and a save replaces it. Any other directory is not ours to replace.
    names = [directory / "last.pt", directory / "best.pt", *directory.glob("step-*.pt")]
    for path in names:
        ours = path.is_symlink() or path.name.startswith("step-") and path.is_dir() and (
            any(path.glob("*.distcp")) or (path / "meta.pt").is_file())
        if path.exists() and not is_checkpoint(path) and not ours:
            raise UserError(f"{path} is a {'directory' if path.is_dir() else 'special file'}, "
                            f"not a checkpoint: the run writes its checkpoints under that "
                            f"name; move it away")
