"""Factories that turn the `_target_` groups and loader settings into objects."""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Iterator
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from app import dist
from app.checkpoint.layout import TrainedAt
from app.checkpoint.restore import load_for_inference
from app.config import AppConfig, Mode
from app.data import DataModule
from app.errors import UserError, first_line
from app.training.data_errors import Loader, NamedItems

log = logging.getLogger(__name__)


def instantiate_group(group: str, node: dict[str, Any], **kwargs: Any) -> Any:
    """Hydra's instantiate, with a user mistake in a group reported as one line naming it."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__
        if isinstance(cause, UserError):
            raise cause from None
        reason = f"{type(cause).__name__}: {cause}" if cause else first_line(e)
        missing = re.search(r"No module named '([^'.]+)'", str(cause))  # (a top-level one)
        if isinstance(cause, ImportError) and missing:  # (Hydra's words: 3 lines, no way out)
            reason = (f"no module named '{missing[1]}': Python finds your own module in the "
                      f"folder the command runs from, or in a folder on PYTHONPATH")
        raise UserError(f"{group} ({node.get('_target_')}): {reason}") from e


def build_data(cfg: AppConfig) -> DataModule:
    data = instantiate_group("data", cfg.data)
    if not isinstance(data, DataModule):
        raise UserError(f"data._target_={cfg.data['_target_']} does not build an app DataModule")
    # A data module of your own that misses a part: one line, not an AttributeError below.
    target = cfg.data["_target_"]
    if not hasattr(data, "batch_size"):
        raise UserError(f"data ({target}): its __init__ must call super().__init__(**loader) "
                        f"(app.data.DataModule takes the loader settings)")
    if missing := [name for name in ("train", "val", "input_shape", "num_classes")
                   if not hasattr(data, name)]:
        raise UserError(f"data ({target}): sets no {', '.join(missing)} (a DataModule sets "
                        f"train, val, input_shape and num_classes)")
    if len(data.val) == 0:  # validation would divide by its zero samples
        raise UserError(f"data ({target}): the validation split is empty; give it "
                        f"at least one sample (data.val_fraction, or the data set's own split)")
    if data.cache:
        data.cache_in_memory()
    if cfg.trainer.mode == Mode.trainval:  # (the other modes take it from their checkpoint)
        data.prepare()
    return data


def build_model(cfg: AppConfig, data: DataModule) -> nn.Module:
    model = instantiate_group(
        "model", cfg.model, input_shape=data.input_shape, num_classes=data.num_classes
    )
    if cfg.detail and dist.is_main():
        log.info("model summary:\n%s", model_summary(model))
    return model


def build_trained_model(cfg: AppConfig, data: DataModule
                        ) -> tuple[nn.Module, TrainedAt]:
    """The model of `cfg` with the weights of `cfg.ckpt` that validation used, in eval mode, on
    the CPU; and the step and epoch they were saved at."""
    model = build_model(cfg, data)
    trained_at = load_for_inference(model, data, cfg.ckpt)
    return model.eval(), trained_at


def model_summary(model: nn.Module) -> str:
    """Parameter counts per top-level module, and the total."""
    def row(name: str, params: list[nn.Parameter]) -> str:
        trainable = sum(p.numel() for p in params if p.requires_grad)
        return f"{name:<24}{sum(p.numel() for p in params):>12,}{trainable:>12,}"

    rows = [row(n, list(m.parameters())) for n, m in model.named_children()] or [row("(model)", [])]
    return "\n".join([f"{'module':<24}{'params':>12}{'trainable':>12}", *rows,
                      row("total", list(model.parameters()))])


def parameter_groups(model: nn.Module, decay_norm_and_bias: bool) -> list[dict[str, Any]]:
    """Biases and normalisation weights (the 1-d parameters) get no weight decay, unless asked:
    decaying them only pulls the layers' scales and offsets towards zero."""
    params = [p for p in model.parameters() if p.requires_grad]
    if decay_norm_and_bias:
        return [{"params": params}]
    return [{"params": [p for p in params if p.ndim > 1]},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]


def build_optimizer(cfg: AppConfig, model: nn.Module, global_batch: int | None = None
                    ) -> torch.optim.Optimizer:
    """The optimizer over `model`; with trainer.lr_scale_batch=B, lr *= global_batch / B."""
    factory = instantiate_group("optimizer", cfg.optimizer)
    overrides = {}
    base = cfg.trainer.lr_scale_batch
    if base is not None and global_batch is not None and "lr" in cfg.optimizer:
        overrides["lr"] = cfg.optimizer["lr"] * global_batch / base
        log.info("lr %.4g x global batch %d / %d = %.4g", cfg.optimizer["lr"], global_batch,
                 base, overrides["lr"])
    try:
        return factory(parameter_groups(model, cfg.trainer.decay_norm_and_bias), **overrides)
    except (ValueError, TypeError) as e:
        raise UserError(f"optimizer ({cfg.optimizer['_target_']}): {e}") from e


def build_scheduler(
    cfg: AppConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    factory = instantiate_group("scheduler", cfg.scheduler)
    return factory(optimizer, total_steps=total_steps)


class ResumableSampler(Sampler[int]):
    """A DistributedSampler that can start an epoch part-way (on indices: the batches skipped
    are never loaded), for an exact mid-epoch resume."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.inner = DistributedSampler(
            dataset, num_replicas=dist.world_size(), rank=dist.rank(), shuffle=True, seed=seed
        )
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.inner.set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self.inner, self.skip, None)

    def __len__(self) -> int:
        return len(self.inner) - self.skip


def shard_indices(dataset: Dataset) -> range:
    """Rank r takes samples r, r + world, ...: every sample exactly once, no padding (torch's
    DistributedSampler pads)."""
    return range(dist.rank(), len(dataset), dist.world_size())


def _loader_options(data: DataModule) -> dict[str, Any]:
    workers = data.num_workers > 0
    return {
        "num_workers": data.num_workers,  # (each seeds torch, random and NumPy on its own)
        "pin_memory": data.pin_memory and torch.cuda.is_available(),
        "persistent_workers": data.persistent_workers and workers,
        # Its own generator keeps the loader from drawing on the global torch RNG (which the
        # model's dropout uses); the loop reseeds it each epoch, so resume stays exact.
        "generator": torch.Generator(),
    }


def build_train_loader(data: DataModule, seed: int) -> tuple[DataLoader, ResumableSampler]:
    sampler = ResumableSampler(data.train, seed)
    loader = Loader(NamedItems(data.train, "training"), batch_size=data.batch_size,
                    sampler=sampler, drop_last=True, **_loader_options(data))
    return loader, sampler


def build_val_loader(data: DataModule) -> DataLoader:
    return Loader(NamedItems(data.val, "validation"), batch_size=data.val_batch_size,
                  sampler=shard_indices(data.val), **_loader_options(data))
