"""Sharded checkpoints (`distributed.strategy=fsdp`): one directory per checkpoint, written by
every rank at once with torch.distributed.checkpoint (DCP), each rank its own shards.

    step-00000100.pt/      a checkpoint (a directory under the name a file would have, as
        .metadata          Lightning names its sharded checkpoints): DCP's index, written last
        __R_0.distcp       rank R's shards of the tensors: model, optimizer, ema
        meta.pt            everything else of the single-file layout (app.checkpoint.manager),
                           plain values, written by rank 0
    last.pt, best.pt       symbolic links to a step directory
    .step-00000100.pt.tmp/ a checkpoint being written: never read, removed by pruning

A checkpoint is written under its temporary name and renamed once every rank's shards, the
index and meta.pt are on disk (each file fsynced), so a kill at any moment leaves no
half-written checkpoint under a name a resume reads. The tensors are stored by name and
global shape, not by rank: a checkpoint of N ranks loads on M ranks (DCP reshards), and on a
single process as full tensors (`read_full`: evaluation, export, conversion).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app import progress
from app.checkpoint import io
from app.errors import AppError, UserError
from app.files import sync_dir

log = logging.getLogger(__name__)

META = "meta.pt"
INDEX = ".metadata"


def is_sharded(path: str | Path) -> bool:
    """Whether `path` (or what a link of that name points to) is a sharded checkpoint."""
    return (Path(path) / INDEX).is_file()


def temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


# ---- writing ---------------------------------------------------------------------------------

class ShardedWriter:
    """Sharded saves, in the background when asked (DCP's `async_save`: the tensors are
    copied to host memory before it returns, then written by a thread while training goes
    on); the interface of app.checkpoint.writer.CheckpointWriter. One save is in flight at a
    time; rank 0 renames a finished checkpoint into place and calls `then` (links, pruning)."""

    def __init__(self, background: bool, is_main: bool, group: Any = None) -> None:
        self.background, self.is_main, self.group = background, is_main, group
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.saves = 0
        self.waited_s = 0.0

    def save(self, tensors: dict[str, Any], meta: dict[str, Any] | None, path: Path,
             then: Callable[[], None]) -> float:
        """Every rank calls it with its shards; `meta` (rank 0's) and `then` are rank 0's."""
        import torch.distributed.checkpoint as dcp

        start = time.perf_counter()
        progress.tick()
        self.saves += 1
        self.wait()
        tmp = temporary(path)
        with warnings.catch_warnings():
            # (One process without a process group, a run on one rank or `app.ckpt convert`:
            # DCP saves alone, as asked, and warns that it assumes so.)
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            if not self.background:
                with progress.busy():
                    dcp.save(tensors, checkpoint_id=tmp, process_group=self.group)
            else:
                future = dcp.async_save(tensors, checkpoint_id=tmp, process_group=self.group)
        if not self.background:
            with progress.busy():
                self._finish(meta, tmp, path, then)
        else:
            self._thread = threading.Thread(target=self._background, name="app-dcp-writer",
                                            args=(future, meta, tmp, path, then))
            self._thread.start()
        self.waited_s += time.perf_counter() - start
        return time.perf_counter() - start

    def _background(self, future: Any, meta: dict[str, Any] | None, tmp: Path, path: Path,
                    then: Callable[[], None]) -> None:
        try:
            with progress.busy():
                future.result()  # every rank's shards and the index are written
                self._finish(meta, tmp, path, then)
            progress.tick()
        except BaseException as e:  # raised in the loop's thread at its next save or wait
            self._error = e

    def _finish(self, meta: dict[str, Any] | None, tmp: Path, path: Path,
                then: Callable[[], None]) -> None:
        if not self.is_main:
            return
        try:
            io.save(meta, tmp / META)
            sync_dir(tmp)
            if path.exists():  # (the same step written again: the new one replaces it)
                old = path.with_name(f".{path.name}.old.tmp")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(path, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, path)
            sync_dir(path.parent)
        except OSError as e:
            raise AppError(f"checkpoint {path} could not be written ({e.strerror or e}); the "
                           f"checkpoints already on disk are intact") from e
        then()

    def hold_until_copied(self) -> None:
        """(DCP copies the tensors before `async_save` returns: nothing to wait for.)"""

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


# ---- reading ---------------------------------------------------------------------------------

def read_meta(path: Path) -> dict[str, Any]:
    """meta.pt of a sharded checkpoint, after checking that DCP's index reads and names only
    files that are there (a checkpoint whose shards were lost is not one to resume from)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:
        raise UserError(f"checkpoint {path}: its index ({INDEX}) does not read ({e})") from e
    files = {item.relative_path for item in (metadata.storage_data or {}).values()}
    missing = sorted(f for f in files if not (path / f).is_file())
    if missing:
        raise UserError(f"checkpoint {path}: shard files missing: {', '.join(missing)}")
    if not (path / META).is_file():
        raise UserError(f"checkpoint {path}: no {META}: an incomplete sharded checkpoint")
    meta = io.read(path / META)
    if not isinstance(meta, dict):
        raise UserError(f"checkpoint {path}: {META} is not a dict: a damaged checkpoint")
    return meta


def read_tensors(path: Path) -> dict[str, Any]:
    """Every tensor of a sharded checkpoint, whole, in this process (no process group)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    tensors: dict[str, Any] = {}
    try:
        # What DCP's own dcp_to_torch_save does: the planner builds the state dict from the
        # index; no_dist: read by this process alone, whatever the processes around it do.
        _load_state_dict(tensors, storage_reader=FileSystemReader(str(path)),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"checkpoint {path}: its shards do not read ({first})") from e
    return tensors


def optimizer_by_ids(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter names (DCP's) in the layout
    `Optimizer.state_dict()` has: parameters numbered in the order of the groups."""
    names = [name for group in state["param_groups"] for name in group["params"]]
    number = {name: i for i, name in enumerate(names)}
    return {"state": {number[n]: s for n, s in state["state"].items()},
            "param_groups": [{**g, "params": [number[n] for n in g["params"]]}
                             for g in state["param_groups"]]}


def optimizer_by_names(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The other way: `names`, the parameters' names in the optimizer's order."""
    return {"state": {names[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                             for g in state["param_groups"]]}


def read_full(path: Path) -> dict[str, Any]:
    """A sharded checkpoint in the single-file layout, its tensors whole."""
    meta = read_meta(path)
    tensors = read_tensors(path)
    state = dict(meta)
    state["model"] = tensors.get("model", {})
    if "optimizer" in tensors:
        state["optimizer"] = optimizer_by_ids(tensors["optimizer"])
    train_step = dict(meta.get("train_step") or {})
    if train_step.get("ema") is not None and "ema" in tensors:
        train_step["ema"] = {**train_step["ema"], "module": tensors["ema"]}
    state["train_step"] = train_step
    return state


def split(state: dict[str, Any], param_names: list[str] | None = None) -> tuple[dict, dict]:
    """A state of the single-file layout in the sharded one: (tensors, meta). Its optimizer
    state is keyed by name already, or numbered and named by `param_names`."""
    meta = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
    tensors: dict[str, Any] = {"model": state["model"]}
    if "optimizer" in state:
        tensors["optimizer"] = state["optimizer"] if param_names is None else \
            optimizer_by_names(state["optimizer"], param_names)
    train_step = dict(state.get("train_step") or {})
    if train_step.get("ema"):
        tensors["ema"] = train_step["ema"]["module"]
        train_step["ema"] = {k: v for k, v in train_step["ema"].items() if k != "module"}
    meta["train_step"] = train_step
    return tensors, meta


# ---- models, sharded by FSDP2 or not ---------------------------------------------------------

def model_is_sharded(model: nn.Module) -> bool:
    """Whether `model` is sharded by FSDP2 (its parameters are DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def load_full_weights(module: nn.Module, weights: dict[str, Any], strict: bool = True) -> None:
    """Whole tensors (a single-file checkpoint's) into `module`, sharded or not."""
    if not model_is_sharded(module):
        module.load_state_dict(weights, strict=strict)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, weights,
                         options=StateDictOptions(full_state_dict=True, strict=strict))


def param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the optimizer's parameters, in its order (that of its state's numbers)."""
    names = {p: n for n, p in model.named_parameters()}
    return [names[p] for group in optimizer.param_groups for p in group["params"]]


def load_full_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer,
                        state: dict[str, Any]) -> None:
    """A whole optimizer state (`Optimizer.state_dict()`'s numbered layout) into `optimizer`,
    over `model` sharded or not."""
    if not model_is_sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer,
                             optimizer_by_names(state, param_names(model, optimizer)),
                             options=StateDictOptions(full_state_dict=True))
