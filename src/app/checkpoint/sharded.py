"""Sharded checkpoints (`distributed.strategy=fsdp`): one directory per checkpoint, written by
every rank at once with torch.distributed.checkpoint (DCP), each rank its own shards.

    step-00000100.pt/      a checkpoint (a directory under the name a file would have, as
        .metadata          Lightning names its sharded checkpoints): DCP's index, written last
        __R_0.distcp       rank R's shards of the tensors: model, optimizer, ema
        meta.pt            everything else of the single-file layout (app.checkpoint.layout),
                           plain values, written by rank 0
        checksums.rankR.json   the checksums of rank R's shard files, written by rank R
        checksums.json     the checksums of the index and meta.pt, written by rank 0
    last.pt, best.pt       symbolic links to a step directory
    .step-00000100.pt.tmp/ a checkpoint being written: never read, removed by pruning

A checkpoint is written under its temporary name and renamed once every rank's shards, the
index and meta.pt are on disk (each file fsynced), so a kill at any moment leaves no
half-written checkpoint under a name a resume reads. The tensors are stored by name and
global shape, not by rank: a checkpoint of N ranks loads on M ranks (DCP reshards), and on a
single process as full tensors (`read_full`: evaluation, export, conversion).

Every reader compares the files with their checksums before it reads them: DCP checks
nothing, and a shard with bytes changed on disk either fails to unpickle (which looks like a
checkpoint of another model) or loads garbage weights without a word. A checkpoint written
before checksums (none in its directory) is read unchecked.
"""

from __future__ import annotations

import enum
import importlib
import pickle
import shutil
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app import progress
from app.checkpoint import io
from app.checkpoint.checksums import CHECKSUMS, verify, write_checksums
from app.checkpoint.writer import BackgroundWrites
from app.errors import UserError, one_line
from app.files import sync_dir

# DCP warns at each save of one process without a process group (a run on one rank, `app.ckpt
# convert`) that it assumes it saves alone, as it does; also from async_save's thread.
warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")

META = "meta.pt"
INDEX = ".metadata"


def is_sharded(path: str | Path) -> bool:
    """Whether `path` (or what a link of that name points to) is a sharded checkpoint."""
    return (Path(path) / INDEX).is_file()


# ---- writing ---------------------------------------------------------------------------------

class ShardedWriter(BackgroundWrites):
    """Sharded saves, in the background when asked (DCP's `async_save`: the tensors are
    copied to host memory before it returns, then written by a thread while training goes
    on); the interface of app.checkpoint.writer.CheckpointWriter. One save is in flight at a
    time; rank 0 renames a finished checkpoint into place and calls `then` (links, pruning)."""

    def __init__(self, background: bool, is_main: bool, group: Any = None) -> None:
        super().__init__(background)
        self.is_main, self.group = is_main, group

    def save(self, tensors: dict[str, Any], meta: dict[str, Any] | None, path: Path,
             then: Callable[[], None]) -> float:
        """Every rank calls it with its shards; `meta` (rank 0's) and `then` are rank 0's."""
        import torch.distributed.checkpoint as dcp

        start = self._begin()
        tmp = path.with_name(f".{path.name}.tmp")
        args = dict(storage_writer=_checksummed_writer(tmp), process_group=self.group)
        shards = (dcp.async_save(tensors, **args).result if self.background else
                  partial(dcp.save, tensors, **args))
        return self._run(lambda: self._write(shards, meta, tmp, path, then), "app-dcp-writer",
                         start)

    def _write(self, shards: Callable[[], Any], meta: dict[str, Any] | None, tmp: Path,
               path: Path, then: Callable[[], None]) -> None:
        from torch.distributed.checkpoint.api import CheckpointException

        with progress.busy():
            try:
                shards()  # every rank's shards and the index are written
            except (Exception, CheckpointException) as e:
                # (Every rank gets a rank's error from DCP's last collective, so none writes
                # into `tmp` any more: rank 0 removes it.)
                if self.is_main:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise io.not_written(path, dcp_error(e)) from e
            if not self.is_main:
                return
            try:
                io.save(meta, tmp / META)
                write_checksums(tmp, [INDEX, META], CHECKSUMS)
                sync_dir(tmp)
                io.put(tmp, path)  # (over the same step written before, a file or a directory)
            except BaseException as e:
                shutil.rmtree(tmp, ignore_errors=True)
                if isinstance(e, OSError):
                    raise io.not_written(path, io.reason(e)) from e
                raise
            then()
        progress.tick()

    def hold_until_copied(self) -> None:
        """(DCP copies the tensors before `async_save` returns: nothing to wait for.)"""


def _checksummed_writer(path: Path) -> Any:
    """DCP's file writer for a checkpoint at `path`, which also writes the checksums of the
    shard files of its rank once they are on disk. That is in DCP's write step, in the thread
    that writes the shards; DCP's coordinator writes the index only after every rank's write
    step returned, so every rank's checksums are on disk before the index is, and before rank
    0 renames the checkpoint into place: no collective of app's own."""
    from torch.distributed.checkpoint import FileSystemWriter

    class ChecksummedWriter(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            written = super().write_data(plan, planner)  # (done: a completed future)
            write_checksums(path, {str(r.storage_data.relative_path) for r in written.value()},
                            f"checksums.rank{self.rank}.json")
            return written

    return ChecksummedWriter(path)


# ---- reading ---------------------------------------------------------------------------------

class _IndexUnpickler(pickle.Unpickler):
    """DCP writes its index with pickle and reads it with plain `pickle.load`, which runs any
    code a crafted file names. This reader builds only what an index holds: DCP's metadata
    classes, torch's dtypes, sizes and layouts, paths; anything else is refused."""

    DCP = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    OTHERS = {("torch", "Size"), ("torch.serialization", "_get_layout"),
              ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
              ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")}

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if module in self.DCP:
                found = getattr(importlib.import_module(module), name, None)
                if isinstance(found, type) and found.__module__ == module:
                    return found
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            if (module, name) in self.OTHERS:
                return super().find_class(module, name)
            if (module, name) == ("builtins", "getattr"):
                return self._member
        raise pickle.UnpicklingError(f"{module}.{name}")

    @staticmethod
    def _member(owner: Any, name: Any) -> Any:
        """A member of an enum by its name: some Python releases (3.11.2, Debian 12's) pickle
        an Enum member as `getattr(its class, its name)` (DCP's index holds one, the memory
        format). Only a member, of an enum class this reader built; any other getattr is
        refused."""
        if (isinstance(owner, type) and issubclass(owner, enum.Enum) and isinstance(name, str)
                and name in owner.__members__):
            return owner[name]
        raise pickle.UnpicklingError("builtins.getattr")


def read_index(path: Path) -> Any:
    """DCP's index of a sharded checkpoint (its Metadata), read safely once it matches its
    checksum, after checking that every shard file it names is there and as long as it says
    (a checkpoint whose shards were lost or cut short is not one to read)."""
    from torch.distributed.checkpoint.metadata import Metadata

    verify(path, [INDEX])  # (first: a damaged index may unpickle as anything, or name anything)
    try:
        with open(path / INDEX, "rb") as f:
            metadata = _IndexUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise UserError(f"checkpoint {path}: refused: its index ({INDEX}) names {e}, which is "
                        f"not part of a checkpoint's index, and loading it could run code "
                        f"(nothing was run). Load only checkpoints written by app, or by code "
                        f"you trust") from e
    except Exception as e:  # (garbage bytes make the unpickler raise almost anything)
        raise UserError(f"checkpoint {path}: its index ({INDEX}) does not read "
                        f"({io.reason(e) or one_line(e)})") from e
    if not isinstance(metadata, Metadata):
        raise UserError(f"checkpoint {path}: its index ({INDEX}) is not DCP's")
    ends: dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        name = str(item.relative_path)
        ends[name] = max(ends.get(name, 0), item.offset + item.length)
    missing = sorted(name for name in ends if not (path / name).is_file())
    if missing:
        raise UserError(f"checkpoint {path}: shard files missing: {', '.join(missing)}")
    short = sorted(name for name, end in ends.items() if (path / name).stat().st_size < end)
    if short:
        raise UserError(f"checkpoint {path}: shard files shorter than the index says (cut "
                        f"short): {', '.join(short)}")
    return metadata


def tensor_groups(path: Path) -> set[str]:
    """The entries of the checkpoint whose tensors are in its shards: model, optimizer, ema."""
    return {key.split(".", 1)[0] for key in read_index(path).state_dict_metadata}


def read_meta(path: Path) -> dict[str, Any]:
    """meta.pt of a sharded checkpoint, after checking its index (`read_index`) and every
    file against its checksum: each reader reads a checkpoint's meta once, before its shards."""
    metadata = read_index(path)
    if not (path / META).is_file():
        raise UserError(f"checkpoint {path}: no {META}: an incomplete sharded checkpoint")
    shards = {str(item.relative_path) for item in (metadata.storage_data or {}).values()}
    verify(path, [*sorted(shards), META])
    meta = io.read(path / META)
    if not isinstance(meta, dict):
        raise UserError(f"checkpoint {path}: {META} is not a dict: a damaged checkpoint")
    return meta


def dcp_error(e: BaseException) -> str:
    """The first line of what failed in a DCP call: a CheckpointException (which is not an
    Exception: it derives from BaseException) carries each rank's error."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException) and e.failures:
        rank, failure = min(e.failures.items())
        return f"rank {rank}: {dcp_error(failure[0] if isinstance(failure, tuple) else failure)}"
    return io.reason(e) or one_line(e)


def optimizer_by_names(state: dict[str, Any], names: list[str] | dict[str, int]
                       ) -> dict[str, Any]:
    """An optimizer state numbered as `Optimizer.state_dict()` numbers it, keyed by `names`
    (the parameters' names in the optimizer's order); `optimizer_by_ids`: back."""
    return {"state": {names[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                             for g in state["param_groups"]]}


def optimizer_by_ids(state: dict[str, Any]) -> dict[str, Any]:
    names = [name for group in state["param_groups"] for name in group["params"]]
    return optimizer_by_names(state, {name: i for i, name in enumerate(names)})


def read_full(path: Path) -> dict[str, Any]:
    """A sharded checkpoint in the single-file layout, its tensors whole, read in this process
    (no process group)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    from app._private import read_dcp_whole

    meta = read_meta(path)  # (checks the index first: DCP unpickles it again)
    try:
        tensors = read_dcp_whole(FileSystemReader(str(path)))
    except (Exception, CheckpointException) as e:
        raise UserError(f"checkpoint {path}: its shards do not read ({dcp_error(e)})") from e
    state = join(meta, tensors)
    if "optimizer" in state:
        state["optimizer"] = optimizer_by_ids(state["optimizer"])
    return state


def split(state: dict[str, Any]) -> tuple[dict, dict]:
    """A state of the single-file layout, its optimizer's keyed by parameter name, in the
    sharded one: (tensors, meta)."""
    meta = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
    tensors = {k: state[k] for k in ("model", "optimizer") if k in state}
    train_step = dict(state.get("train_step") or {})
    if train_step.get("ema"):
        tensors["ema"] = train_step["ema"]["module"]
        train_step["ema"] = {k: v for k, v in train_step["ema"].items() if k != "module"}
    meta["train_step"] = train_step
    return tensors, meta


def join(meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """The other way: a sharded checkpoint's entries as one state (its optimizer's keyed by
    parameter name)."""
    state = {**meta, **{k: v for k, v in tensors.items() if k != "ema"}}
    ema = (meta.get("train_step") or {}).get("ema")
    if isinstance(ema, dict) and "ema" in tensors:
        state["train_step"] = {**meta["train_step"], "ema": {**ema, "module": tensors["ema"]}}
    return state


# ---- the parts that hold a model's tensors, sharded by FSDP2 or not --------------------------

def model_is_sharded(model: nn.Module) -> bool:
    """Whether `model` is sharded by FSDP2 (its parameters are DTensors)."""
    return _sharded(dict(model.named_parameters()))


def _sharded(state: Any) -> bool:
    """Whether a state dict holds DTensors (shards read for this run), not whole tensors."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return any(_sharded(v) for v in state.values())
    return isinstance(state, DTensor)


def load_weights(module: nn.Module, weights: dict[str, Any], strict: bool = True) -> None:
    """Weights into `module`: whole tensors (a file's) into a model sharded or not; a sharded
    checkpoint's DTensors into the model they were read for."""
    if not model_is_sharded(module) or _sharded(weights):
        module.load_state_dict(weights, strict=strict)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, weights,
                         options=StateDictOptions(full_state_dict=True, strict=strict))


class Weights:
    """A model as a part of the checkpoint (torch's Stateful): `load_weights` on load."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def load_state_dict(self, weights: dict[str, Any], strict: bool = True) -> None:
        load_weights(self.module, weights, strict)


class OptimizerState:
    """An optimizer as a part of the checkpoint (torch's Stateful): its state keyed by
    parameter name (a file numbers it: `optimizer_by_ids`), through torch's
    get/set_optimizer_state_dict when the model is sharded. A numbered state loads too."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.sharded = model_is_sharded(model)
        names = {p: n for n, p in model.named_parameters()}  # (in the optimizer's order:)
        self.names = [names[p] for group in optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        """By name. torch's helper gives an optimizer without state yet (a resume's, whose
        state is read into this one) a state to fill, with a step of learning rate 0; for a
        model that is not sharded, an optimizer with state gives the same for less."""
        if not self.sharded and self.optimizer.state:  # (the helper costs ~25 ms a save)
            return optimizer_by_names(self.optimizer.state_dict(), self.names)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.sharded:  # (by position, whether numbered or named)
            self.optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint import state_dict as dcp_state

        if all(isinstance(i, int) for g in state["param_groups"] for i in g["params"]):
            state = optimizer_by_names(state, self.names)  # (a file's, numbered)
        dcp_state.set_optimizer_state_dict(self.model, self.optimizer, state, options=(
            dcp_state.StateDictOptions(full_state_dict=not _sharded(state))))
