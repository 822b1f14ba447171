"""Communication helpers that work, as no-ops, without a process group: the loop calls them
unconditionally, so it never branches on "am I distributed"."""

from __future__ import annotations

import inspect
import ipaddress
import logging
import os
import socket
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as tdist

from app.errors import UserError

log = logging.getLogger(__name__)

# Set by init(): this process's place on its machine, the group of the ranks of this machine
# (as in detectron2's comm), and a gloo group for small control messages, so that agreeing on
# a stop never puts a CPU-synchronising collective on an accelerator's stream.
_local_rank = 0
_local_group: Any = None
_control_group: Any = None


def ddp_buffer_sync(sync: bool) -> dict[str, bool]:
    """DDP's keyword for copying rank 0's buffers before each forward: torch 2.13 renamed
    `broadcast_buffers` to `forward_sync_buffers` and warns whenever the old one is passed.
    (The new one also syncs once at construction: the same buffers anyway, from one seed.)"""
    new = "forward_sync_buffers"
    takes = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    return {new if new in takes else "broadcast_buffers": sync}


def check_host(url: str) -> None:
    """Fail at once, in one line, when the host of `url` has no address: the store's client
    would otherwise retry the name for distributed.timeout_s (30 minutes by default)."""
    parsed = urlparse(url)
    if parsed.scheme != "tcp" or not parsed.hostname:
        return
    try:
        socket.getaddrinfo(parsed.hostname, parsed.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        reason = e.strerror if isinstance(e, socket.gaierror) else str(e)
        raise UserError(f"dist_url={url}: the host {parsed.hostname} cannot be resolved "
                        f"({reason}); give the name or IP address of machine 0 "
                        f"(machine_rank=0) as every machine can reach it") from None


def _rendezvous(url: str, rank: int, world_size: int, timeout: timedelta) -> dict[str, Any]:
    """How to meet the other ranks. For tcp://IP:PORT, rank 0 serves the store on that address
    only (PyTorch's own store listens on every interface), and with a loopback IP gloo's
    connections stay on the loopback too: a one-machine run (dist_url=auto: 127.0.0.1) cannot
    be reached from the network. A host name keeps PyTorch's behaviour: this machine may
    resolve its own name to another address (127.0.1.1 on Debian) than its peers do."""
    parsed = urlparse(url)
    try:
        ip = ipaddress.ip_address(parsed.hostname or "")
    except ValueError:
        ip = None
    if parsed.scheme != "tcp" or ip is None or not parsed.port:
        return {"init_method": url}
    if ip.is_loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if rank != 0:
        return {"store": tdist.TCPStore(str(ip), parsed.port, world_size, is_master=False,
                                        timeout=timeout)}
    listener = socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((str(ip), parsed.port))
    except OSError as e:
        listener.close()
        raise UserError(f"dist_url={url}: rank 0 cannot listen there ({e.strerror}): the "
                        f"address must be one of machine 0 (machine_rank=0), the port free") from e
    listener.listen()
    return {"store": tdist.TCPStore(str(ip), parsed.port, world_size, is_master=True,
                                    timeout=timeout,
                                    master_listen_fd=listener.detach())}  # the store's now


def init(backend: str, url: str, rank: int, world_size: int, local_rank: int,
         local_world_size: int, timeout_s: float) -> None:
    global _local_rank, _local_group, _control_group
    check_host(url)
    timeout = timedelta(seconds=timeout_s)
    tdist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                             **_rendezvous(url, rank, world_size, timeout))
    _local_rank = local_rank
    _local_group, _ = tdist.new_subgroups_by_enumeration(
        [list(range(first, min(first + local_world_size, world_size)))
         for first in range(0, world_size, local_world_size)])
    _control_group = None if backend == "gloo" else tdist.new_group(backend="gloo")
    if rank == 0 and world_size > local_world_size:
        log.info("every machine has joined: %d ranks", world_size)
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


def _all_reduce(value: torch.Tensor, op: Any) -> torch.Tensor:
    """A new tensor (`value` is left alone); with one process `value` itself, to be read, not
    changed (no copy: a device op less on each logging step)."""
    if not initialized():
        return value
    out = value.clone()
    tdist.all_reduce(out, op=op)
    return out


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    if not initialized():
        return value
    return _all_reduce(value, tdist.ReduceOp.SUM) / world_size()


def all_reduce_max(value: torch.Tensor) -> torch.Tensor:
    return _all_reduce(value, tdist.ReduceOp.MAX)


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    return _all_reduce(value, tdist.ReduceOp.SUM)


def all_gather_floats(values: list[float]) -> list[list[float]]:
    """Every rank's `values` (as many on each), in rank order: one small all-gather."""
    if not initialized():
        return [list(values)]
    # On the gloo group, CPU tensors, whatever the devices' backend (NCCL, XCCL, HCCL): no
    # device copy, no wait for the device.
    mine = torch.tensor(values, dtype=torch.float64)
    out = torch.empty(world_size() * len(values), dtype=torch.float64)
    # (all_gather_single is the newer name; all_gather_into_tensor warns there, deprecated)
    gather = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
    gather(out, mine, group=control_group())
    return out.view(world_size(), len(values)).tolist()


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
