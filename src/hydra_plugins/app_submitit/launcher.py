"""hydra-submitit-launcher, extended for app: the jobs' configs are composed and validated
before anything is submitted (_job.py); a job that ends without a result from every task ends
the wait in one line; Ctrl-C stops the waiting, not the jobs. Requeues after a time limit are
submitit's own (the stock `checkpoint`); after a killed task or a failed node, _recover's."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import OmegaConf

from . import log, refuse
from ._job import JobSide, uses_job_id
from ._submitting import SubmitSide


class _AppSubmititLauncher(SubmitSide, JobSide, BaseSubmititLauncher):
    def __init__(self, **params: Any) -> None:
        # app's own options, not submitit's (they must not reach its executor).
        self.wait, self.dry_run = params.pop("wait", True), params.pop("dry_run", False)
        if self.dry_run not in (True, False, "json"):
            refuse("hydra.launcher.dry_run=%s: give true (the dry run's report), json (the "
                   "report as one JSON document) or false", self.dry_run)
        if self.dry_run == "json":  # stdout holds the document alone: Hydra's lines go to stderr
            for handler in logging.getLogger().handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
                    handler.setStream(sys.stderr)
        self.code_snapshot = params.pop("code_snapshot", False)
        self.max_num_failures = params.pop("max_num_failures", 0)
        self.snapshot_max_mb = params.pop("snapshot_max_mb", 100)
        self.followed = 0  # jobs followed from an earlier submission
        self.jobs: dict[int, Any] = {}  # num -> job: followed, and submitted so far
        self.in_sbatch = False
        super().__init__(**params)
        # srun ends a job's other tasks at once when one exits non-zero (a failed rank)
        self.setup_lines = ["export SLURM_KILL_BAD_EXIT=1", *(self.params.get("setup") or [])]

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
               ) -> Sequence[JobReturn]:
        import submitit

        # SIGTERM to the submitting command (a closed session, `kill`) stops it as Ctrl-C does.
        from app.signals import Terminated, exit_on, sigterm_raises

        from ._dry_run import invalid, refuse_never_runs, report

        assert self.config is not None
        # (submitit's warnings reach Hydra's console handler anyway: not printed twice)
        logging.getLogger("submitit").handlers.clear()
        sweeper = str(OmegaConf.select(self.config, "hydra.sweeper._target_", default=""))
        if not self.wait and sweeper and not sweeper.endswith(".BasicSweeper"):
            refuse("hydra.launcher.wait=false: the sweeper %s chooses each trial from the "
                   "results of the others, which a command that does not wait never sees; "
                   "submit it with wait=true", sweeper)
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
        slurm = self._EXECUTOR == "slurm"
        if self.dry_run:
            sys.exit(report(executor, self.params, self.max_num_failures, overrides,
                            {num: self._run_dir(num) for num in nums}, slurm,
                            OmegaConf.select(self.config, "hydra.sweeper.max_batch_size"),
                            self.dry_run == "json"))
        bad = invalid(self.params, self.max_num_failures)
        if bad:
            refuse("%s", "; ".join(bad))
        if slurm:
            refuse_never_runs(self.params, len(nums))
        mode = self.config.hydra.sweep.get("mode")  # (applied as the stock launcher does)
        if mode is not None and not re.fullmatch("[0-7]+", str(mode)):
            refuse("hydra.sweep.mode=%s: give the sweep directory's permissions in octal, as "
                   "chmod takes them (750)", mode)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if mode is not None:
            sweep_dir.chmod(int(str(mode), 8))
        log.info("submitit '%s' sweep output dir: %s", self._EXECUTOR, sweep_dir)
        for num in nums:
            log.info("\t#%d : %s", num, " ".join(filter_overrides(overrides[num])))
        if slurm:
            from app._private import set_slurm_watcher

            from ._slurm_states import SlurmStates

            set_slurm_watcher(SlurmStates())  # (jobs register with it as they are created)
        try:
            with sigterm_raises():
                jobs = self._submit(submitit, executor, overrides, sweep_dir)
                if not self.wait:
                    return self._detached(jobs, overrides, sweep_dir)
                log.info("waiting for the results of %s job%s %s (Ctrl-C stops the waiting, "
                         "not the jobs)", self._EXECUTOR, "s" * (len(jobs) > 1),
                         ", ".join(jobs[num].job_id for num in nums))
                from ._pending import Stuck

                stuck = Stuck(self.params, {job.job_id: n for n, job in jobs.items()}) \
                    if slurm else None
                return [self._result(jobs[num], num, overrides[num], stuck) for num in nums]
        except KeyboardInterrupt as e:
            if not slurm:
                if isinstance(e, Terminated):  # (a Ctrl-C reaches them from the terminal)
                    for job in self.jobs.values():  # a local job's id is its process's pid,
                        # which passes SIGTERM on to its task: it stops at a step and saves
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(job.job_id), signal.SIGTERM)
                    exit_on(e, log.error, "the local jobs were stopped (each saves a "
                                          "checkpoint); the same command resumes them")
                raise  # local jobs are this command's children: they get the Ctrl-C too
            if not self.jobs and not self.in_sbatch:
                exit_on(e, log.error, "nothing was submitted")
            self._report_left()
            exit_on(e, log.error, "the waiting ended, not the jobs")

    def _executor(self, submitit: Any) -> Any:
        """submitit's executor, set up as the stock launcher does."""
        params = dict(self.params)
        folder = params.pop("submitit_folder")
        init = {f"{self._EXECUTOR}_max_num_timeout": params.pop("max_num_timeout")} \
            if "max_num_timeout" in params else {}
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=folder, **init)
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in shared else f"{self._EXECUTOR}_{k}": v
                                      for k, v in params.items()})
        if self._EXECUTOR == "slurm":  # (after srun: _recover's main, with srun's status)
            executor.update_parameters(slurm_setup=self.setup_lines, slurm_teardown=[
                "app_srun_status=$?", f"{sys.executable} -m hydra_plugins.app_submitit._recover "
                f"\"$app_srun_status\" '{folder}' {self.max_num_failures}",
                "exit $app_srun_status"])
        return executor

    def _detached(self, jobs: dict[int, Any], overrides: dict[int, list[str]],
                  sweep_dir: Path) -> list[JobReturn]:
        """wait=false: one line per job and how to follow them."""
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
        return [self._returned(num, overrides[num], None) for num in sorted(jobs)]

    def _returned(self, num: int, overrides: list[str], value: Any) -> JobReturn:
        """A result of no job's making: NaN (what sweepers take for a failed trial), or None."""
        ret = JobReturn(overrides=overrides, status=JobStatus.COMPLETED,
                        working_dir=str(self._run_dir(num)))
        ret.return_value = value  # (the public setter: the field is `_return_value`)
        return ret

    def _run_dir(self, num: int) -> Path:
        """Job `num`'s run directory (`SWEEP/(job id)` before a job id names it)."""
        config = self.composed[num]
        if uses_job_id(config) and OmegaConf.is_missing(config.hydra.job, "id"):
            return Path(str(config.hydra.sweep.dir), "(job id)")
        return Path(str(config.hydra.sweep.dir), str(config.hydra.sweep.subdir))

    @staticmethod
    def _wait(job: Any, stuck: Any) -> None:  # job.wait(), naming the jobs that wait for a person
        while not job.done():
            if stuck is not None:
                stuck.check(job.watcher)  # (the states polled anyway: no call to Slurm)
            time.sleep(1)

    def _result(self, job: Any, num: int, overrides: list[str], stuck: Any) -> JobReturn:
        from app.sweeps.job_end import describe, outcomes

        from ._recover import requeued

        slurm = self._EXECUTOR == "slurm"
        self._wait(job, stuck)
        while slurm and self.max_num_failures > 0 and requeued(job):
            self._wait(job, stuck)  # (`stuck` names the requeue)
        state = job.state.split()[0].upper() if slurm else ""
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
        # the sweep itself goes on.
        return self._returned(num, overrides, math.nan)

    def _record_end(self, num: int, status: str, error: str) -> None:
        """Record how Slurm ended the job, for the sweep's summary (a killed task wrote nothing);
        a final record the job's rank 0 wrote itself is kept."""
        from app.files import write_text_atomically
        from app.reporting.results import RESULT, read_result

        run_dir = self._run_dir(num)
        run_dir.mkdir(parents=True, exist_ok=True)
        earlier = read_result(run_dir)
        if earlier.get("status") in (None, "running", f"unreadable {RESULT}"):
            write_text_atomically(run_dir / RESULT, json.dumps({
                "status": status, "wall_s": earlier.get("wall_s"), "error": error},
                indent=2) + "\n")

    def _report_left(self) -> None:
        """After Ctrl-C: the jobs that go on without this command."""
        from app.slurm import FINAL

        if not self.jobs:
            log.error("interrupted while submitting: a job already submitted goes on (list "
                      "yours with `squeue -u $USER`)")
            return
        with contextlib.suppress(KeyboardInterrupt):  # (a second Ctrl-C: the states known)
            next(iter(self.jobs.values())).watcher.update()  # (one, shared by every job)
        for num, job in sorted(self.jobs.items()):
            state = job.watcher.get_state(job.job_id, mode="cache").split()[0]
            if state in FINAL or all(job.task(t).paths.result_pickle.exists()
                                     for t in range(job.num_tasks)):
                continue
            now = {"UNKNOWN": "may be queued or running", "PENDING": "is queued (PENDING)"
                   }.get(state, f"is {state}")
            log.warning("job #%d (slurm job %s) %s and goes on without this command: watch it "
                        "with `squeue -j %s` (log: %s), cancel it with `scancel %s`", num,
                        job.job_id, now, job.job_id, self._run_dir(num) / "train.log",
                        job.job_id)


class AppSlurmLauncher(_AppSubmititLauncher):
    _EXECUTOR = "slurm"


class AppLocalLauncher(_AppSubmititLauncher):
    _EXECUTOR = "local"
