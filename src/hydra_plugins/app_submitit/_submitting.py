"""The submission, a mixin of `launcher._AppSubmititLauncher`: arrays that fit the cluster,
each recorded as it is submitted, following the jobs an earlier submission left queued."""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from omegaconf import open_dict, read_write

from . import log, refuse


class SubmitSide:
    def _submit(self, submitit: Any, executor: Any, overrides: dict[int, list[str]],
                sweep_dir: Path) -> dict[int, Any]:
        """Submit the jobs an earlier submission left in no queue (the others are followed).
        One command at a time: another one submitting there would submit the same jobs."""
        from app.errors import LockHeld
        from app.rundir.lock import held_now

        try:
            with held_now(sweep_dir / ".submit.lock"):
                return self._submit_locked(submitit, executor, overrides, sweep_dir)
        except LockHeld as e:
            refuse("hydra.sweep.dir=%s is being submitted to by another command (%s): run this "
                   "one again once it has submitted (it then follows the same jobs), or give "
                   "it another hydra.sweep.dir", sweep_dir, e)

    def _submit_locked(self, submitit: Any, executor: Any, overrides: dict[int, list[str]],
                       sweep_dir: Path) -> dict[int, Any]:
        from app.errors import RecordUnreadable
        from app.reporting.results import read_result
        from app.sweeps import record as sweep_record
        from app.sweeps.dirs import conflicts

        nums = sorted(overrides)
        clashes = conflicts(overrides, {num: self._run_dir(num) for num in nums})
        if clashes:
            refuse("hydra.sweep.dir=%s was used by a sweep of other values: %s. Its run "
                   "directories would be resumed as these jobs'; give this sweep a new "
                   "hydra.sweep.dir", sweep_dir, "; ".join(clashes))
        jobs = self.jobs = {}  # (this batch's)
        if self._EXECUTOR == "slurm":
            try:
                record = sweep_record.read(sweep_dir)
            except RecordUnreadable as e:
                refuse("%s: the jobs of the earlier submission are unknown, and one still "
                       "queued or running would be submitted again. Check squeue, then move "
                       "the file aside to submit", e)
            for num, (job_id, state) in sweep_record.standing(record, overrides).items():
                log.info("job #%d (slurm job %s) is %s from an earlier submission of this "
                         "sweep: not submitted again", num, job_id, state)
                jobs[num] = submitit.SlurmJob(folder=self.params["submitit_folder"],
                                              job_id=job_id, tasks=range(self._num_tasks()))
            for num, job in sweep_record.jobs_by_num(record).items():
                if num in overrides and num not in jobs and job.get("job_id"):
                    ended = read_result(Path(job["run_dir"])).get("status") or "no result"
                    log.info("job #%d (slurm job %s) of an earlier submission of this sweep "
                             "ended %s: submitted again, to resume from its last checkpoint "
                             "(if it has one)", num, job["job_id"], ended)
        fresh = [num for num in nums if num not in jobs]
        self.followed = len(jobs)  # (from an earlier submission)
        if fresh and self._EXECUTOR == "slurm" and self.code_snapshot:
            from ._snapshot import take

            executor.update_parameters(slurm_setup=self.setup_lines + take(
                sweep_dir, self.snapshot_max_mb).setup_lines())
        self._record(list(jobs), overrides, sweep_dir, submitted=False)
        self._submit_arrays(submitit, executor, fresh, overrides, sweep_dir)
        return jobs

    def _record(self, nums: list[int], overrides: dict[int, list[str]], sweep_dir: Path,
                submitted: bool = True) -> None:
        """Record jobs `nums` as soon as they are known: a command stopped between two arrays
        leaves them on record, to be followed. (A job followed, `submitted=False`, keeps the
        config it was submitted with.)"""
        from app.sweeps import record as sweep_record

        for num in nums:  # (a run directory may be named by its job id)
            with read_write(job := self.composed[num].hydra.job), open_dict(job):
                job.id = self.jobs[num].job_id
        if self._EXECUTOR != "slurm" or not nums:
            return
        for num in nums if submitted else []:
            sweep_record.keep_config(self._run_dir(num), self.composed[num])
        sweep_record.write(sweep_dir, self._EXECUTOR, [
            {"num": num, "job_id": self.jobs[num].job_id, "overrides": overrides[num],
             "run_dir": str(self._run_dir(num)), "tasks": self._num_tasks()}
            for num in sorted(self.jobs)], self.wait, str(self.params["submitit_folder"]))

    def _num_tasks(self) -> int:
        return int(self.params["nodes"]) * int(self.params["tasks_per_node"])

    def _submit_arrays(self, submitit: Any, executor: Any, nums: list[int],
                       overrides: dict[int, list[str]], sweep_dir: Path) -> None:
        from submitit.core.utils import FailedJobError, FailedSubmissionError

        from ._dry_run import after, arrays

        parts, chain, _ = arrays(nums, self.params, self._EXECUTOR == "slurm")
        for i, part in enumerate(parts):
            if chain and i > 0:
                after(executor, self.params, self.jobs[parts[i - 1][0]].job_id.split("_")[0])
            said = io.StringIO()  # (submitit prints sbatch's refusal, and raises with it)
            self.in_sbatch = True
            try:
                with contextlib.redirect_stderr(said):
                    submitted = executor.map_array(
                        self, [overrides[n] for n in part], ["hydra.sweep.dir"] * len(part),
                        part, [f"job_id_for_{n}" for n in part],
                        [Singleton.get_state()] * len(part))
            except (FailedJobError, FailedSubmissionError) as e:
                self._refused_submission(e)
            sys.stderr.write(said.getvalue())
            self.jobs.update(zip(part, submitted, strict=True))
            self.in_sbatch = False
            self._record(part, overrides, sweep_dir)
            if len(parts) > 1:
                log.info("jobs #%d-#%d: %s job %s", part[0], part[-1], self._EXECUTOR,
                         submitted[0].job_id.split("_")[0])
        if chain:
            after(executor, self.params, None)

    def _refused_submission(self, e: Exception) -> None:
        """sbatch's own words (submitit's error holds its stderr), each line once, in one."""
        text = str(e)
        said = [line.strip().removeprefix("sbatch: error:").strip()
                for line in text.splitlines() if "sbatch: error" in line]
        reason = "; ".join(dict.fromkeys(said)) or (text.strip().splitlines()
                                                     or [type(e).__name__])[0]
        more = "" if not self.jobs else (
            f"; jobs submitted before it go on: {', '.join(j.job_id for j in self.jobs.values())}")
        log.error("%s refused the submission: %s (check it first with "
                  "hydra.launcher.dry_run=true)%s", self._EXECUTOR, reason, more)
        sys.exit(1)
