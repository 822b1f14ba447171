"""`python -m app [overrides]`: compose conf/, validate, resolve once, launch."""
# ruff: noqa: E402 (the stack-dump signal is taken before the slow imports)

from __future__ import annotations

import logging
import math
import os
import sys
import time
from pathlib import Path

from app.launch.stacks import stacks_to_stderr

stacks_to_stderr()  # first: `kill -s RTMIN+4 PID` while the imports below run dumps, not kills

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from app import logfile
from app.compose_errors import after_hydras_report
from app.conf_dir import config_dir
from app.config import register_schemas, to_app_config
from app.env import enter, reproducible_matmuls, this_process
from app.errors import AppError, Interrupted, RunDirInUse, UserError, WriteFailed, one_line
from app.from_run import apply_run
from app.launch.plan import spawns_workers
from app.launch.run import launch
from app.launch.spawn import prestart
from app.reporting.results import write_result
from app.resolvers import register_resolvers
from app.rundir import record as run_record
from app.rundir.lock import owns_run, take
from app.signals import exit_on, raise_on_sigterm, stop_signals_stop_nothing

log = logging.getLogger("app")

reproducible_matmuls()  # before MKL's first call, in this process and every worker
register_schemas()
register_resolvers()
# This process's place in a job, detected once, before Hydra calls our callbacks (a submitit
# job's entry is its launcher's __call__, a spawned worker's is app.launch.worker).
try:
    enter()
except UserError as e:  # (MPI variables without MASTER_ADDR): one line, before Hydra starts
    print(e, file=sys.stderr)
    sys.exit(e.exit_code)

# Set as the task function starts: Hydra's exit status 1 before it is a config Hydra could not
# compose (app.compose_errors adds to its report), after it a job's failure.
job_started = False


def _ended_status(stopped: bool) -> str:
    """The status of a run that did not complete: "requeued" where Slurm runs it again by
    itself (a preemption: submitit's handler requeues the job, then exits; a failed node)."""
    from app import slurm

    if slurm.requeued_since_start():
        return "requeued"
    return "interrupted" if stopped else "failed"


@hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")
def main(dict_cfg: DictConfig) -> float | None:
    global job_started
    job_started = True
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    sweep = HydraConfig.get().mode == RunMode.MULTIRUN
    started = time.monotonic()
    env = this_process()
    # SIGTERM before the loop or the launcher of the workers takes it (they stop at a step
    # with a checkpoint): ended as Ctrl-C is, with the run's record and its lock released; in
    # a rank of torchrun, srun or MPI too (their launchers pass it on to every rank).
    # (Not in a job of submitit, which ignores it: app.signals.hold_sigterm.)
    if "SUBMITIT_EXECUTOR" not in os.environ:
        raise_on_sigterm()
    # One process owns the run, holds its lock and records how it ended: machine 0's launcher
    # (the other machines of a nodes=N run share its directory), or rank 0 of a
    # torchrun/SLURM job.
    record = owns_run(dict_cfg.get("machine_rank", 0), env)
    lock = None
    try:
        if record:
            # Taken already, before Hydra wrote into the run directory (app.sweeps.summary):
            # RunDirInUse, naming the holder, if another command owns it.
            lock = take(run_dir)
        # Convert at the boundary: below here code sees plain, resolved, typed objects.
        # The overrides as typed: read resolved, seed=${oops} would fail here, not below.
        typed = OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False)
        cfg = to_app_config(apply_run(dict_cfg, typed))
        if spawns_workers(cfg, env):
            prestart(cfg)  # a worker server imports torch while this process does the same
        result = launch(cfg, run_dir, env)
        # A log file that failed (a full disk) stops a training loop (app.training.stop); a
        # job without one, or a failure after it, ends here.
        if (failed := logfile.failure()) is not None:
            raise WriteFailed(f"{failed}: the job completed, its log is incomplete")
        # Before result.json says so: a stop signal once that file says "completed" (the
        # test's cue) must not kill the process. (A sweep's next job has not begun: it may stop.)
        if not sweep:
            stop_signals_stop_nothing()
        # (A re-run of a completed run that trained nothing keeps the run's record: its wall
        # time is the training's.)
        if record:
            if not run_record.put_back(run_dir, completed_only=True):
                write_result(run_dir, "completed", time.monotonic() - started)
            if not sweep:  # (a sweep prints its summary)
                log.info("run directory: %s", run_dir)
    except BaseException as e:
        stopped = isinstance(e, (Interrupted, KeyboardInterrupt))  # by a signal
        # (RunDirInUse: the run is another command's. A command that trained nothing leaves
        # the record of the run there as it was.)
        if record and not isinstance(e, RunDirInUse) and not run_record.put_back(run_dir):
            write_result(run_dir, _ended_status(stopped),
                         time.monotonic() - started, one_line(e), raise_errors=False)
        # A refused job of a submitit sweep fails its task (the job must not pass as done,
        # and the run directory's records are the other command's).
        refused_job = isinstance(e, RunDirInUse) and "SUBMITIT_EXECUTOR" in os.environ
        if sweep and not env.is_rank and isinstance(e, Exception) and not stopped and \
                not refused_job:
            # A failed job of a sweep is a row of its summary, not the end of the sweep: the
            # other jobs still run, and the sweep summary reports the failures.
            # NaN is what sweepers such as Optuna take for a failed trial.
            if isinstance(e, AppError):
                log.error("%s", e)
            else:
                log.exception("the job failed")
            return math.nan
        if isinstance(e, KeyboardInterrupt):  # before the workers or the loop took it
            exit_on(e, log.error)
        if not isinstance(e, AppError):
            raise
        log.error("%s", e)
        if sweep and not stopped:
            raise  # a rank of a SLURM/torchrun job, a refused submitit job: its task must fail
        sys.exit(e.exit_code)  # a signal stops a whole sweep too; a re-run resumes it
    finally:
        if lock is not None:
            lock.release()
    return result


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as e:  # while Hydra composes, or between a sweep's jobs
        exit_on(e, lambda line: print(line, file=sys.stderr))
    except SystemExit as e:  # Hydra has reported an error; before a job: composing it
        if e.code != 1 or job_started:
            raise
        sys.exit(after_hydras_report(sys.argv[1:]))
