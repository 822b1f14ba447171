"""Communication helpers that work, as no-ops, without a process group.

The loop calls these unconditionally, so it never branches on "am I distributed".
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as tdist


def initialized() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def rank() -> int:
    return tdist.get_rank() if initialized() else 0


def world_size() -> int:
    return tdist.get_world_size() if initialized() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0")) if initialized() else 0


def is_main(local: bool = False) -> bool:
    """Rank 0 of the job, or with `local=True` of this machine."""
    return (local_rank() if local else rank()) == 0


def barrier() -> None:
    if initialized():
        tdist.barrier()


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    """The mean of `value` over all ranks (a new tensor; `value` is left alone)."""
    if not initialized():
        return value.clone()
    out = value.clone()
    tdist.all_reduce(out, op=tdist.ReduceOp.SUM)
    return out / world_size()


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    if not initialized():
        return value.clone()
    out = value.clone()
    tdist.all_reduce(out, op=tdist.ReduceOp.SUM)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """`obj` as rank `src` has it, on every rank."""
    if not initialized():
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order."""
    if not initialized():
        return [obj]
    out: list[Any] = [None] * world_size()
    tdist.all_gather_object(out, obj)
    return out
