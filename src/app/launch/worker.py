"""What runs in each process of a job: join the process group, run the mode, leave."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import OmegaConf

from app import dist, signals
from app.config import AppConfig, Mode
from app.env import ProcessEnv, enter, spawned
from app.errors import AppError, Interrupted, UserError, WorkerFailed, one_line
from app.launch import watchdog
from app.launch.rank_logs import FAILURE_LOGGER, setup_rank_logging
from app.launch.run_lock import hold_as_worker
from app.launch.stacks import stacks_on_signal
from app.training.data_errors import loader_worker_died
from app.training.runtime import apply_runtime_flags

if TYPE_CHECKING:
    from app.launch.plan import Plan

log = logging.getLogger(__name__)


def worker(cfg: AppConfig, run_dir: Path, device: torch.device,
           ranks_here: int | None = None) -> float | None:
    """Run the mode of `cfg.trainer` in this process; returns the monitored metric.
    `ranks_here`: the job's ranks on this machine, when this process is one of them."""
    apply_runtime_flags(cfg, device, ranks_here)
    if cfg.detail and dist.is_main():
        log.info("config:\n%s", OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    # Each mode's module is imported only when chosen: predict and export pull in extra
    # libraries (torch.export, the pictures) that a training run should not pay for.
    if cfg.trainer.mode == Mode.trainval:
        from app.training.loop import train as run
    elif cfg.trainer.mode == Mode.eval:
        from app.modes.evaluate import run_eval as run
    elif cfg.trainer.mode == Mode.predict:
        from app.modes.predict import run_predict as run
    else:
        from app.modes.export import run_export as run
    try:
        return run(cfg, run_dir, device)
    except Exception as e:  # (a dead loader worker: RuntimeError, or a connection error)
        died = loader_worker_died(e)
        if died is None:
            raise
        raise died from e


def run_rank(cfg: AppConfig, run_dir: Path, plan: Plan, me: ProcessEnv,
             on_stall: Callable[[str], None]) -> float | None:
    """Join the process group as `me`, run the mode, leave the group. `on_stall` reports the
    line that ends a stalled job (app.launch.watchdog), before the process exits."""
    device = plan.device(me.local_rank)  # (current before the first collective)
    os.environ.update(cfg.distributed.nccl_env)  # opt-in NCCL_* settings, before NCCL starts
    with stacks_on_signal(run_dir / "logs" / f"rank{me.rank}.stacks"):
        dist.init(plan.backend, me.dist_url, me.rank, me.world_size,
                  me.local_rank, me.local_world_size, cfg.distributed.timeout_s)
        # Only training and evaluation tick; predict and export would look stalled.
        judged = cfg.trainer.mode in (Mode.trainval, Mode.eval)
        guard = watchdog.start(cfg.distributed.stall_timeout_s if judged else None, run_dir,
                               me.rank, me.world_size, on_stall)
        previous = None
        started = time.time()
        try:
            result = worker(cfg, run_dir, device, me.local_world_size)
            # Completed: a stop signal as the process ends would only turn it into a run ended
            # by that signal (the launcher, or torchrun, kills an end that hangs).
            previous = signals.install(signal.SIG_IGN)
            return result
        except Exception as e:
            if guard is not None:  # a collective failed as a stalled job ended: the stall
                watchdog.hold_if_stalled(0 if isinstance(e, AppError) else 2 * guard.interval + 1)
            _record_failure(run_dir, me.rank, e)  # (before this rank's exit ends its peers)
            # A stop is no failure: every rank saved and stopped at the same step, and the
            # launcher tells that from each rank's own Interrupted. A UserError is rank 0's own
            # finding (the same one as its peer's, as a rule), not a broken collective.
            first = _first_failure(run_dir, started) if me.rank == 0 and not isinstance(
                e, Interrupted | UserError) else None
            if first is not None and first["rank"] != 0:
                # Rank 0's own error is the collective its peer's end broke: the run's record
                # (result.json, summaries, app.status) names the cause instead.
                rank_log = run_dir / "logs" / f"rank{first['rank']}.log"
                raise WorkerFailed(f"rank {first['rank']} failed: {first['error']} (traceback "
                                   f"in {rank_log})", first.get("exit_code", 1)) from e
            raise
        finally:
            if guard is not None:
                guard.stop()
            dist.destroy()
            signals.restore(previous or {})


def _record_failure(run_dir: Path, rank: int, error: BaseException) -> None:
    """What ended this rank, and when: rank 0 reads the others' (a torchrun or Slurm job's
    ranks share no launcher that would see them all)."""
    try:
        (run_dir / "logs" / f"rank{rank}.failed.json").write_text(json.dumps(
            {"rank": rank, "time": time.time(), "error": one_line(error),
             "exit_code": error.exit_code if isinstance(error, AppError) else 1}))
    except OSError:
        pass  # (the error itself is what the rank reports)


def _first_failure(run_dir: Path, since: float) -> dict[str, Any] | None:
    """The earliest failure any rank recorded in this run of the job."""
    found = []
    for path in (run_dir / "logs").glob("rank*.failed.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("time", 0) >= since:
            found.append(record)
    return min(found, key=lambda r: r["time"], default=None)


def _die_with_launcher(launcher_alive: Connection) -> None:
    """SIGTERM this worker when the launching process dies, however it dies (the stop path:
    the ranks agree on a step and checkpoint, as on a SIGTERM from outside): no orphans."""
    if sys.platform.startswith("linux"):  # a child of the launcher (fork, spawn)
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG

    def watch() -> None:  # a child of the forkserver: the launcher's pipe ends
        try:
            launcher_alive.recv_bytes()
        except (EOFError, OSError):
            pass
        log.warning("the launching process is gone: stopping")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="app-launcher-watch", daemon=True).start()


def _write_report(report: Path, name: str, **record: object) -> None:
    """How this worker ended, for the launcher (which reads it once every worker has ended)."""
    try:
        (report / name).write_text(json.dumps(record))
    except OSError:  # the launcher is gone, and with it the folder: nobody to tell
        pass


def spawned_worker(local_rank: int, cfg: AppConfig, run_dir: Path, plan: Plan,
                   report_dir: str, launcher_alive: Connection) -> None:
    """The target of each local worker process."""
    signals.install(signal.default_int_handler, (signal.SIGINT,))  # (the server ignored it)
    if cfg.machine_rank == 0:  # (the workers of the machine whose launcher owns the run)
        hold_as_worker(run_dir)  # no new owner of the run until this worker has ended
    _die_with_launcher(launcher_alive)
    me = enter(spawned(local_rank, plan.devices, cfg.machine_rank, cfg.nodes, plan.url))
    # The same variables torchrun sets, for code that reads them.
    os.environ.update(RANK=str(me.rank), WORLD_SIZE=str(me.world_size),
                      LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(me.local_world_size))
    setup_rank_logging(run_dir, me.rank, keep_handlers=False)
    log.info("rank %d of %d: pid %d", me.rank, me.world_size, os.getpid())
    report = Path(report_dir)
    failures = logging.getLogger(FAILURE_LOGGER)

    def stalled(message: str) -> None:  # the launcher prints the line
        failures.error("%s", message)
        # (a file of its own: the main thread may fail as the others end, and report that)
        _write_report(report, f"rank{me.rank}-stall.json", rank=me.rank, time=time.time(),
                      error=message, stall=True, exit_code=watchdog.EXIT_CODE)

    try:
        result = run_rank(cfg, run_dir, plan, me, stalled)
        signals.install(signal.SIG_IGN)  # (until this process exits)
    except BaseException as e:
        if isinstance(e, AppError):
            failures.error("%s", e)
        else:
            failures.exception("rank %d failed", me.rank)
        code = e.exit_code if isinstance(e, AppError) else 1
        _write_report(report, f"rank{me.rank}.json", rank=me.rank, time=time.time(),
                      exit_code=code, error=one_line(e), stopped=isinstance(e, Interrupted))
        sys.exit(code)
    if local_rank == 0:
        (report / "result.json").write_text(json.dumps({"result": result}))
