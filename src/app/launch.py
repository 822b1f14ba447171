"""Where a job runs: in this process, as one rank of a torchrun/SLURM/MPI job, or as `devices`
workers spawned here. Compose once, then spawn: workers get the resolved config and the run
directory from this process and never compose or create run directories of their own.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from app import dist
from app.cluster_env import check_horovod, detect
from app.config import AppConfig, AppError, Mode, UserError
from app.runtime import (
    apply_runtime_flags,
    backend_for,
    device_count,
    resolve_accelerator,
    select_device,
)
from app.worker_logging import FAILURE_LOGGER, setup_rank_logging

log = logging.getLogger(__name__)


class WorkerFailed(AppError):
    """A worker process raised or died; the message names the rank and the cause."""


@dataclass(frozen=True)
class Rank:
    """One process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    url: str


def worker(cfg: AppConfig, run_dir: Path, device: torch.device) -> float | None:
    """Run the mode of `cfg.trainer` in this process; returns the monitored metric."""
    apply_runtime_flags(cfg, device)
    if cfg.detail and dist.is_main():
        log.info("config:\n%s", OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    # Each mode's module is imported only when chosen: predict and export pull in extra
    # libraries (matplotlib, torch.export) that a training run should not pay for.
    if cfg.trainer.mode == Mode.trainval:
        from app.train import train as run
    elif cfg.trainer.mode == Mode.eval:
        from app.evaluate import run_eval as run
    elif cfg.trainer.mode == Mode.predict:
        from app.predict import run_predict as run
    else:
        from app.export import run_export as run
    return run(cfg, run_dir, device)


def resolve_devices(devices: int | str, kind: str) -> int:
    if devices == "auto":
        return device_count(kind) if kind not in ("cpu", "mps") else 1
    if kind == "mps" and devices > 1:
        raise UserError(f"devices={devices}: a Mac has one mps device; use devices=1")
    if kind != "cpu" and devices > device_count(kind):
        raise UserError(f"devices={devices}: only {device_count(kind)} {kind} device(s) are "
                        f"visible here; use devices={device_count(kind)} or devices=auto")
    if kind == "cpu" and devices > (os.cpu_count() or 1):
        log.warning("devices=%d CPU processes on %d cores: they will compete for the cores",
                    devices, os.cpu_count())
    return devices


def _free_local_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def run_rank(cfg: AppConfig, run_dir: Path, kind: str, me: Rank) -> float | None:
    """Join the process group as `me`, run the mode, leave the group."""
    # The device is made current before the first collective (NCCL binds to it).
    device = select_device(kind, me.local_rank, cfg.distributed.set_device_rank)
    os.environ.update(cfg.distributed.nccl_env)  # opt-in NCCL_* settings, before NCCL starts
    dist.init(backend_for(kind, cfg.distributed.backend), me.url, me.rank, me.world_size,
              me.local_rank, me.local_world_size, cfg.distributed.timeout_s)
    try:
        return worker(cfg, run_dir, device)
    finally:
        dist.destroy()


def _die_with_parent() -> None:
    """Ask Linux to send SIGTERM to this worker when its parent dies: no orphans."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _spawned(local_rank: int, cfg: AppConfig, run_dir: Path, kind: str, devices: int, url: str,
             report_dir: str) -> None:
    _die_with_parent()
    me = Rank(cfg.machine_rank * devices + local_rank, devices * cfg.nodes, local_rank,
              devices, url)
    # The same variables torchrun sets, for code that reads them.
    os.environ.update(RANK=str(me.rank), WORLD_SIZE=str(me.world_size),
                      LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(devices))
    setup_rank_logging(run_dir, me.rank, keep_handlers=False)
    log.info("rank %d of %d: pid %d", me.rank, me.world_size, os.getpid())
    if kind == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices))  # share the cores
    report = Path(report_dir)
    try:
        result = run_rank(cfg, run_dir, kind, me)
    except BaseException as e:
        failures = logging.getLogger(FAILURE_LOGGER)
        if isinstance(e, AppError):
            failures.error("%s", e)
        else:
            failures.exception("rank %d failed", me.rank)
        first_line = (str(e).strip().splitlines() or [""])[0]
        (report / f"rank{me.rank}.json").write_text(json.dumps(
            {"rank": me.rank, "time": time.time(), "error": f"{type(e).__name__}: {first_line}"
             if first_line else type(e).__name__}))
        sys.exit(e.exit_code if isinstance(e, AppError) else 1)
    if local_rank == 0:
        (report / "result.json").write_text(json.dumps({"result": result}))


class _ParentSignals:
    """Ctrl-C / SIGTERM to the launching process: ask workers to stop cleanly, once; again: kill."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def __enter__(self) -> _ParentSignals:
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT,
                                                                      signal.SIGTERM)}
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.received.append(signum)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _failure_message(procs: list, killed: set[int], reports: list[dict], grace: float,
                     timeout_s: float, run_dir: Path, base_rank: int) -> str:
    # A worker that died of a signal we did not send is the cause; otherwise the earliest
    # error, since a rank that fails makes its peers fail in their next collective.
    for local, proc in enumerate(procs):
        if proc.exitcode is not None and proc.exitcode < 0 and local not in killed:
            name = signal.Signals(-proc.exitcode).name
            return (f"rank {base_rank + local} (pid {proc.pid}) was killed by {name}; "
                    f"the other workers were stopped")
    if not reports:
        codes = {base_rank + i: p.exitcode for i, p in enumerate(procs)}
        return f"workers exited with codes {codes}"
    first = min(reports, key=lambda r: r["time"])
    rank_log = run_dir / "logs" / f"rank{first['rank']}.log"
    message = f"rank {first['rank']} failed: {first['error']} (traceback in {rank_log})"
    if "timed out" in first["error"].lower() or "timeout" in first["error"].lower():
        message += (f"; a rank did not reach a collective within "
                    f"distributed.timeout_s={timeout_s:g}")
    if killed:
        stuck = ", ".join(str(base_rank + i) for i in sorted(killed))
        message += f"; rank(s) {stuck} did not exit within {grace:g} s and were killed"
    return message


def spawn(cfg: AppConfig, run_dir: Path, kind: str, devices: int, url: str) -> float | None:
    """Start `devices` workers, watch them, and end them all if one fails or a signal comes."""
    ctx = multiprocessing.get_context(cfg.distributed.start_method)
    grace = cfg.distributed.kill_grace_s
    base_rank = cfg.machine_rank * devices
    log.info("starting %d workers (%s, ranks %d-%d of %d, rendezvous %s)", devices,
             cfg.distributed.start_method, base_rank, base_rank + devices - 1,
             devices * cfg.nodes, url)
    with tempfile.TemporaryDirectory(prefix="app-workers-") as report_dir:
        procs = [ctx.Process(target=_spawned, name=f"app-rank{base_rank + i}",
                             args=(i, cfg, run_dir, kind, devices, url, report_dir))
                 for i in range(devices)]
        killed: set[int] = set()
        with _ParentSignals() as signals:
            for proc in procs:
                proc.start()
            failed_at = asked_at = None
            while any(p.is_alive() for p in procs):
                multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()],
                                                timeout=0.2)
                now = time.monotonic()
                if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                    failed_at = now
                if signals.received and asked_at is None:
                    asked_at = now
                    for p in procs:
                        if p.is_alive():
                            os.kill(p.pid, signal.SIGTERM)  # workers checkpoint, then stop
                overdue = (failed_at is not None and now - failed_at > grace) or (
                    asked_at is not None and (len(signals.received) > 1 or
                                              now - asked_at > cfg.distributed.timeout_s))
                if overdue:
                    for i, p in enumerate(procs):
                        if p.is_alive():
                            killed.add(i)
                            p.kill()
            for p in procs:
                p.join()
        report = Path(report_dir)
        if all(p.exitcode == 0 for p in procs):
            return json.loads((report / "result.json").read_text())["result"]
        if signals.received:
            sig = signals.received[0]
            error = AppError(f"stopped by {signal.Signals(sig).name}; the workers saved a "
                             f"checkpoint: run again with hydra.run.dir={run_dir} to resume")
            error.exit_code = 128 + sig
            raise error
        reports = [json.loads(p.read_text()) for p in report.glob("rank*.json")]
        raise WorkerFailed(_failure_message(procs, killed, reports, grace,
                                            cfg.distributed.timeout_s, run_dir, base_rank))


def launch(cfg: AppConfig, run_dir: Path) -> float | None:
    check_horovod(os.environ, cfg.distributed.horovod)
    env = detect(os.environ)
    kind = resolve_accelerator(cfg.accelerator, cfg.accelerator_strict)
    if env is not None:  # torchrun, a SLURM task or an MPI rank: this process is one rank
        setup_rank_logging(run_dir, env.rank, keep_handlers=env.rank == 0)
        log.info("rank %d of %d from %s (rendezvous %s)", env.rank, env.world_size,
                 env.source, env.dist_url)
        return run_rank(cfg, run_dir, kind, Rank(env.rank, env.world_size, env.local_rank,
                                                 env.local_world_size, env.dist_url))
    devices = resolve_devices(cfg.devices, kind)
    if cfg.trainer.mode in (Mode.predict, Mode.export) and devices * cfg.nodes > 1:
        log.info("trainer=%s runs in one process", cfg.trainer.mode.value)
    elif devices * cfg.nodes > 1:
        if cfg.dist_url == "auto" and cfg.nodes > 1:  # (a SLURM job takes its address from SLURM)
            raise UserError(
                f"dist_url=auto works on one machine only; with nodes={cfg.nodes} give the "
                f"address of machine 0, the same on every machine: dist_url=tcp://HOST:PORT")
        url = _free_local_url() if cfg.dist_url == "auto" else cfg.dist_url
        return spawn(cfg, run_dir, kind, devices, url)
    return worker(cfg, run_dir, select_device(kind, 0, cfg.distributed.set_device_rank))
