"""Job states from sacct, or from squeue where sacct fails: submitit reads sacct only, and
without accounting (many small clusters) a job that ends without a result from every task
would be waited for forever. squeue lists a finished job for MinJobAge seconds (GONE after)."""

from __future__ import annotations

import subprocess
import time

from app._private import slurm_info_watcher
from app.slurm import FINAL

from . import log

GONE = "GONE"  # ours, not Slurm's: squeue no longer lists the job
assert GONE in FINAL


class SlurmStates(slurm_info_watcher()):  # submitit internals: see app._private
    """submitit's watcher, reading squeue once sacct has failed (told once, not every poll)."""

    def __init__(self) -> None:
        super().__init__()  # (a poll at least every 60 s: well under MinJobAge)
        self.source = "sacct"
        self._squeue_failed = False

    def is_done(self, job_id: str, mode: str = "standard") -> bool:
        # sacct writes "CANCELLED by 1000"; squeue "CANCELLED".
        state = self.get_state(job_id, mode=mode).split()
        return bool(state) and state[0].upper() in FINAL

    def forget(self, job_id: str) -> None:
        """Watch `job_id` again: it was seen in a final state, then requeued."""
        self._finished.discard(job_id)
        self._info_dict.pop(job_id, None)

    def update(self) -> None:  # (as submitit's, which warns at every poll where sacct fails)
        ids = sorted({x.split("_")[0] for x in self._registered - self._finished})
        if not ids:
            return
        self._num_calls += 1
        info = self._sacct() if self.source == "sacct" else None
        if info is None and self.source == "squeue":
            info = self._squeue(ids)
        elif info is not None:
            self._add_reasons(info)
        if info is not None:
            self._info_dict.update(info)
        self._last_status_check = time.time()
        for job_id in self._registered - self._finished:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)

    def _run(self, command: list[str]) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return subprocess.CompletedProcess(command, -1, "", str(e))

    def _sacct(self) -> dict[str, dict[str, str]] | None:
        done = self._run(self._make_command())
        if done.returncode != 0:
            why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[0]
            log.warning("sacct failed (%s): job states come from squeue", why)
            self.source = "squeue"
            return None
        return self.read_info(done.stdout)

    def _squeue(self, ids: list[str]) -> dict[str, dict[str, str]] | None:
        done = self._run(["squeue", "--noheader", "--array", "--states=all",
                          "--format=%i|%T|%r", f"--jobs={','.join(ids)}"])
        # squeue fails with "Invalid job id specified" only when it lists none of the jobs.
        if done.returncode != 0 and "Invalid job id" not in done.stderr:
            if not self._squeue_failed:  # states stay as they were; tried again next poll
                log.warning("squeue failed (%s): job states may lag", done.stderr.strip())
            self._squeue_failed = True
            return None
        info = {}
        for line in done.stdout.splitlines():
            job_id, _, rest = line.strip().partition("|")
            state, _, reason = rest.partition("|")
            if job_id:
                info[job_id] = {"JobID": job_id, "State": state, "Reason": reason}
        for job_id in self._registered - self._finished:
            if job_id not in info and job_id.split("_")[0] in ids:
                info[job_id] = {"JobID": job_id, "State": GONE}
        return info

    def _add_reasons(self, info: dict[str, dict[str, str]]) -> None:
        """sacct says no reason why a job waits: squeue, asked only while one is pending."""
        pending = sorted({job_id.split("_")[0] for job_id, fields in info.items()
                          if fields.get("State", "").upper().startswith("PENDING")})
        waiting = self._squeue(pending) if pending else None
        for job_id, fields in (waiting or {}).items():
            if job_id in info and fields["State"] != GONE:
                info[job_id] = {**info[job_id], "Reason": fields["Reason"]}

    def waiting(self) -> dict[str, tuple[str, str]]:
        """Each job not finished -> (state, Slurm's reason or ""), as last polled."""
        return {job_id: (fields["State"], fields.get("Reason", ""))
                for job_id in self._registered - self._finished
                if (fields := self._info_dict.get(job_id, {})).get("State")}
