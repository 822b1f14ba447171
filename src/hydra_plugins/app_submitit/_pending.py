"""Jobs that would wait forever: refused before sbatch, named while the command waits.

sbatch accepts a job that no node of its partition can ever run (more CPUs than a node has,
more nodes than the partition, over its MaxTime): it pends with Reason=PartitionConfig (or
PartitionNodeLimit, PartitionTimeLimit) until someone cancels it, and the waiting command
said only "waiting for the results". Before submitting, the launcher checks the request
against the partition's nodes as the dry run does (_dry_run.never_runs) and refuses in one
line. While it waits, a job whose reason will not resolve by itself (a held job, a partition
down, a limit of its QOS or account it exceeds) is named once, and again when the reason
changes, from the states the launcher polls anyway (_slurm_states: squeue's reason), so that
this adds no call to Slurm. The module name starts with "_": Hydra's plugin scan skips it.
"""

from __future__ import annotations

import logging
import sys
import time
import weakref
from pathlib import Path
from typing import Any

log = logging.getLogger("hydra_plugins.app_submitit.launcher")  # (the launcher's lines)

# Slurm's reasons for a pending job that only a person changes (beside holds: `held`).
# Others (Resources, Priority, BeginTime, Dependency, ReqNodeNotAvail, a QOS's running
# limits ...) pass when other jobs end or nodes come back.
TOO_LARGE = {"PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints"}
NEVER = TOO_LARGE | {"PartitionDown", "PartitionInactive", "DependencyNeverSatisfied",
                     "InvalidAccount", "InvalidQOS", "QOSNotAllowed", "AccountNotAllowed"}


def held(reason: str) -> bool:
    """JobHeldUser, JobHeldAdmin, "launch failed requeued held", "job requeued in held state"
    (squeue writes some with spaces, scontrol with underscores)."""
    return reason.startswith("JobHeld") or "held" in reason.replace("_", " ").split()


def stuck(state: str, reason: str) -> bool:
    """Whether a job waits for something that does not come by itself: a person must act."""
    if not state.upper().startswith("PENDING"):
        return False
    # QOSMaxCpuPerJobLimit, AssocMaxWallDurationPerJobLimit ...: the job itself is over a
    # limit of its QOS or account (not a count of running jobs, which goes down).
    return held(reason) or reason in NEVER or "PerJob" in reason


def refuse_never_runs(executor: str, params: dict[str, Any], num_jobs: int) -> None:
    """Exit 2 before sbatch when the partition could never run the job (nothing submitted);
    nothing is checked when Slurm does not answer, or for a partition the cluster lacks
    (sbatch refuses that itself, in its own words)."""
    if executor != "slurm":
        return
    from app import slurm

    from ._dry_run import never_runs

    partitions, nodes = slurm.partitions(), slurm.nodes()
    if partitions is None or nodes is None:
        log.debug("Slurm did not answer: the request is not checked against its nodes")
        return
    found = never_runs(params, partitions, nodes)
    if found:
        log.error("Slurm would never start %s (%s wait forever): %s. Ask for less or choose "
                  "another hydra.launcher.partition (hydra.launcher.dry_run=true checks a "
                  "request; nothing was submitted)", "the job" if num_jobs == 1 else
                  f"the {num_jobs} jobs", "it would" if num_jobs == 1 else "they would",
                  "; ".join(found))
        sys.exit(2)


class Stuck:
    """What was said of each job of one launch (job id -> the reason named)."""

    def __init__(self, params: dict[str, Any], sweep_dir: Path) -> None:
        self.params, self.sweep_dir = params, sweep_dir
        self.said: dict[str, str] = {}
        self.nums: dict[str, int] | None = None  # job id -> job number (submission.json)

    def check(self, watcher: Any, num: int, job_id: str) -> None:
        """Name each job that became stuck, or stuck for another reason, or no longer stuck,
        since the last check (from the watcher's last poll: no call to Slurm)."""
        for other, (state, reason) in sorted(watcher.waiting().items()):
            if stuck(state, reason):
                if self.said.get(other) != reason:
                    self.said[other] = reason
                    log.warning("%s %s", self._label(other, num, job_id),
                                self._why(other, reason))
            elif other in self.said:
                now = state + (f" ({reason})" if reason and reason != "None" else "")
                log.info("%s no longer waits for %s: %s", self._label(other, num, job_id),
                         self.said.pop(other), now)

    def _label(self, other: str, num: int, job_id: str) -> str:
        if self.nums is None:
            self.nums = _job_numbers(self.sweep_dir)
        known = num if other == job_id else self.nums.get(other)
        return f"slurm job {other}" if known is None else f"job #{known} (slurm job {other})"

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
        """What the job asks against what the partition's nodes offer (Slurm asked now)."""
        from app import slurm

        from ._dry_run import never_runs

        p = self.params
        cpus = (p.get("cpus_per_task") or 1) * p["tasks_per_node"]
        memory = "" if p.get("mem_gb") is None else f", {p['mem_gb']} GB"
        asks = (f"it asks {p['nodes']} node(s) with {cpus} CPU(s){memory} and "
                f"{p.get('gpus_per_node') or 0} GPU(s) each, for {p['timeout_min']} min")
        partitions, nodes = slurm.partitions(), slurm.nodes()
        found = never_runs(p, partitions, nodes) if partitions and nodes is not None else None
        return f"{asks}; {'; '.join(found)}" if found else asks


def _job_numbers(sweep_dir: Path) -> dict[str, int]:
    """Slurm job id -> job number, from the sweep's record ({} when it cannot be read)."""
    from app.errors import RecordUnreadable
    from app.sweeps import record as sweep_record

    try:
        record = sweep_record.read(sweep_dir)
    except RecordUnreadable:
        return {}
    return {job["job_id"]: num for num, job in sweep_record.jobs_by_num(record).items()}


_launches: weakref.WeakKeyDictionary[Any, Stuck] = weakref.WeakKeyDictionary()


def wait(job: Any, num: int, launcher: Any) -> None:
    """`job.wait()` (a result from every task, or a final state of the job), naming, for a
    Slurm job, each job of the launch that waits for something that does not come by itself
    (`Stuck.check`, once a second, from the states submitit's watcher polls anyway)."""
    if launcher._EXECUTOR != "slurm":
        job.wait()
        return
    if launcher not in _launches:
        _launches[launcher] = Stuck(launcher.params,
                                    Path(str(launcher.config.hydra.sweep.dir)))
    watching = _launches[launcher]
    while not job.done():  # (as job.wait(): done() polls Slurm when its delay has passed)
        watching.check(job.watcher, num, job.job_id)
        time.sleep(1)
