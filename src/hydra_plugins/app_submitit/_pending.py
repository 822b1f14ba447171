"""Jobs that wait for a person (held, a partition down, a request over a per-job limit), named
while the submitting command waits: once per reason, from the states polled anyway; and each
requeue of a job, once."""

from __future__ import annotations

from typing import Any

from . import log

# Slurm's reasons for a pending job that only a person changes (beside holds: `held`).
# Others (Resources, Priority, BeginTime, Dependency, ReqNodeNotAvail, a QOS's running
# limits ...) pass when other jobs end or nodes come back.
TOO_LARGE = {"PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints"}
NEVER = TOO_LARGE | {"PartitionDown", "PartitionInactive", "DependencyNeverSatisfied",
                     "InvalidAccount", "InvalidQOS", "QOSNotAllowed", "AccountNotAllowed"}


def held(reason: str) -> bool:
    """JobHeldUser, "launch failed requeued held" (squeue's spaces are scontrol's "_")..."""
    return reason.startswith("JobHeld") or "held" in reason.replace("_", " ").split()


class Stuck:
    """What was said of each job of one launch (`nums`: Slurm job id -> job number)."""

    def __init__(self, params: dict[str, Any], nums: dict[str, int]) -> None:
        self.params, self.nums = params, nums
        self.said: dict[str, str] = {}  # job id -> the reason named
        self.requeues: dict[str, int] = {}  # job id -> the requeues named

    def _label(self, job_id: str) -> str:
        num = self.nums.get(job_id)
        return f"slurm job {job_id}" if num is None else f"job #{num} (slurm job {job_id})"

    def check(self, watcher: Any) -> None:
        """Name each job requeued, or stuck anew, or for another reason, or no longer stuck."""
        # A failed node, a preemption, a time limit, or a task killed by a signal (app's own
        # requeue): the job runs again by itself, which a submitter would otherwise not see.
        for job_id, restarts in sorted(watcher.restarts().items()):
            if restarts > self.requeues.get(job_id, 0):
                self.requeues[job_id] = restarts
                log.warning("%s was requeued (restart %d; its log says why): it runs again "
                            "and resumes from its last checkpoint", self._label(job_id),
                            restarts)
        for job_id, (state, reason) in sorted(watcher.waiting().items()):
            label = self._label(job_id)
            # QOSMaxCpuPerJobLimit, AssocMaxWallDurationPerJobLimit ...: the job itself is over
            # a limit of its QOS or account (not a count of running jobs, which goes down).
            if state.upper().startswith("PENDING") and (
                    held(reason) or reason in NEVER or "PerJob" in reason):
                if self.said.get(job_id) != reason:
                    self.said[job_id] = reason
                    log.warning("%s %s", label, self._why(job_id, reason))
            elif job_id in self.said:
                now = state + (f" ({reason})" if reason and reason != "None" else "")
                log.info("%s no longer waits for %s: %s", label, self.said.pop(job_id), now)

    def _why(self, job_id: str, reason: str) -> str:
        release, cancel = f"`scontrol release {job_id}`", f"`scancel {job_id}`"
        if reason.replace("_", " ") == "launch failed requeued held":
            return (f"is held: Slurm could not start it on its node (launch failed requeued "
                    f"held; the node's slurmd log says why, `scontrol show job {job_id}` "
                    f"which node). It waits until released: mend the node, then {release} "
                    f"lets it run; {cancel} ends it")
        if reason == "JobHeldAdmin":
            return (f"is held by an administrator (JobHeldAdmin): it waits until one releases "
                    f"it ({release}); {cancel} ends it")
        if held(reason):
            return (f"is held ({reason}): it waits until released; {release} lets it run, "
                    f"{cancel} ends it")
        if reason in TOO_LARGE:
            return (f"waits for what its partition cannot give ({reason}): {self._asks()}; "
                    f"it will not start by itself. {cancel}, then submit a smaller request "
                    f"(hydra.launcher.dry_run=true checks one) or another "
                    f"hydra.launcher.partition")
        if "PerJob" in reason:
            return (f"asks more than its QOS or account allows a job ({reason}): "
                    f"{self._asks()}; it will not start by itself (`sacctmgr show qos` "
                    f"shows the limits). {cancel}, then submit a smaller request")
        return (f"waits for what does not come by itself ({reason}): ask the cluster's "
                f"administrators, or {cancel} and submit elsewhere")

    def _asks(self) -> str:
        """What the job asks against what the partition's nodes offer."""
        from app import slurm

        from ._dry_run import never_runs

        p = self.params
        cpus = (p.get("cpus_per_task") or 1) * p["tasks_per_node"]
        memory = "" if p.get("mem_gb") is None else f", {p['mem_gb']} GB"
        asks = (f"it asks {p['nodes']} node(s) with {cpus} CPU(s){memory} and "
                f"{p.get('gpus_per_node') or 0} GPU(s) each, for {p['timeout_min']} min")
        found = never_runs(p, slurm.partitions(), slurm.nodes())
        return f"{asks}; {'; '.join(found)}" if found else asks
