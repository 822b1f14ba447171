"""Job states for the submitting command, as `app.slurm.states` reads them (scontrol, then sacct
where there is accounting): submitit reads sacct only, and without accounting (many small
clusters) a job that ends without a result from every task would be waited for forever."""

from __future__ import annotations

import time

from app import slurm
from app._private import slurm_info_watcher

from . import log


class SlurmStates(slurm_info_watcher()):  # submitit internals: see app._private
    """submitit's watcher (a poll at least every 60 s: well under MinJobAge)."""

    _failed = False  # (Slurm did not answer: told once)

    def is_done(self, job_id: str, mode: str = "standard") -> bool:
        return self.get_state(job_id, mode=mode).split()[0].upper() in slurm.FINAL

    def forget(self, job_id: str) -> None:
        """Watch `job_id` again: it was seen in a final state, then requeued."""
        self._finished.discard(job_id)
        self._info_dict.pop(job_id, None)

    def update(self) -> None:
        ids = sorted(self._registered - self._finished)
        if not ids:
            return
        self._num_calls += 1
        known = slurm.states(ids)
        if known is None and not self._failed:  # (states stay as they were)
            log.warning("Slurm does not answer (scontrol show job failed): job states may lag")
        self._failed = self._failed or known is None
        self._info_dict.update({job_id: {"JobID": job_id, "State": job.state,
                                         "Reason": job.reason, "Restarts": job.restarts}
                                for job_id, job in (known or {}).items()})
        self._last_status_check = time.time()
        self._finished.update(job_id for job_id in ids if self.is_done(job_id, mode="cache"))

    def waiting(self) -> dict[str, tuple[str, str]]:
        """Each job not finished -> (state, Slurm's reason), as last polled."""
        return {job_id: (fields["State"], fields.get("Reason", ""))
                for job_id in self._registered - self._finished
                if (fields := self._info_dict.get(job_id, {})).get("State")}

    def restarts(self) -> dict[str, int]:
        """Each job -> the times Slurm requeued it, as last polled."""
        return {job_id: fields.get("Restarts", 0) for job_id, fields in self._info_dict.items()}
