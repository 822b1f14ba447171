"""The checkpoints of one training run: saving its state (as a file, or sharded under
`distributed.strategy=fsdp`) and restoring a run from one (resume, or weights only).

The manager holds the run's parts by name, as torchtitan's CheckpointManager does: each is
torch's `Stateful`, and its state is the checkpoint's entry of that name (app.checkpoint.layout).
The training side builds the mapping; the manager knows the names, not what the parts are."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as tdist
from omegaconf import OmegaConf

from app import dist
from app.checkpoint import io, layout, restore, sharded
from app.checkpoint.writer import CheckpointWriter
from app.errors import UserError, one_line

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

    from app.config import AppConfig

log = logging.getLogger(__name__)


class CheckpointManager:
    """The checkpoints of one training run in `directory`, of the parts in `states` (loaded
    in their order; "model" and "optimizer" among them). `changed_only_by_step`: the tensors
    that nothing but the optimizer step changes, which the background writer copies while the
    next step's forward and backward run (the step waits for it first: `hold_until_copied`)."""

    def __init__(self, directory: Path, cfg: AppConfig, states: dict[str, Stateful],
                 changed_only_by_step: Callable[[], Iterable[torch.Tensor]] = tuple) -> None:
        self.directory, self.cfg, self.states = directory, cfg, states
        self.changed_only_by_step = changed_only_by_step
        # Sharded checkpoints under fsdp (even on one rank: any number of ranks resumes them).
        self.sharded = cfg.distributed.strategy == "fsdp"
        self.writer: CheckpointWriter | sharded.ShardedWriter  # (both BackgroundWrites)
        if self.sharded:
            # DCP's collectives on a group of their own: a background save's must not
            # interleave with the training's on the default group.
            group = tdist.new_group(backend="gloo") if dist.world_size() > 1 else None
            self.writer = sharded.ShardedWriter(cfg.trainer.async_checkpoint, dist.is_main(),
                                                group)
        else:
            self.writer = CheckpointWriter(background=cfg.trainer.async_checkpoint)
        self.hold_until_copied = self.writer.hold_until_copied
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
        if dist.is_main():  # before any save: what a killed write left under a temporary name
            for stale in self.directory.glob(".*.tmp"):
                io.remove(stale)
        found = None
        if cfg.resume == "auto":
            found = layout.latest_valid(self.directory)
        elif cfg.resume is not None:
            found = Path(cfg.resume), layout.load(cfg.resume, resume=True)
        if found is not None:
            self._resume(*found)
        elif cfg.ckpt is not None:
            restore.load_model_weights(self.states["model"], layout.load(cfg.ckpt), cfg.ckpt,
                                       strict=cfg.ckpt_strict, fine_tuning=True)
            self.states["train_step"].load_state_dict({})  # (its EMA starts from the weights)
            log.info("loaded weights from %s; training starts a new schedule", cfg.ckpt)

    def _resume(self, path: Path, state: dict[str, Any]) -> None:
        trained = ((state.get("config") or {}).get("optimizer") or {}).get("_target_")
        if trained not in (None, self.cfg.optimizer.get("_target_")):
            raise UserError(f"checkpoint {path} was trained with optimizer {trained}, this run has "
                            f"{self.cfg.optimizer.get('_target_')}: resume with the same "
                            f"optimizer, or start a new schedule from its weights with "
                            f"ckpt={path} resume=null")
        if sharded.is_sharded(path):
            state = self._read_shards(path, state)
        restore.fitting(self.states["model"].state_dict(), state["model"], state, path)
        for name, part in self.states.items():
            try:
                part.load_state_dict(layout.part(state, name))
            except (ValueError, KeyError, RuntimeError) as e:
                trained, now = (state.get("config") or {}).get(name), self._config.get(name)
                raise UserError(
                    f"checkpoint {path}: its {name} state does not fit this run ({one_line(e)})"
                    + (f". It was trained with {name}={trained}, this run has {name}={now}"
                       if trained != now else "") + f"; resume with the same settings, or "
                    f"start a new schedule from its weights with ckpt={path} resume=null") from e
        trackers = state.get("trackers")
        if isinstance(trackers, dict):
            self.trackers.update({str(k): str(v) for k, v in trackers.items()})
        loop = state["loop"]
        log.info("resumed from %s at step %d (epoch %d)", path, loop["step"], loop["epoch"])
        # A resume continues the saved learning-rate schedule, made for the saved length: a
        # longer run trains its extra steps at the schedule's end (0 for cosine).
        saved = (state.get("config") or {}).get("trainer") or {}
        changed = [f"trainer.{k}={getattr(self.cfg.trainer, k)} (saved: {saved[k]})"
                   for k in ("max_epochs", "max_steps")
                   if k in saved and saved[k] != getattr(self.cfg.trainer, k)]
        if changed:
            log.warning("resumed with %s: the learning-rate schedule goes on as it was saved, "
                        "for the old length; to train further on a new schedule, start from "
                        "this run's weights with run=RUN_DIR (docs/runs.md)", ", ".join(changed))
        if dist.is_main() and self.cfg.resume == "auto":  # (a checkpoint named by hand: as is)
            layout.repair_names(self.directory, path, state)
        self.resumed_from = path

    def _read_shards(self, path: Path, state: dict[str, Any]) -> dict[str, Any]:
        """`state` with this rank's part of a sharded checkpoint's tensors, read into the run's
        own (DCP reshards one written by another number of ranks)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        live, _ = sharded.split({name: self.states[name].state_dict()
                                 for name in ("model", "optimizer", "train_step")
                                 if name in self.states})
        in_it = sharded.tensor_groups(path)
        tensors = {group: live[group] for group in live if group in in_it}
        try:
            dcp.load(tensors, checkpoint_id=path)
        except (Exception, CheckpointException) as e:  # (the index and shards were checked)
            raise UserError(f"checkpoint {path} does not fit this run's model and optimizer "
                            f"({sharded.dcp_error(e)}); resume with the settings it was "
                            f"trained with") from e
        return sharded.join(state, tensors)

    def save(self, val_metrics: dict[str, float] | None, is_best: bool, last: bool) -> None:
        """Every rank calls it; rank 0 writes, or under fsdp every rank its shards. The `last`
        save of a run is waited for."""
        state = {"format": layout.FORMAT_VERSION, **layout.entries(
            {name: part.state_dict() for name, part in self.states.items()}, not self.sharded),
            "is_best": is_best,  # what `repair_names` gives best.pt after a crash
            "metrics": val_metrics or {}, "config": self._config, "trackers": dict(self.trackers)}
        if self.sharded or dist.is_main():  # (every rank writes its shards)
            self._write(state, state["loop"]["step"], is_best)
        if last:
            self.writer.wait()
            # No rank exits while rank 0 still writes: under SLURM a task that exits early gets
            # its peers killed, rank 0 and its half-written file included.
            dist.barrier()

    def _write(self, state: dict[str, Any], step: int, is_best: bool) -> None:
        path = self.directory / io.periodic_name(step)

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
                                       changed_only_by_step=self.changed_only_by_step())
        log.debug("checkpoint %s: the loop waited %.3f s", path.name, blocked)

    def log_totals(self) -> None:
        if self.writer.saves:
            log.info("%d checkpoint(s) %s; the loop waited %.3f s for them in all",
                     self.writer.saves,
                     "written in the background" if self.writer.background else "written",
                     self.writer.waited_s)
