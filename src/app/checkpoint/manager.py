"""The checkpoints of one training run: saving its state (as a file, or sharded under
`distributed.strategy=fsdp`) through the background writers, and restoring a run from one
(resume, or weights only for a new schedule). The layout and its checks are
app.checkpoint.layout's; loading into the model and optimizer app.checkpoint.restore's."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as tdist
from omegaconf import OmegaConf

from app import dist
from app.checkpoint import io, sharded
from app.checkpoint.layout import FORMAT_VERSION, LOOP_COUNTERS, latest_valid, load, repair_names
from app.checkpoint.restore import check_same_optimizer, load_model_weights, load_optimizer_state
from app.checkpoint.rng import rng_state, set_rng_state
from app.checkpoint.writer import CheckpointWriter
from app.errors import UserError

if TYPE_CHECKING:
    from app.config import AppConfig
    from app.data import DataModule
    from app.training.hooks import Callbacks
    from app.training.state import LoopState
    from app.training.step import TrainStep

log = logging.getLogger(__name__)

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
        self.writer: CheckpointWriter | sharded.ShardedWriter  # (both BackgroundWrites)
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
        if dist.is_main() and self.cfg.resume == "auto":  # (a checkpoint named by hand: as is)
            repair_names(self.directory, path, state)
        self.resumed_from = path

    def _load_shards(self, path: Path, state: dict[str, Any]) -> None:
        """Each rank reads its own part of a sharded checkpoint's tensors (DCP reshards one
        written by another number of ranks); the EMA's, when both keep one."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import (
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        step = self.train_step
        check_same_optimizer(state, path, self.cfg.optimizer)
        tensors = {"model": step.model.state_dict(),
                   "optimizer": get_optimizer_state_dict(step.model, step.optimizer)}
        if step.ema is not None and (state.get("train_step") or {}).get("ema"):
            tensors["ema"] = step.ema.module.state_dict()
        try:
            dcp.load(tensors, checkpoint_id=path)
        except (Exception, CheckpointException) as e:  # (the index and shards were checked)
            raise UserError(f"checkpoint {path} does not fit this run's model and optimizer "
                            f"({sharded.dcp_error(e)}); resume with the settings it was "
                            f"trained with") from e
        step.model.load_state_dict(tensors["model"])
        set_optimizer_state_dict(step.model, step.optimizer, tensors["optimizer"])
        if "ema" in tensors:  # (its entry in `state` has an empty module: the count is read)
            step.ema.module.load_state_dict(tensors["ema"])

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
