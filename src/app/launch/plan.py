"""Where a job runs and on what, decided once before anything starts (app.launch.run carries
it out): in this process, as `devices` workers spawned here, or as one rank of a torchrun/SLURM/
MPI job already running; and the device type, backend and device of each process. Workers get
the resolved config, the plan and the run directory, and never compose anything of their own.

Imported without torch (app.__main__ asks `spawns_workers` before it imports torch); the device
questions import it when first asked.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from app.config import Accelerator, AppConfig, Mode
from app.env import ProcessEnv, check_horovod
from app.errors import UserError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ACCELERATORS = tuple(a.value for a in Accelerator)  # (the submitit launcher checks it too)
# The process-group backend each device type is best served by.
BACKENDS = {"cuda": "nccl", "npu": "hccl", "hpu": "hccl", "xpu": "xccl", "mps": "gloo",
            "cpu": "gloo"}
# The folder key of the app's own data sets from files (a user's data module may download it).
DATA_FOLDERS = {"app.data.ImageFolder": "root", "app.data.HFImages": "path"}
# CPU ranks beyond the cores only share them (a debugging run of devices=2 on one core is
# fine); a few per core are allowed, a mistyped devices=1000 that would fork 1000 is not.
CPU_PROCESSES_PER_CORE = 4


class How(StrEnum):
    in_process = "in_process"  # this process runs the mode
    spawn = "spawn"  # this process starts `devices` workers, one rank each
    rank = "rank"  # this process is one rank of a job torchrun, SLURM or MPI started


@dataclass(frozen=True)
class Plan:
    """What `plan()` decided; workers receive it as it is."""

    how: How
    kind: str  # the device type: cpu, cuda, mps, ...
    backend: str  # the process group's, for a rank
    devices: int = 1  # the workers to spawn (How.spawn)
    url: str | None = None  # where the spawned workers meet
    device_id: int | None = None  # the one device of a run in this process, if asked for
    set_device_rank: bool = True  # a rank takes device local_rank (else device 0)

    def device(self, local_rank: int = 0) -> torch.device:
        """This process's device, made current: NCCL binds to it at the first collective."""
        import torch

        if self.kind in ("cpu", "mps"):
            return torch.device(self.kind)
        index = self.device_id if self.device_id is not None else (
            local_rank if self.set_device_rank else 0)
        count = device_count(self.kind)
        if index >= count:
            raise UserError(
                f"local rank {local_rank} needs {self.kind}:{index}, but only {count} "
                f"{self.kind} device(s) are visible; lower devices=, or set "
                f"distributed.set_device_rank=false when each process sees only its own device")
        device = torch.device(self.kind, index)
        torch.get_device_module(self.kind).set_device(device)
        return device


def one_process(mode: Mode, devices: int, nodes: int) -> bool:
    """One device on one machine runs in this process, and so do predict and export."""
    return devices * nodes == 1 or mode in (Mode.predict, Mode.export)


def spawns_workers(cfg: AppConfig, env: ProcessEnv) -> bool:
    """Asked before torch is imported: devices=auto, which needs torch to count, reads as no."""
    return (not env.is_rank and isinstance(cfg.devices, int)
            and not one_process(cfg.trainer.mode, cfg.devices, cfg.nodes))


def plan(cfg: AppConfig, env: ProcessEnv) -> Plan:
    """Raises UserError, before anything starts, for what cannot work here."""
    check_horovod(os.environ, cfg.distributed.horovod)
    kind = resolve_accelerator(cfg.accelerator, cfg.accelerator_strict)
    backend = BACKENDS[kind] if cfg.distributed.backend == "auto" else str(cfg.distributed.backend)
    keep = {"backend": backend, "set_device_rank": cfg.distributed.set_device_rank}
    if env.is_rank:  # torchrun, a SLURM task or an MPI rank: this process is one rank
        if cfg.device_id is not None:
            raise UserError(f"device_id={cfg.device_id}: under {env.kind.value} each rank takes "
                            f"its local rank's device; drop device_id")
        return Plan(How.rank, kind, **keep)
    devices = resolve_devices(cfg.devices, kind)
    if one_process(cfg.trainer.mode, devices, cfg.nodes):
        if devices * cfg.nodes > 1:
            log.info("trainer=%s runs in one process", cfg.trainer.mode.value)
        if cfg.device_id is not None:
            check_device_id(kind, cfg.device_id)
        return Plan(How.in_process, kind, device_id=cfg.device_id, **keep)
    if cfg.device_id is not None:
        raise UserError(f"device_id={cfg.device_id} picks the one device of a devices=1 run; "
                        f"to choose the devices of devices={devices}, set "
                        f"CUDA_VISIBLE_DEVICES (or your accelerator's equivalent)")
    if cfg.distributed.max_restarts and cfg.nodes > 1:
        raise UserError(f"distributed.max_restarts needs nodes=1 (nodes={cfg.nodes}): the "
                        f"other machines' workers cannot rejoin a restart; under Slurm use "
                        f"hydra.launcher.max_num_failures")
    if cfg.dist_url == "auto" and cfg.nodes > 1:  # (a SLURM job takes its address from SLURM)
        raise UserError(
            f"dist_url=auto works on one machine only; with nodes={cfg.nodes} give the "
            f"address of machine 0, the same on every machine: dist_url=tcp://HOST:PORT")
    url = cfg.dist_url
    if url == "auto":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    from app.dist import check_host  # (torch)

    check_host(url)  # before any worker starts
    # A missing data folder of the app's own data sets (each worker would fail on it alike);
    # not at compose time: a Slurm job may read a folder that only its nodes have.
    key = DATA_FOLDERS.get(str(cfg.data.get("_target_")))
    if key and isinstance(cfg.data.get(key), str) and not Path(cfg.data[key]).expanduser().exists():
        raise UserError(f"data.{key}={cfg.data[key]}: no such file or folder here")
    return Plan(How.spawn, kind, devices=devices, url=url, **keep)


# -- what this machine has ----------------------------------------------------------------

def available(kind: str) -> bool:
    import torch

    return kind == "cpu" or getattr(torch.accelerator.current_accelerator(True), "type", "") == kind


def device_count(kind: str) -> int:
    import torch

    return torch.get_device_module(kind).device_count() if available(kind) else 0


def resolve_accelerator(accelerator: str, strict: bool) -> str:
    if accelerator not in ACCELERATORS:
        raise UserError(f"accelerator={accelerator}: expected one of {', '.join(ACCELERATORS)}")
    if accelerator == "auto":
        return next((k for k in ("cuda", "xpu", "npu", "hpu", "mps") if available(k)), "cpu")
    if available(accelerator):
        return accelerator
    if strict:
        raise UserError(
            f"accelerator={accelerator}: no such device is available here; use accelerator=cpu "
            f"or accelerator=auto (or accelerator_strict=false to fall back to the CPU)")
    log.warning("accelerator=%s is not available here: running on the CPU", accelerator)
    return "cpu"


def resolve_devices(devices: int | str, kind: str) -> int:
    if devices == "auto":
        return device_count(kind)
    if kind != "cpu" and devices > device_count(kind):
        raise UserError(f"devices={devices}: only {device_count(kind)} {kind} device(s) are "
                        f"visible here; use devices={device_count(kind)} or devices=auto")
    cores = os.cpu_count() or 1
    if kind == "cpu" and devices > CPU_PROCESSES_PER_CORE * cores:
        raise UserError(f"devices={devices}: this machine has {cores} CPU core(s), and more "
                        f"than {CPU_PROCESSES_PER_CORE * cores} CPU processes would only compete "
                        f"for them (each one loads torch); use devices={cores} or fewer")
    if kind == "cpu" and devices > cores:
        log.warning("devices=%d CPU processes on %d cores: they will compete for the cores",
                    devices, cores)
    return devices


def check_device_id(kind: str, device_id: int) -> None:
    """Device `device_id` for a one-process run (the older launchers' --gpu), counted among the
    visible devices as PyTorch numbers them."""
    one = kind in ("cpu", "mps")
    count = 1 if one else device_count(kind)
    if 0 <= device_id < count:
        return
    if one:
        raise UserError(f"device_id={device_id}: the run is on the {kind}, which is one device "
                        f"(no GPU or other accelerator is in use); drop device_id")
    raise UserError(f"device_id={device_id}: {count} {kind} device(s) are visible; indices "
                    f"count among the visible devices (CUDA_VISIBLE_DEVICES or its "
                    f"equivalent), from 0")
