"""The checkpoint's layout, in one place: its keys, its format version, the check of a loaded
file's structure, saving a training run's state and every kind of restore (resume, fine-tune
from weights, inference weights). Nothing else in app spells out a checkpoint's keys; file I/O
(`io`: atomic writes, links, pruning) and the background writer (`writer`) sit below.

One file holds a plain dict:

    format        FORMAT_VERSION (a file without it has the layout of version 1)
    model         the unwrapped model's state dict
    optimizer, scheduler          their state dicts
    train_step    {scaler, ema: {module, updates} or None, skipped}
    loop          {step, epoch, batch (in the epoch), stopped_early}
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
strategy: a sharded model resumes a sharded checkpoint shard by shard (`_load_shards`, on any
number of ranks), everything else reads it whole (`sharded.read_full`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as tdist
from omegaconf import OmegaConf

from app import dist
from app.checkpoint import io, sharded
from app.checkpoint.rng import rng_state, set_rng_state
from app.checkpoint.writer import CheckpointWriter
from app.errors import UserError

if TYPE_CHECKING:
    from app.callbacks import Callbacks
    from app.config import AppConfig
    from app.data import DataModule
    from app.training.state import LoopState
    from app.training.step import TrainStep

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # raise it when the layout changes, and read the older ones too

# What a resume reads besides the weights, and the type each entry must have.
RESUME_ENTRIES = {"optimizer": dict, "scheduler": dict, "loop": dict, "rng": list,
                  "best": (float, int, type(None))}
LOOP_COUNTERS = ("step", "epoch", "batch")


class TrainedAt(NamedTuple):
    """Where in its training a checkpoint was written (0, 0 for a weights-only file)."""

    step: int
    epoch: int


# ---- reading and checking a file -------------------------------------------------------------

def load(path: str | Path, resume: bool = False, tensors: bool = True) -> dict[str, Any]:
    """Read a checkpoint, a file or a sharded directory, and check its structure (`check`): a
    user-facing error if it is not one, or (with `resume`) not one a run can resume from.
    `tensors=False`: a sharded checkpoint's tensors are left on disk (its model, optimizer
    and EMA entries are empty here; a sharded model reads its own shards, `_load_shards`)."""
    path = Path(path)
    if not sharded.is_sharded(path):
        state = io.read(path)
    elif tensors:
        state = sharded.read_full(path)
    else:
        state = sharded.read_meta(path)
        state["model"], state["optimizer"] = {}, {}
        ema = (state.get("train_step") or {}).get("ema")
        if isinstance(ema, dict):
            state["train_step"]["ema"] = {**ema, "module": {}}
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


def check(state: Any, path: Path, resume: bool = False) -> None:
    """The structure every reader relies on: a format this app reads, weights that are
    tensors (the EMA's too), a loop record of counters, a config of dicts; with `resume`,
    everything a resume reads. No reader then meets a KeyError or a TypeError."""
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
        for key in LOOP_COUNTERS if resume else ("step", "epoch"):
            if not isinstance(loop.get(key) if isinstance(loop, dict) else None, int):
                raise UserError(
                    f"checkpoint {path}: 'loop' has no {key!r} count"
                    + (f" ({key}={loop[key]!r})" if isinstance(loop, dict) and key in loop
                       else "") + ": a damaged checkpoint")


def trained_at(state: dict[str, Any]) -> TrainedAt:
    loop = state.get("loop") or {}  # a weights-only file (no loop record) has none
    return TrainedAt(loop.get("step", 0), loop.get("epoch", 0))


def inference_weights(state: dict[str, Any]) -> dict[str, Any]:
    """The weights validation used: the EMA's when the run kept one (so eval matches)."""
    ema = (state.get("train_step") or {}).get("ema")
    return ema["module"] if ema else state["model"]


# ---- restoring ------------------------------------------------------------------------------

def load_for_inference(model: torch.nn.Module, data: DataModule, path: str | Path
                       ) -> TrainedAt:
    """Give `model` the weights of the checkpoint at `path` that validation used (the EMA's
    when the run kept one), and `data` what it learnt in that training (so inputs are seen as
    training saw them); returns where in its training the checkpoint was written."""
    state = load(path)
    data.load_state_dict(state.get("data") or {})  # first: other classes are named as such
    data.prepare()  # (what a checkpoint without the data's state leaves to learn)
    load_model_weights(model, state, path, weights=inference_weights(state))
    return trained_at(state)


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
        sharded.load_full_weights(model, fitting, strict=False)
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
    sharded.load_full_weights(model, theirs)


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         state: dict[str, Any], path: str | Path, current: dict[str, Any]
                         ) -> None:
    """Resume the optimizer; a checkpoint of another optimizer is an error naming both."""
    trained = (state.get("config") or {}).get("optimizer") or {}
    if trained.get("_target_", current.get("_target_")) != current.get("_target_"):
        raise UserError(
            f"checkpoint {path} was trained with optimizer {trained.get('_target_')}, this run "
            f"has {current.get('_target_')}: resume with the same optimizer, or start a new "
            f"schedule from its weights with ckpt={path} resume=null")
    try:
        sharded.load_full_optimizer(model, optimizer, state["optimizer"])
    except (ValueError, KeyError, RuntimeError) as e:
        raise UserError(
            f"checkpoint {path}: its optimizer state does not fit this run's optimizer ({e}). "
            f"It was trained with optimizer={trained}, this run has optimizer={dict(current)}; "
            f"resume with the same settings, or start a new schedule from its weights with "
            f"ckpt={path} resume=null") from e


def latest_valid(directory: Path, tensors: bool = True
                 ) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of a run directory that loads: last.pt, else the periodic ones,
    newest first; each that does not load is named in a warning. None when there is no
    checkpoint at all; an error when there are some and none loads (a run is never silently
    started afresh over checkpoints that exist). `tensors`: as for `load`."""
    candidates = [directory / "last.pt", *sorted(directory.glob("step-*.pt"), reverse=True)]
    bad = []
    for path in (c for c in candidates if io.is_checkpoint(c)):
        try:
            return path, load(path, resume=True, tensors=tensors)
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
    `last.pt` (when it was not under that name) and `best.pt` (when it records that it was
    the best: a crash between the `last.pt` and `best.pt` links left the older best)."""
    if path.resolve().parent != directory.resolve():
        return  # resume=PATH of another run: its names are not ours to change
    wanted = [directory / "last.pt"] + ([directory / "best.pt"] if state.get("is_best") else [])
    for name in wanted:
        if not (name.exists() and os.path.samefile(name, path)):
            io.link(path, name)
            log.warning("resume: %s now names the checkpoint of step %s (a crash had kept "
                        "it from that name)", name.name, (state.get("loop") or {}).get("step"))


# ---- a training run's checkpoints ------------------------------------------------------------

def _changed_only_by_step(train_step: TrainStep) -> list[torch.Tensor]:
    """The tensors that nothing but the optimizer step (and the EMA update after it) changes:
    the weights, the optimizer's state, the EMA weights. Not buffers: a forward changes them."""
    tensors = list(train_step.model.parameters())
    tensors += [v for s in train_step.optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor)]
    if train_step.ema is not None:
        tensors += list(train_step.ema.module.state_dict().values())
    return tensors


class CheckpointManager:
    """The checkpoints of one training run in `directory`: what they hold (the train step's
    model, optimizer, scheduler, scaler and EMA; the loop state; the callbacks' and the data's
    states), saving
    them through the background writer, and restoring a run from one (`restore`)."""

    def __init__(self, directory: Path, cfg: AppConfig, train_step: TrainStep,
                 loop: LoopState, callbacks: Callbacks, data: DataModule) -> None:
        self.directory, self.cfg = directory, cfg
        self.train_step, self.loop, self.callbacks = train_step, loop, callbacks
        self.data = data
        # Sharded checkpoints under fsdp (even on one rank: any number of ranks resumes them).
        self.sharded = cfg.distributed.strategy == "fsdp"
        self.sharded_model = sharded.model_is_sharded(train_step.model)
        self.writer: CheckpointWriter | sharded.ShardedWriter
        if self.sharded:
            # DCP's collectives on a group of their own: a background save's must not
            # interleave with the training's on the default group.
            group = tdist.new_group(backend="gloo") if dist.world_size() > 1 else None
            self.writer = sharded.ShardedWriter(cfg.trainer.async_checkpoint, dist.is_main(),
                                                group)
        else:
            self.writer = CheckpointWriter(background=cfg.trainer.async_checkpoint)
        # The writer copies weights, optimizer state and EMA while the next forward and
        # backward run; the update that changes them waits for that copy.
        train_step.before_update = self.writer.hold_until_copied
        self.param_names = sharded.param_names(train_step.model, train_step.optimizer)
        self.resumed_from: Path | None = None
        # The trackers' run ids (MLflow ...): saved with each checkpoint, so that a resumed
        # run, in any directory, continues the same tracker runs.
        self.trackers: dict[str, str] = {}
        self._config = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)

    def restore(self) -> None:
        """Resume (everything, exactly: `resume=`), or load weights only for a new schedule
        (`ckpt=`), or nothing (a fresh start)."""
        cfg = self.cfg
        io.check_layout(self.directory)  # before training, not at its first save
        if dist.is_main():
            io.remove_stale(self.directory)  # before any save: a killed run's partial ones
        tensors = not self.sharded_model  # (a sharded model reads its shards, `_load_shards`)
        if cfg.resume == "auto":
            path, state = latest_valid(self.directory, tensors) or (None, None)
        elif cfg.resume is not None:
            path, state = Path(cfg.resume), load(cfg.resume, resume=True, tensors=tensors)
        else:
            path, state = None, None
        if path is not None:
            self._resume(path, state)
        elif cfg.ckpt is not None:
            self._fine_tune(cfg.ckpt)

    def _warn_if_the_schedule_changed(self, state: dict[str, Any]) -> None:
        """A resume continues the saved learning-rate schedule, made for the saved length: a
        longer run trains its extra steps at the schedule's end (0 for cosine)."""
        saved = (state.get("config") or {}).get("trainer") or {}
        now = self.cfg.trainer
        changed = [f"trainer.{k}={getattr(now, k)} (saved: {saved[k]})"
                   for k in ("max_epochs", "max_steps")
                   if k in saved and saved[k] != getattr(now, k)]
        if changed:
            log.warning("resumed with %s: the learning-rate schedule goes on as it was saved, "
                        "for the old length; to train further on a new schedule, start from "
                        "this run's weights with run=RUN_DIR (docs/runs.md)", ", ".join(changed))

    def _resume(self, path: Path, state: dict[str, Any]) -> None:
        step = self.train_step
        if self.sharded_model and sharded.is_sharded(path):
            self._load_shards(path, state)
        else:
            if self.sharded_model:  # (read with tensors=False: a file is read whole)
                state = load(path, resume=True)
            load_model_weights(step.model, state, path)
            load_optimizer_state(step.model, step.optimizer, state, path, self.cfg.optimizer)
        step.scheduler.load_state_dict(state["scheduler"])
        step.load_state_dict(state.get("train_step", {}))
        self.loop.load_state_dict({**state["loop"], "best": state["best"]})
        self.callbacks.load_state_dict(state.get("callbacks", {}))
        self.data.load_state_dict(state.get("data") or {})
        trackers = state.get("trackers")
        if isinstance(trackers, dict):
            self.trackers.update({str(k): str(v) for k, v in trackers.items()})
        rank, world_size = dist.rank(), dist.world_size()
        if len(state["rng"]) == world_size:
            set_rng_state(state["rng"][rank])
        else:
            log.warning("checkpoint has random states of %d ranks, this run has %d: the run "
                        "continues, but not bit-identically", len(state["rng"]), world_size)
        log.info("resumed from %s at step %d (epoch %d)", path, self.loop.step, self.loop.epoch)
        self._warn_if_the_schedule_changed(state)
        if dist.is_main():
            repair_names(self.directory, path, state)
        self.resumed_from = path

    def _load_shards(self, path: Path, state: dict[str, Any]) -> None:
        """Each rank reads its own part of a sharded checkpoint's tensors (DCP reshards one
        written by another number of ranks); the EMA's, when both keep one."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        step = self.train_step
        self._check_optimizer(state, path)
        tensors = {"model": step.model.state_dict(),
                   "optimizer": get_optimizer_state_dict(step.model, step.optimizer)}
        if step.ema is not None and (state.get("train_step") or {}).get("ema"):
            tensors["ema"] = step.ema.module.state_dict()
        try:
            dcp.load(tensors, checkpoint_id=path)
        except Exception as e:  # (DCP wraps each rank's error: its first line names it)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"checkpoint {path} does not fit this run's model and optimizer "
                            f"({first}); resume with the settings it was trained with") from e
        step.model.load_state_dict(tensors["model"])
        set_optimizer_state_dict(step.model, step.optimizer, tensors["optimizer"])
        if "ema" in tensors:  # (its entry in `state` has an empty module: the count is read)
            step.ema.module.load_state_dict(tensors["ema"])

    def _check_optimizer(self, state: dict[str, Any], path: Path) -> None:
        trained = ((state.get("config") or {}).get("optimizer") or {}).get("_target_")
        current = self.cfg.optimizer.get("_target_")
        if trained not in (None, current):
            raise UserError(
                f"checkpoint {path} was trained with optimizer {trained}, this run has "
                f"{current}: resume with the same optimizer, or start a new schedule from its "
                f"weights with ckpt={path} resume=null")

    def _fine_tune(self, path: str) -> None:
        step = self.train_step
        load_model_weights(step.model, load(path), path, strict=self.cfg.ckpt_strict,
                           fine_tuning=True)
        if step.ema is not None:
            step.ema.module.load_state_dict(step.model.state_dict())
        log.info("loaded weights from %s; training starts a new schedule", path)

    def save(self, val_metrics: dict[str, float] | None, is_best: bool, last: bool) -> None:
        """Every rank calls it (the random states are gathered); rank 0 writes. The `last`
        save of a run is waited for."""
        rng = dist.all_gather_object(rng_state())  # every rank's, for an exact resume
        if self.sharded or dist.is_main():  # (every rank writes its shards)
            self._write(rng, val_metrics, is_best)
        if last:
            self.writer.wait()
            # No rank exits while rank 0 still writes: under SLURM a task that exits early gets
            # its peers killed, rank 0 and its half-written file included.
            dist.barrier()

    def _write(self, rng: list, val_metrics: dict[str, float] | None, is_best: bool) -> None:
        step, loop = self.train_step, self.loop.state_dict()
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            optimizer = get_optimizer_state_dict(step.model, step.optimizer)  # (by name)
        else:
            optimizer = step.optimizer.state_dict()
        state = {
            "format": FORMAT_VERSION,
            "model": step.model.state_dict(),
            "optimizer": optimizer,
            "scheduler": step.scheduler.state_dict(),
            "train_step": step.state_dict(),
            "loop": {k: loop[k] for k in (*LOOP_COUNTERS, "stopped_early")},
            "callbacks": self.callbacks.state_dict(),
            "data": self.data.state_dict(),
            "best": loop["best"],
            "is_best": is_best,  # what `repair_names` gives best.pt after a crash
            "metrics": val_metrics or {},
            "rng": rng,
            "config": self._config,
            "trackers": dict(self.trackers),
            "param_names": self.param_names,
        }
        path = self.directory / io.periodic_name(self.loop.step)

        def name_and_prune() -> None:
            # last.pt first: a crash before best.pt leaves a last.pt that records it was the
            # best, and the resume names it (the other order could leave a best.pt from a
            # step that the resume trains again, differently).
            io.link(path, self.directory / "last.pt")
            if is_best:
                io.link(path, self.directory / "best.pt")
            io.prune(self.directory, self.cfg.trainer.keep_last)

        if self.sharded:
            tensors, meta = sharded.split(state)
            blocked = self.writer.save(tensors, meta if dist.is_main() else None, path,
                                       then=name_and_prune)
        else:
            blocked = self.writer.save(state, path, then=name_and_prune,
                                       changed_only_by_step=_changed_only_by_step(step))
        log.debug("checkpoint %s: the loop waited %.3f s", path.name, blocked)

    def log_totals(self) -> None:
        if self.writer.saves:
            log.info("%d checkpoint(s) %s; the loop waited %.3f s for them in all",
                     self.writer.saves,
                     "written in the background" if self.writer.background else "written",
                     self.writer.waited_s)
