"""hydra-submitit-launcher, extended for app in four ways:

- Submit what was validated: every job's config is composed and validated in the submitting
  process; one invalid config submits nothing. The composed configs travel with the jobs, so
  a queued job runs its config as it was at submission even if YAML files change later.
- Failures are failures: a task whose job raised exits non-zero (the stock launcher returns
  the error as a value and the task exits 0, leaving Slurm's job COMPLETED), so srun's
  --kill-on-bad-exit ends its peers at once and Slurm marks the job FAILED; a job of one
  task, which returns NaN on failure so that local sweeps go on, raises too. The submitting
  command reports the error instead of a traceback wall.
- Never waits forever: job states come from squeue where sacct fails (a cluster without
  accounting), so a job that ends without a result from every task (scancel, a killed task)
  ends the wait with one line: its state, the task that failed first and why
  (app.sweeps.job_end). Ctrl-C stops the waiting, not the jobs: one line per job that goes
  on, with how to watch or cancel it (_job_report.py).
- Requeue after a checkpoint: app's loop itself handles submitit's requeue signal (see
  app/training/stop.py), so the stock `checkpoint()` (resubmit with the same arguments) suffices.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import OmegaConf

from ._job import JobSide, uses_job_id
from ._submitting import SubmitSide

log = logging.getLogger(__name__)

# Before the user's `hydra.launcher.setup` lines: srun ends a job's other tasks when one
# exits non-zero (a failed rank), instead of waiting for them.
KILL_ON_BAD_EXIT = "export SLURM_KILL_BAD_EXIT=1"


class _AppSubmititLauncher(SubmitSide, JobSide, BaseSubmititLauncher):
    def __init__(self, **params: Any) -> None:
        # app's own options, not submitit's (they must not reach its executor).
        self.wait, self.dry_run = params.pop("wait", True), params.pop("dry_run", False)
        self.code_snapshot = params.pop("code_snapshot", False)
        self.max_num_failures = params.pop("max_num_failures", 0)
        self.snapshot_max_mb = params.pop("snapshot_max_mb", 100)
        self.followed = 0  # jobs of this sweep followed from an earlier submission
        self.jobs: dict[int, Any] = {}  # num -> job: followed, and submitted so far
        self.in_sbatch = False  # an array's submission has begun and not returned
        super().__init__(**params)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
               ) -> Sequence[JobReturn]:
        import submitit

        # SIGTERM to the submitting command (a closed session, `kill`) stops it as Ctrl-C does:
        # one line that says what was submitted, and what goes on.
        from app.signals import Terminated, exit_on, sigterm_raises

        assert self.config is not None
        # submitit prints its warnings on stdout and on stderr; Hydra's console handler (which
        # the records reach anyway) is enough in the submitting process.
        logging.getLogger("submitit").handlers.clear()
        if not self.wait:
            self._refuse_sweepers_that_need_results()
        try:
            with sigterm_raises():
                self.composed = {initial_job_idx + i: self._compose_and_validate(
                    list(o), initial_job_idx + i) for i, o in enumerate(job_overrides)}
        except KeyboardInterrupt as e:  # (a large sweep composes for a while: ~0.1 s a job)
            exit_on(e, log.error, f"nothing {'more ' if initial_job_idx else ''}was "
                                  f"submitted (the jobs' configs were being composed)")
        finally:
            self._forget_composed()
        nums = sorted(self.composed)
        overrides = {num: list(o) for num, o in zip(nums, job_overrides, strict=True)}
        executor = self._executor(submitit)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        if self.dry_run:
            self._dry_run(executor, nums, overrides)
        from ._dry_run import invalid

        bad = invalid(self.params, self.max_num_failures)
        if bad:
            log.error("%s (nothing was submitted)", "; ".join(bad))
            sys.exit(2)
        from ._pending import refuse_never_runs

        refuse_never_runs(self._EXECUTOR, self.params, len(nums))  # (no node can: exit 2)
        mode = self._sweep_mode()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if mode is not None:
            sweep_dir.chmod(mode)
        log.info("submitit '%s' sweep output dir: %s", self._EXECUTOR, sweep_dir)
        for num in nums:
            log.info("\t#%d : %s", num, " ".join(filter_overrides(overrides[num])))
        if self._EXECUTOR == "slurm":
            from app._private import set_slurm_watcher

            from ._slurm_states import SlurmStates

            # Shared by every SlurmJob of this process (submitit's design): jobs register
            # with it when created, so it is set before submitting.
            set_slurm_watcher(SlurmStates())
        try:
            with sigterm_raises():
                jobs = self._submit(submitit, executor, overrides, sweep_dir)
                if not self.wait:
                    return self._detached(jobs, overrides, sweep_dir)
                log.info("waiting for the results of %s job%s %s (Ctrl-C stops the waiting, "
                         "not the jobs)", self._EXECUTOR, "s" * (len(jobs) > 1),
                         ", ".join(jobs[num].job_id for num in nums))
                return [self._result(jobs[num], num, overrides[num]) for num in nums]
        except KeyboardInterrupt as e:
            if self._EXECUTOR != "slurm":
                if isinstance(e, Terminated):  # (a Ctrl-C reaches them from the terminal)
                    import os

                    for job in self.jobs.values():  # a local job's id is its process's pid,
                        # which passes SIGTERM on to its task: it stops at a step and saves
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(job.job_id), signal.SIGTERM)
                    exit_on(e, log.error, "the local jobs were stopped (each saves a "
                                          "checkpoint); the same command resumes them")
                raise  # local jobs are this command's children: they get the Ctrl-C too
            if not self.jobs and not self.in_sbatch:
                exit_on(e, log.error, "nothing was submitted")
            from ._job_report import report_left

            report_left(self.jobs, self._run_dir)
            exit_on(e, log.error, "the waiting ended, not the jobs")

    def _sweep_mode(self) -> int | None:
        """`hydra.sweep.mode` (octal, as the stock launcher applies it to the sweep directory),
        or exit 2 before anything is submitted."""
        assert self.config is not None
        if "mode" not in self.config.hydra.sweep:
            return None
        mode = str(self.config.hydra.sweep.mode)
        try:
            return int(mode, 8)
        except ValueError:
            log.error("hydra.sweep.mode=%s: give the sweep directory's permissions in octal, "
                      "as chmod takes them (750) (nothing was submitted)", mode)
            sys.exit(2)

    def _executor(self, submitit: Any) -> Any:
        """submitit's executor, set up as in the stock launcher: plugin keys that are not shared
        by every executor get the executor's prefix (srun_args -> slurm_srun_args)."""
        params = dict(self.params)
        folder = params.pop("submitit_folder")
        init = {f"{self._EXECUTOR}_max_num_timeout": params.pop("max_num_timeout")} \
            if "max_num_timeout" in params else {}
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=folder, **init)
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in shared else f"{self._EXECUTOR}_{k}": v
                                      for k, v in params.items()})
        if self._EXECUTOR == "slurm":
            from ._recover import teardown_lines

            executor.update_parameters(slurm_setup=self._setup_lines(), slurm_teardown=(
                teardown_lines(str(folder), self.max_num_failures)))
        return executor

    def _setup_lines(self) -> list[str]:
        """app's line, then the user's `setup` lines (they add to it, as to nothing in the
        stock launcher)."""
        return [KILL_ON_BAD_EXIT, *(self.params.get("setup") or [])]

    def _refuse_sweepers_that_need_results(self) -> None:
        assert self.config is not None
        sweeper = str(OmegaConf.select(self.config, "hydra.sweeper._target_", default=""))
        if sweeper and not sweeper.endswith(".BasicSweeper"):
            log.error("hydra.launcher.wait=false: the sweeper %s chooses each trial from the "
                      "results of the others, which a command that does not wait never sees; "
                      "submit it with wait=true (nothing was submitted)", sweeper)
            sys.exit(2)

    def _detached(self, jobs: dict[int, Any], overrides: dict[int, list[str]],
                  sweep_dir: Path) -> list[JobReturn]:
        """wait=false: one line per job and how to follow them; no result is waited for."""
        for num in sorted(jobs):
            log.info("job #%d (%s job %s): %s -> %s", num, self._EXECUTOR, jobs[num].job_id,
                     " ".join(filter_overrides(overrides[num])) or "(no overrides)",
                     self._run_dir(num))
        ids = sorted({job.job_id.split("_")[0] for job in jobs.values()})
        counted = f"{len(jobs) - self.followed} job(s) submitted" + (
            f", {self.followed} from an earlier submission" if self.followed else "")
        log.info("%s; this command does not wait for them. Follow them with "
                 "`python -m app.status %s`, summarise them once they end with "
                 "`python -m app.report %s`, cancel them with `scancel %s`", counted,
                 sweep_dir, sweep_dir, " ".join(ids))
        returns = []
        for num in sorted(jobs):
            ret = JobReturn(overrides=overrides[num], status=JobStatus.COMPLETED,
                            working_dir=str(self._run_dir(num)))
            ret.return_value = None  # (not waited for)
            returns.append(ret)
        return returns

    def _dry_run(self, executor: Any, nums: list[int], overrides: dict[int, list[str]]) -> None:
        """Print what would be submitted and what the cluster would refuse; exit (0 if it
        fits, 2 if not) without submitting."""
        from ._dry_run import report

        sys.exit(report(executor, self.params, self.max_num_failures, overrides,
                        {num: self._run_dir(num) for num in nums}, self._EXECUTOR == "slurm",
                        OmegaConf.select(self.config, "hydra.sweeper.max_batch_size")))

    def _run_dir(self, num: int) -> Path:
        """Job `num`'s run directory; one named by a job id not given yet (before submission,
        `hydra.sweep.subdir=${hydra.job.id}`) is shown as `SWEEP/(job id)`."""
        config = self.composed[num]
        if uses_job_id(config) and OmegaConf.is_missing(config.hydra.job, "id"):
            return Path(str(config.hydra.sweep.dir), "(job id)")
        return Path(str(config.hydra.sweep.dir), str(config.hydra.sweep.subdir))

    def _result(self, job: Any, num: int, overrides: list[str]) -> JobReturn:
        from app.sweeps.job_end import describe, outcomes

        from ._pending import wait

        wait(job, num, self)  # as job.wait(), naming a job that waits for a person (_pending)
        while self._requeued(job):
            log.warning("job #%d (slurm job %s) was requeued after a fault (see its log: %s); "
                        "waiting for it again", num, job.job_id, job.paths.stderr)
            wait(job, num, self)
        state = job.state.split()[0].upper() if self._EXECUTOR == "slurm" else ""
        # A task that exited 0 wrote its result: a missing one is a slow file system.
        results = outcomes(job, grace_s=15 if state in ("", "COMPLETED") else 0)
        if all(r is not None and r[0] == "success" for r in results):
            return results[0][1]
        task, what, task_log = describe(job, state, results)
        # A task without a result was ended by Slurm: its state says how. Otherwise the job
        # raised, and Slurm's state (not final yet) would tell no more.
        ended_by_slurm = bool(state) and None in results
        how = ({"GONE": "ended"}.get(state, state)) if ended_by_slurm else "failed"
        where = "" if task is None else f" in task {task}"
        log.error("job #%d (%s job %s) %s%s: %s (log: %s)", num, self._EXECUTOR, job.job_id,
                  how, where, what, task_log)
        if ended_by_slurm:
            task_part = "" if task is None else f", task {task}"
            self._record_end(num, how.lower(), f"slurm job {job.job_id}{task_part}: {what}")
        # Reported here and in the sweep's summary (its summary ends the command non-zero);
        # the sweep itself goes on, and NaN is what sweepers take for a failed trial.
        nan = JobReturn(overrides=overrides, status=JobStatus.COMPLETED,
                        working_dir=str(self._run_dir(num)))
        nan.return_value = math.nan  # the public setter (the field is `_return_value`)
        return nan

    def _requeued(self, job: Any) -> bool:
        """Whether a job seen ended runs again (see _recover.requeued)."""
        if self._EXECUTOR != "slurm" or self.max_num_failures <= 0:
            return False
        from ._recover import requeued

        return requeued(job)

    def _record_end(self, num: int, status: str, error: str) -> None:
        """Record in the run directory how Slurm ended the job, for the sweep's summary (which
        lists run directories and fails the command for every job not completed): a task that
        was killed wrote nothing, and a job cancelled while queued has no directory yet. A
        final record the job's rank 0 wrote itself (it may be writing it now) is left alone."""
        import json

        from app.files import write_text_atomically
        from app.reporting.results import RESULT

        run_dir = self._run_dir(num)
        (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
        overrides = run_dir / ".hydra" / "overrides.yaml"
        if not overrides.exists():
            OmegaConf.save(self.composed[num].hydra.overrides.task, overrides)
        record = run_dir / RESULT
        try:
            earlier = json.loads(record.read_text()) if record.is_file() else {}
        except (OSError, ValueError):
            earlier = {}
        if earlier.get("status") not in (None, "running"):
            return
        write_text_atomically(record, json.dumps({"status": status, "wall_s": earlier.get(
            "wall_s"), "error": error}, indent=2) + "\n")


class AppSlurmLauncher(_AppSubmititLauncher):
    _EXECUTOR = "slurm"


class AppLocalLauncher(_AppSubmititLauncher):
    _EXECUTOR = "local"
