"""Checkpoint files: one plain dict of state dicts per file, written atomically.

Periodic checkpoints are `step-NNNNNNNN.pt`; `last.pt` and `best.pt` are hard links to one of
them (a copy where the file system has no hard links), so a checkpoint is written once
whatever names it gets. Every name is put in place with `os.replace`, so a crash at any
moment leaves the previous file under each name intact. `last.pt` is named before `best.pt`,
and each checkpoint records whether it was the best: a crash between the two names leaves a
`last.pt` that says so, and a resume names it `best.pt` (`repair_names`).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from app.errors import AppError, UserError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(state: dict[str, Any], path: Path) -> None:
    """Write `state` to `path` atomically: temporary file, flush, fsync, rename. On failure
    (a full or read-only disk) the temporary file is removed and the error raised."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # (prune: `.*.tmp`)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        # A full or read-only disk, a quota, a file size limit: the user's to fix. (torch.save
        # reports a failed write as a RuntimeError from its zip writer.)
        if isinstance(e, OSError) or (isinstance(e, RuntimeError) and "unexpected pos" in str(e)):
            reason = e.strerror if isinstance(e, OSError) and e.strerror else \
                "a write failed: is the disk full?"
            raise AppError(f"checkpoint {path} could not be written ({reason}); the "
                           f"checkpoints already on disk are intact") from e
        raise


def link(source: Path, name: Path) -> None:
    """Give the file `source` a second name, replacing whatever had that name, atomically."""
    tmp = name.with_name(f".{name.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:  # no hard links here (some network file systems): copy instead
        shutil.copyfile(source, tmp)
    os.replace(tmp, name)
    _fsync_dir(name.parent)


def periodic_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def prune(directory: Path, keep: int) -> None:
    """Delete all but the newest `keep` periodic checkpoints (last.pt and best.pt stay), and
    temporary files that a crash left behind."""
    periodic = sorted(directory.glob("step-*.pt"))
    for old in periodic[: max(0, len(periodic) - keep)]:
        old.unlink()
    for stale in directory.glob(".*.tmp"):
        stale.unlink(missing_ok=True)


def load(path: str | Path, resume: bool = False) -> dict[str, Any]:
    """Read a checkpoint with `weights_only=True` and check its structure (`check`): a
    user-facing error if it is not one, or (with `resume`) not one a run can resume from."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"checkpoint {path}: a directory, not a checkpoint file (a run keeps "
                        f"its checkpoints in checkpoints/: give one, such as last.pt)")
    if not path.is_file():
        raise UserError(f"checkpoint {path}: file not found")
    # Garbage bytes make the unpickler raise almost anything (IndexError, KeyError,
    # UnicodeDecodeError, ...): every one of them means the file is not a readable checkpoint.
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        if "Weights only load failed" in str(e):
            raise UserError(
                f"checkpoint {path}: refused: it holds Python objects other than tensors and "
                f"plain values, and loading those could run code (nothing was run). Load only "
                f"checkpoints written by app, or by code you trust") from e
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"checkpoint {path}: not a readable checkpoint ({first_line})") from e
    check(state, path, resume)
    return state


def _type(value: Any) -> str:
    return type(value).__name__


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None  # (extra state)


def _check_weights(weights: Any, path: Path, where: str) -> None:
    if not isinstance(weights, dict):
        raise UserError(f"checkpoint {path}: {where} is {_type(weights)}, not a dict of "
                        f"tensors: not an app checkpoint, or a damaged one")
    for name, value in weights.items():
        # (`_extra_state`: what a module's get_extra_state returns, any plain value)
        if not isinstance(value, torch.Tensor) and not str(name).endswith("_extra_state"):
            raise UserError(f"checkpoint {path}: {where} entry {name!r} is {_type(value)}, not "
                            f"a tensor: not an app checkpoint, or a damaged one")


# What a resume reads besides the weights, and the type each entry must have.
RESUME_ENTRIES = {"optimizer": dict, "scheduler": dict, "loop": dict, "rng": list,
                  "best": (float, int, type(None))}
LOOP_COUNTERS = ("step", "epoch", "batch")


def check(state: Any, path: Path, resume: bool = False) -> None:
    """The structure every reader relies on: weights that are tensors (the EMA's too), a loop
    record of counters, a config of dicts; with `resume`, everything a resume reads. The one
    place that knows a checkpoint's keys, so no reader meets a KeyError or a TypeError."""
    if not isinstance(state, dict) or "model" not in state:
        raise UserError(f"checkpoint {path}: not an app checkpoint (no 'model' entry)")
    _check_weights(state["model"], path, "'model'")
    for key in ("train_step", "config", "callbacks", "metrics"):
        if not isinstance(state.get(key, {}), dict):
            raise UserError(f"checkpoint {path}: {key!r} is {_type(state[key])}, not a dict: "
                            f"a damaged checkpoint")
    ema = (state.get("train_step") or {}).get("ema")
    if ema:
        if not isinstance(ema, dict) or "module" not in ema:
            raise UserError(f"checkpoint {path}: 'train_step.ema' has no 'module' weights: "
                            f"a damaged checkpoint")
        _check_weights(ema["module"], path, "'train_step.ema.module'")
    for key in ("model", "optimizer", "data"):
        if not isinstance((state.get("config") or {}).get(key, {}), dict):
            raise UserError(f"checkpoint {path}: 'config.{key}' is not a dict: a damaged "
                            f"checkpoint")
    if resume:
        for key, kind in RESUME_ENTRIES.items():
            if key not in state:
                raise UserError(
                    f"checkpoint {path}: no {key!r} entry, which a resume needs (not written "
                    f"by app's training, or damaged); to start a new run from its weights, "
                    f"give it as ckpt={path} resume=null")
            if not isinstance(state[key], kind):
                raise UserError(f"checkpoint {path}: {key!r} is {_type(state[key])}: a "
                                f"damaged checkpoint")
        if not all(isinstance(r, dict) and {"python", "numpy", "torch"} <= r.keys()
                   for r in state["rng"]):
            raise UserError(f"checkpoint {path}: 'rng' does not hold random states: a damaged "
                            f"checkpoint")
    loop = state.get("loop")
    if loop is not None:
        for key in LOOP_COUNTERS if resume else ("step", "epoch"):
            if not isinstance(loop.get(key) if isinstance(loop, dict) else None, int):
                raise UserError(
                    f"checkpoint {path}: 'loop' has no {key!r} count"
                    + (f" ({key}={loop[key]!r})" if isinstance(loop, dict) and key in loop
                       else "") + ": a damaged checkpoint")


def check_layout(directory: Path) -> None:
    """Before training: every name the run writes checkpoints under is free or a file (a
    directory called last.pt would fail the first save, after training, not before)."""
    if directory.exists() and not directory.is_dir():
        raise UserError(f"{directory} is a file, not a directory: the run keeps its "
                        f"checkpoints there; move it away")
    names = [directory / "last.pt", directory / "best.pt", *directory.glob("step-*.pt")]
    for path in names:
        if path.exists() and not path.is_file():
            raise UserError(f"{path} is a {'directory' if path.is_dir() else 'special file'}, "
                            f"not a checkpoint: the run writes its checkpoints under that "
                            f"name; move it away")


def repair_names(directory: Path, path: Path, state: dict[str, Any]) -> None:
    """Give the checkpoint a run resumes from the names a crash kept it from getting:
    `last.pt` (when it was not under that name) and `best.pt` (when it records that it was
    the best: a crash between the `last.pt` and `best.pt` links left the older best)."""
    if path.resolve().parent != directory.resolve():
        return  # resume=PATH of another run: its names are not ours to change
    wanted = [directory / "last.pt"] + ([directory / "best.pt"] if state.get("is_best") else [])
    for name in wanted:
        if not (name.is_file() and os.path.samefile(name, path)):
            link(path, name)
            log.warning("resume: %s now names the checkpoint of step %s (a crash had kept "
                        "it from that name)", name.name, (state.get("loop") or {}).get("step"))


def latest_valid(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of a run directory that loads: last.pt, else the periodic ones,
    newest first; each that does not load is named in a warning. None when there is no
    checkpoint at all; an error when there are some and none loads (a run is never silently
    started afresh over checkpoints that exist)."""
    candidates = [directory / "last.pt", *sorted(directory.glob("step-*.pt"), reverse=True)]
    bad = []
    for path in (c for c in candidates if c.is_file()):
        try:
            return path, load(path, resume=True)
        except UserError as e:
            reason = str(e).removeprefix(f"checkpoint {path}: ")
            log.warning("resume: skipping %s: %s", path, reason)
            bad.append(f"{path.name}: {reason}")
    if bad:
        raise UserError(f"resume=auto: no checkpoint in {directory} can be loaded "
                        f"({'; '.join(bad)}); move them away to start afresh, or give one "
                        f"with resume=PATH")
    return None


def inference_weights(state: dict[str, Any]) -> dict[str, Any]:
    """The weights validation used: the EMA's when the run kept one (so eval matches)."""
    ema = (state.get("train_step") or {}).get("ema")
    return ema["module"] if ema else state["model"]


def load_model_weights(model: torch.nn.Module, state: dict[str, Any], path: str | Path,
                       strict: bool = True, weights: dict[str, Any] | None = None,
                       fine_tuning: bool = False) -> None:
    """Load a checkpoint's model weights, naming every mismatch if they do not fit.

    `strict=False` (fine-tuning a changed model): load the weights whose names and shapes
    match and report the others. `fine_tuning`: the load is `ckpt=` of training, where
    `ckpt_strict=false` is the way to a changed model, so a mismatch points to it.
    """
    ours = model.state_dict()
    theirs = state["model"] if weights is None else weights
    missing = sorted(set(ours) - set(theirs))
    unexpected = sorted(set(theirs) - set(ours))
    wrong_shape = [
        f"{k} {_shape(theirs[k])} vs {_shape(ours[k])}"
        for k in sorted(set(ours) & set(theirs))
        if _shape(theirs[k]) != _shape(ours[k])
    ]
    if not strict:
        fitting = {k: v for k, v in theirs.items() if k in ours and _shape(v) == _shape(ours[k])}
        model.load_state_dict(fitting, strict=False)
        skipped = missing + unexpected + wrong_shape
        log.info("loaded %d of %d weights from %s%s", len(fitting), len(ours), path,
                 f"; skipped: {', '.join(skipped)}" if skipped else "")
        return
    if missing or unexpected or wrong_shape:
        config = state.get("config") or {}
        trained = f"model={config.get('model') or {}}"
        if "num_classes" in (config.get("data") or {}):
            trained += f" and data.num_classes={config['data']['num_classes']}"
        advice = ("to fine-tune it on this model (a new head for another num_classes), add "
                  "ckpt_strict=false: the weights that fit are loaded, the others start fresh"
                  ) if fine_tuning else "use the same model settings"
        parts = [
            f"{label}: {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}"
            for label, items in (
                ("missing", missing), ("unexpected", unexpected), ("shape", wrong_shape))
            if items
        ]
        raise UserError(
            f"checkpoint {path} does not match the model ({'; '.join(parts)}). "
            f"It was trained with {trained}; {advice}"
        )
    model.load_state_dict(theirs)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any],
                         path: str | Path, current: dict[str, Any]) -> None:
    """Resume the optimizer; a checkpoint of another optimizer is an error naming both."""
    trained = (state.get("config") or {}).get("optimizer") or {}
    if trained.get("_target_", current.get("_target_")) != current.get("_target_"):
        raise UserError(
            f"checkpoint {path} was trained with optimizer {trained.get('_target_')}, this run "
            f"has {current.get('_target_')}: resume with the same optimizer, or start a new "
            f"schedule from its weights with ckpt={path} resume=null")
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError, RuntimeError) as e:
        raise UserError(
            f"checkpoint {path}: its optimizer state does not fit this run's optimizer ({e}). "
            f"It was trained with optimizer={trained}, this run has optimizer={dict(current)}; "
            f"resume with the same settings, or start a new schedule from its weights with "
            f"ckpt={path} resume=null") from e
