"""Carry out the plan (app.launch.plan decides): run the mode in this process, as this rank of
a torchrun/SLURM/MPI job, or as `devices` spawned workers, restarted after a machine fault up
to distributed.max_restarts times."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

from app import signals
from app.config import AppConfig
from app.env import ProcessEnv
from app.errors import WorkerKilled
from app.launch.plan import How, Plan, plan
from app.launch.rank_logs import setup_rank_logging
from app.launch.spawn import spawn
from app.launch.stacks import stacks_on_signal
from app.reporting.results import write_result

log = logging.getLogger(__name__)


def launch(cfg: AppConfig, run_dir: Path, env: ProcessEnv) -> float | None:
    """Run the job as `plan()` decides; returns the monitored metric."""
    with signals.deferred():  # (torch: imported here, and whole)
        import app.launch.worker  # noqa: F401
    chosen = plan(cfg, env)
    if chosen.how is How.spawn:
        with stacks_on_signal(run_dir / "logs" / "launcher.stacks"):  # (kill -s RTMIN+4 PID)
            return _spawn_restarting(cfg, run_dir, env, chosen)
    from app.launch.worker import run_rank, worker  # (torch)

    if chosen.how is How.in_process:
        with stacks_on_signal(run_dir / "logs" / "rank0.stacks"):
            return worker(cfg, run_dir, chosen.device())
    setup_rank_logging(run_dir, env.rank, keep_handlers=env.rank == 0)
    log.info("rank %d of %d from %s (rendezvous %s)", env.rank, env.world_size,
             env.kind.value, env.dist_url)
    started = time.monotonic()

    def stalled(message: str) -> None:  # (app.launch.watchdog: the process exits after this)
        log.error("%s", message)
        if env.rank == 0:  # the run's record, as __main__ writes it for an error
            write_result(run_dir, "failed", time.monotonic() - started, f"Stalled: {message}")

    return run_rank(cfg, run_dir, chosen, env, stalled)


def _spawn_restarting(cfg: AppConfig, run_dir: Path, env: ProcessEnv, chosen: Plan
                      ) -> float | None:
    """Spawn the workers; after one dies by a signal (WorkerKilled), start them all again, up
    to distributed.max_restarts times, from the last checkpoint (resume=auto) as a rerun of
    the command would."""
    allowed, restarts = cfg.distributed.max_restarts, 0
    while True:
        try:
            return spawn(cfg, run_dir, chosen)
        except WorkerKilled as killed:
            if restarts >= allowed:
                if not allowed:
                    raise
                raise WorkerKilled(f"{killed} (restarted {restarts} time(s), "
                                   f"distributed.max_restarts={allowed})") from None
            restarts += 1
            log.warning("%s: restarting the %d workers from the last checkpoint (%d of "
                        "distributed.max_restarts=%d)", killed, chosen.devices, restarts,
                        allowed)
        # What was checkpointed in this run directory, whatever the first start loaded.
        cfg = replace(cfg, resume="auto")
        chosen = plan(cfg, env)  # (a new rendezvous port)
