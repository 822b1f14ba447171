"""What runs in each process of a job: join the process group, run the mode, leave."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from omegaconf import OmegaConf

from app import dist, signals
from app.config import AppConfig, Mode
from app.env import ProcessEnv, enter, spawned
from app.errors import AppError, Interrupted, UserError, WorkerFailed
from app.launch import ends, watchdog
from app.launch.rank_logs import FAILURE_LOGGER, setup_rank_logging
from app.launch.stacks import stacks_on_signal, stacks_to_stderr
from app.rundir.lock import hold_as_worker
from app.training.compile_cache import compile_cache
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
        with compile_cache(cfg, run_dir):  # (before anything compiles; saved at the end)
            return run(cfg, run_dir, device)
    except AppError as e:
        if cfg.trainer.mode == Mode.trainval and cfg.trainer.replay_nonfinite:
            from app.training.replay import replay_after  # (a non-finite loss's stop only)

            replay_after(e, cfg, run_dir, device)
        raise
    except Exception as e:  # (a dead loader worker: RuntimeError, or a connection error)
        died = loader_worker_died(e)
        if died is None:
            raise
        raise died from e


def run_rank(cfg: AppConfig, run_dir: Path, plan: Plan, me: ProcessEnv,
             on_stall: Callable[[str], None]) -> float | None:
    """Join the process group as `me`, run the mode, leave the group; record how this rank
    ended (app.launch.ends). `on_stall` reports the line that ends a stalled job."""
    device = plan.device(me.local_rank)  # (current before the first collective)
    os.environ.update(cfg.distributed.nccl_env)  # opt-in NCCL_* settings, before NCCL starts
    if plan.backend == "nccl":  # PyTorch's Flight Recorder: at a collective's timeout each
        # rank dumps its last collectives to logs/ (as torchtitan does; the user's settings win)
        for name, value in (("TORCH_FR_BUFFER_SIZE", "2000"), ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
                            ("TORCH_FR_DUMP_TEMP_FILE", f"{run_dir}/logs/nccl_trace_rank_")):
            os.environ.setdefault(name, value)
    started = time.time()

    def stalled(message: str) -> None:
        ends.write(run_dir, me.rank, message, ends.STALLED)
        on_stall(message)

    with stacks_on_signal(run_dir / "logs" / f"rank{me.rank}.stacks"):
        dist.init(plan.backend, me.dist_url, me.rank, me.world_size,
                  me.local_rank, me.local_world_size, cfg.distributed.timeout_s)
        # Only training and evaluation tick; predict and export would look stalled.
        judged = cfg.trainer.mode in (Mode.trainval, Mode.eval)
        guard = watchdog.start(cfg.distributed.stall_timeout_s if judged else None, run_dir,
                               me.rank, me.world_size, stalled)
        previous = None
        try:
            result = worker(cfg, run_dir, device, me.local_world_size)
            # Completed: a stop signal as the process ends would only turn it into a run ended
            # by that signal (the launcher, or torchrun, kills an end that hangs).
            previous = signals.install(signal.SIG_IGN)
            return result
        except BaseException as e:
            if guard is not None and isinstance(e, Exception):  # (a stalled job's end: the stall)
                watchdog.hold_if_stalled(0 if isinstance(e, AppError) else 2 * guard.interval + 1)
            ends.write(run_dir, me.rank, e)  # (before its exit ends its peers)
            # Rank 0's error is, as a rule, the collective its peer's failure broke: the run's
            # record (result.json, app.status) names the cause. (A stop is no failure, and a
            # UserError is rank 0's own finding.)
            first = ends.first_failure(ends.read(run_dir, started)) if me.rank == 0 and \
                isinstance(e, Exception) and not isinstance(e, Interrupted | UserError) else None
            if first is not None and first["rank"] != 0:
                raise WorkerFailed(ends.failed_line(run_dir, first), first["exit_code"]) from e
            raise
        finally:
            if guard is not None:
                guard.stop()
            dist.destroy()
            signals.restore(previous or {})


def spawned_worker(local_rank: int, cfg: AppConfig, run_dir: Path, plan: Plan,
                   launcher_alive: Connection, results: Connection) -> None:
    """The target of each local worker process (torch.multiprocessing.start_processes)."""
    stacks_to_stderr()  # (until run_rank registers its stacks file)
    signals.install(signal.default_int_handler, (signal.SIGINT,))  # (the server ignored it,
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked: app.launch.spawn)
    # This rank's loader workers are forked, as its children: with the start method a
    # forkserver's child inherits they would be children of a forkserver of this rank, which a
    # rank killed outright leaves running, and PyTorch's loader workers end when their parent
    # does: they ran on, orphaned (225 MB each). (Named: Python 3.14's default is forkserver.)
    multiprocessing.set_start_method("fork" if sys.platform.startswith("linux") else None,
                                     force=True)
    if cfg.machine_rank == 0:  # (the workers of the machine whose launcher owns the run)
        hold_as_worker(run_dir)  # no new owner of the run until this worker has ended
    # SIGTERM (a stop at a step, with a checkpoint) when the launching process dies, however
    # it dies: no orphans. A child of the launcher (fork: it holds the pipe) by its parent's
    # death, a child of the forkserver by the end of the launcher's pipe.
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            launcher_alive.recv_bytes()
        log.warning("the launching process is gone: stopping")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="app-launcher-watch", daemon=True).start()
    me = enter(spawned(local_rank, plan.devices, cfg.machine_rank, cfg.nodes, plan.url))
    # The same variables torchrun sets, for code that reads them.
    os.environ.update(RANK=str(me.rank), WORLD_SIZE=str(me.world_size),
                      LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(me.local_world_size))
    setup_rank_logging(run_dir, me.rank, keep_handlers=False)
    log.info("rank %d of %d: pid %d", me.rank, me.world_size, os.getpid())
    failures = logging.getLogger(FAILURE_LOGGER)
    try:  # (the launcher prints the line of a stall, and reads how each rank ended)
        result = run_rank(cfg, run_dir, plan, me, lambda message: failures.error("%s", message))
        signals.install(signal.SIG_IGN)  # (until this process exits)
    except BaseException as e:
        if isinstance(e, AppError):
            failures.error("%s", e)
        else:
            failures.exception("rank %d failed", me.rank)
        sys.exit(e.exit_code if isinstance(e, AppError) else 1)
    if local_rank == 0:  # after the last collective: the run has completed
        results.send(result)
