"""The checkpoint's layout, in one place: its entries, its format version, the check of a
loaded checkpoint's structure, and finding the one a run directory resumes from.

One file holds a plain dict:

    format        FORMAT_VERSION (a file without it has the layout of version 1)
    model         the unwrapped model's state dict
    optimizer     its state dict, numbered as `Optimizer.state_dict()` numbers it
    scheduler     its state dict
    train_step    {scaler, ema: {module, updates} or None, skipped}
    loop          {step, epoch, batch (in the epoch), stopped_early, global_batch,
                  steps_per_epoch (the size of its steps)}
    callbacks     {name: state dict} of the callbacks that keep state
    data          what the data learnt from the training set (an image folder's classes and
                  normalisation; {} for most; a file without it: {})
    best, is_best the best monitored value so far; whether this checkpoint is that best
    metrics       the validation metrics of this step ({} when it did not validate)
    rng           every rank's random states, by rank
    config        the resolved config of the run
    trackers      the trackers' run ids (MLflow, W&B), continued by a resume
    param_names   the parameters' names in the optimizer's order (its state is numbered)

Under `distributed.strategy=fsdp` a checkpoint is a directory of the same name, written by
every rank (app.checkpoint.sharded): the same entries, the tensors of model, optimizer (keyed
by parameter name) and EMA in shards. Every reader takes either kind, whatever the run's
strategy: a resume reads a sharded checkpoint's tensors into the run's own, on any number of
ranks (`manager`); everything else reads it whole (`sharded.read_full`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch

from app.checkpoint import io, sharded
from app.errors import UserError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # raise it when the layout changes, and read the older ones too

# What a resume reads besides the weights, and the type each entry must have.
RESUME_ENTRIES = {"optimizer": dict, "scheduler": dict, "loop": dict, "rng": list,
                  "best": (float, int, type(None))}


class TrainedAt(NamedTuple):
    """Where in its training a checkpoint was written (0, 0 for a weights-only file)."""

    step: int
    epoch: int


# ---- reading and checking a file -------------------------------------------------------------

def load(path: str | Path, resume: bool = False) -> dict[str, Any]:
    """Read a checkpoint, a file or a sharded directory, and `check` it. With `resume`, a
    sharded checkpoint's tensors stay on disk (its model, optimizer and EMA entries are empty
    here): the resume reads them into the run's own (`manager`)."""
    path = Path(path)
    if not sharded.is_sharded(path):
        state = io.read(path)
    elif resume:
        stand_ins = dict.fromkeys(sharded.tensor_groups(path), {})
        state = sharded.join(sharded.read_meta(path), stand_ins)
    else:
        state = sharded.read_full(path)
    check(state, path, resume)
    return state


def _type(value: Any) -> str:
    return type(value).__name__


def shape(value: Any) -> tuple[int, ...] | None:
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


def check(state: Any, path: Path, resume: bool = False) -> None:
    """The structure every reader relies on (with `resume`, everything a resume reads): no
    reader then meets a KeyError or a TypeError."""
    if not isinstance(state, dict) or "model" not in state:
        raise UserError(f"checkpoint {path}: not an app checkpoint (no 'model' entry)")
    version = state.get("format", FORMAT_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or version > FORMAT_VERSION:
        raise UserError(f"checkpoint {path}: format {version!r}, which this app cannot read (it "
                        f"reads formats up to {FORMAT_VERSION}): use the app that wrote it")
    _check_weights(state["model"], path, "'model'")
    for key in ("train_step", "config", "callbacks", "metrics", "data"):
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
        for key in ("step", "epoch", "batch") if resume else ("step", "epoch"):
            if not isinstance(loop.get(key) if isinstance(loop, dict) else None, int):
                raise UserError(
                    f"checkpoint {path}: 'loop' has no {key!r} count"
                    + (f" ({key}={loop[key]!r})" if isinstance(loop, dict) and key in loop
                       else "") + ": a damaged checkpoint")


def entries(parts: dict[str, Any], file: bool) -> dict[str, Any]:
    """The states of a run's parts (by name) as the checkpoint's entries; the optimizer's
    state numbered in a `file` (by name in shards)."""
    loop, optimizer = parts["loop"], parts["optimizer"]
    state = {**parts, "loop": {k: v for k, v in loop.items() if k != "best"},
             "best": loop["best"]}
    state["param_names"] = [n for group in optimizer["param_groups"] for n in group["params"]]
    if file:
        state["optimizer"] = sharded.optimizer_by_ids(optimizer)
    return state


def part(state: dict[str, Any], name: str) -> Any:
    """The other way: the state of the part `name` (empty where an older file has none)."""
    if name == "loop":
        return {**state["loop"], "best": state["best"]}
    return state.get(name) or {}


# ---- a run directory's checkpoints -----------------------------------------------------------

def latest_valid(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of a run directory that loads for a resume: last.pt, else the
    periodic ones, newest first. None when there is none; an error when there are some and
    none loads (a run is never silently started afresh over checkpoints that exist)."""
    candidates = [directory / "last.pt", *sorted(directory.glob("step-*.pt"), reverse=True)]
    bad, tried = [], set()
    for path in (c for c in candidates if c.exists()):
        # last.pt is another name of a step's checkpoint (a hard or a symbolic link): one
        # checkpoint, skipped once.
        same = (path.stat().st_dev, path.stat().st_ino)
        if same in tried:
            continue
        tried.add(same)
        if not io.is_checkpoint(path):  # (a step directory that lost its index)
            log.warning("resume: skipping %s: a directory without DCP's index (%s): not a "
                        "whole checkpoint", path, sharded.INDEX)
            bad.append(f"{path.name}: no index")
            continue
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


def repair_names(directory: Path, path: Path, state: dict[str, Any]) -> None:
    """Give the checkpoint a run resumes from the names a crash kept it from getting:
    `last.pt`, and `best.pt` when it records that it was the best."""
    if path.resolve().parent != directory.resolve():
        return  # resume=PATH of another run: its names are not ours to change
    wanted = [directory / "last.pt"] + ([directory / "best.pt"] if state.get("is_best") else [])
    for name in wanted:
        if not (name.exists() and os.path.samefile(name, path)):
            io.link(path, name)
            log.warning("resume: %s now names the checkpoint of step %s (a crash had kept "
                        "it from that name)", name.name, (state.get("loop") or {}).get("step"))
