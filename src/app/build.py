"""Factories that turn the `_target_` groups and loader settings into objects."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from app import dist
from app.config import AppConfig, UserError
from app.data import DataModule

log = logging.getLogger(__name__)


def _instantiate(group: str, node: dict[str, Any], **kwargs: Any) -> Any:
    """Hydra's instantiate, with a user mistake in a group reported as one line naming it."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__
        if isinstance(cause, UserError):
            raise cause from None
        reason = f"{type(cause).__name__}: {cause}" if cause else str(e).splitlines()[0]
        raise UserError(f"{group} ({node.get('_target_')}): {reason}") from e


def build_data(cfg: AppConfig) -> DataModule:
    data = _instantiate("data", cfg.data)
    if not isinstance(data, DataModule):
        raise UserError(f"data._target_={cfg.data['_target_']} does not build an app DataModule")
    return data


def build_model(cfg: AppConfig, data: DataModule) -> nn.Module:
    return _instantiate(
        "model", cfg.model, input_shape=data.input_shape, num_classes=data.num_classes
    )


def build_optimizer(cfg: AppConfig, model: nn.Module) -> torch.optim.Optimizer:
    factory = _instantiate("optimizer", cfg.optimizer)
    try:
        return factory(model.parameters())
    except (ValueError, TypeError) as e:
        raise UserError(f"optimizer ({cfg.optimizer['_target_']}): {e}") from e


def build_scheduler(
    cfg: AppConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    factory = _instantiate("scheduler", cfg.scheduler)
    return factory(optimizer, total_steps=total_steps)


class ResumableSampler(Sampler[int]):
    """A DistributedSampler that can start an epoch part-way, for exact mid-epoch resume.

    Skipping happens on indices, so skipped batches are never loaded.
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.inner = DistributedSampler(
            dataset, num_replicas=dist.world_size(), rank=dist.rank(), shuffle=True, seed=seed
        )
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.inner.set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[int]:
        indices = iter(self.inner)
        for _ in range(self.skip):
            next(indices)
        return indices

    def __len__(self) -> int:
        return len(self.inner) - self.skip


class ShardSampler(Sampler[int]):
    """Rank r takes samples r, r + world, ...: every sample exactly once, no padding."""

    def __init__(self, dataset: Dataset) -> None:
        self.indices = range(dist.rank(), len(dataset), dist.world_size())

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def build_train_loader(data: DataModule, seed: int) -> tuple[DataLoader, ResumableSampler]:
    sampler = ResumableSampler(data.train, seed)
    # Its own generator keeps the loader from drawing on the global torch RNG (which the
    # model's dropout uses); the loop reseeds it each epoch, so resume stays exact.
    loader = DataLoader(
        data.train, batch_size=data.batch_size, sampler=sampler, drop_last=True,
        num_workers=data.num_workers, generator=torch.Generator(),
    )
    return loader, sampler


def build_val_loader(data: DataModule) -> DataLoader:
    return DataLoader(
        data.val, batch_size=data.val_batch_size, sampler=ShardSampler(data.val),
        num_workers=data.num_workers, generator=torch.Generator(),
    )
