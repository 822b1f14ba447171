"""Where a job runs: in this process, as one rank of a torchrun/SLURM/MPI job, or as `devices`
workers spawned here. Compose once, then spawn: workers get the resolved config and the run
directory from this process and never compose or create run directories of their own.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from app.config import AppConfig, Mode, UserError
from app.dist import check_host
from app.env import ProcessEnv, check_horovod
from app.launch.rank_logs import setup_rank_logging
from app.launch.spawn import spawn
from app.launch.stacks import stacks_on_signal
from app.launch.worker import run_rank, worker
from app.reporting.results import write_result
from app.training.runtime import device_count, resolve_accelerator, select_device, select_device_id

log = logging.getLogger(__name__)

# CPU ranks beyond the cores only share them (a debugging run of devices=2 on one core is
# fine); a few per core are allowed, a mistyped devices=1000 that would fork 1000 is not.
CPU_PROCESSES_PER_CORE = 4


def resolve_devices(devices: int | str, kind: str) -> int:
    if devices == "auto":
        return device_count(kind) if kind not in ("cpu", "mps") else 1
    if kind == "mps" and devices > 1:
        raise UserError(f"devices={devices}: a Mac has one mps device; use devices=1")
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


def _stall_reporter(run_dir: Path, rank: int) -> Callable[[str], None]:
    """How a rank of a torchrun/SLURM job reports the stall that ends it (app.launch.watchdog): the
    line in its log (rank 0's on the console too), and rank 0 records the failure, as
    __main__ does for an error (the process exits without returning there)."""
    started = time.monotonic()

    def report(message: str) -> None:
        log.error("%s", message)
        if rank == 0:
            write_result(run_dir, "failed", time.monotonic() - started, f"Stalled: {message}")

    return report


def _free_local_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def launch(cfg: AppConfig, run_dir: Path, env: ProcessEnv) -> float | None:
    check_horovod(os.environ, cfg.distributed.horovod)
    kind = resolve_accelerator(cfg.accelerator, cfg.accelerator_strict)
    if env.is_rank:  # torchrun, a SLURM task or an MPI rank: this process is one rank
        if cfg.device_id is not None:
            raise UserError(f"device_id={cfg.device_id}: under {env.kind.value} each rank takes "
                            f"its local rank's device; drop device_id")
        setup_rank_logging(run_dir, env.rank, keep_handlers=env.rank == 0)
        log.info("rank %d of %d from %s (rendezvous %s)", env.rank, env.world_size,
                 env.kind.value, env.dist_url)
        return run_rank(cfg, run_dir, kind, env, _stall_reporter(run_dir, env.rank))
    devices = resolve_devices(cfg.devices, kind)
    if cfg.trainer.mode in (Mode.predict, Mode.export) and devices * cfg.nodes > 1:
        log.info("trainer=%s runs in one process", cfg.trainer.mode.value)
    elif devices * cfg.nodes > 1:
        if cfg.device_id is not None:
            raise UserError(f"device_id={cfg.device_id} picks the one device of a devices=1 run; "
                            f"to choose the devices of devices={devices}, set "
                            f"CUDA_VISIBLE_DEVICES (or your accelerator's equivalent)")
        if cfg.dist_url == "auto" and cfg.nodes > 1:  # (a SLURM job takes its address from SLURM)
            raise UserError(
                f"dist_url=auto works on one machine only; with nodes={cfg.nodes} give the "
                f"address of machine 0, the same on every machine: dist_url=tcp://HOST:PORT")
        url = _free_local_url() if cfg.dist_url == "auto" else cfg.dist_url
        check_host(url)  # before any worker starts
        with stacks_on_signal(run_dir / "logs" / "launcher.stacks"):  # (kill -s RTMIN+4 PID)
            return spawn(cfg, run_dir, kind, devices, url)
    with stacks_on_signal(run_dir / "logs" / "rank0.stacks"):
        if cfg.device_id is not None:
            return worker(cfg, run_dir, select_device_id(kind, cfg.device_id, cfg.accelerator))
        return worker(cfg, run_dir, select_device(kind, 0, cfg.distributed.set_device_rank))
