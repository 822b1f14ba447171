"""Communication helpers that work, as no-ops, without a process group.

The loop calls these unconditionally, so it never branches on "am I distributed".
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

log = logging.getLogger(__name__)

# Set by init(): this process's place on its machine, the group of the ranks of this machine
# (as in detectron2's comm), and a gloo group for small control messages, so that agreeing on
# a stop never puts a CPU-synchronising collective on an accelerator's stream.
_local_rank = 0
_local_group: Any = None
_control_group: Any = None


def init(backend: str, url: str, rank: int, world_size: int, local_rank: int,
         local_world_size: int, timeout_s: float) -> None:
    global _local_rank, _local_group, _control_group
    tdist.init_process_group(backend, init_method=url, rank=rank, world_size=world_size,
                             timeout=timedelta(seconds=timeout_s))
    _local_rank = local_rank
    # Every rank must create every group, in the same order.
    machine = rank // local_world_size
    for first in range(0, world_size, local_world_size):
        group = tdist.new_group(list(range(first, min(first + local_world_size, world_size))))
        if first // local_world_size == machine:
            _local_group = group
    _control_group = None if backend == "gloo" else tdist.new_group(backend="gloo")
    log.debug("rank %d/%d joined (%s, %s)", rank, world_size, backend, url)


def destroy() -> None:
    global _local_group, _control_group
    if initialized():
        tdist.destroy_process_group()
    _local_group = _control_group = None


def initialized() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def rank() -> int:
    return tdist.get_rank() if initialized() else 0


def world_size() -> int:
    return tdist.get_world_size() if initialized() else 1


def local_rank() -> int:
    return _local_rank if initialized() else 0


def local_group() -> Any:
    """The process group of this machine's ranks (None without a process group)."""
    return _local_group


def control_group() -> Any:
    """A gloo group for CPU control messages (the default group when that is gloo)."""
    return _control_group


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
