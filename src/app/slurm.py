"""What Slurm says of jobs (`scontrol show job` until MinJobAge after their end, then `sacct`
where accounting exists) and of itself. Every query returns None (or leaves a job out) when
Slurm does not answer: the callers fall back on what the run directories say."""

from __future__ import annotations

import dataclasses
import os
import subprocess

# The states after which a job never runs again (GONE: ours, the controller no longer lists
# it). The others (PENDING, RUNNING, REQUEUED, SUSPENDED, PREEMPTED, which a requeue follows,
# COMPLETING, CONFIGURING ...) may still give a result.
FINAL = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
         "OUT_OF_MEMORY", "REVOKED", "TIMEOUT", "GONE"}
TIMEOUT_S = 30  # a Slurm command that takes longer counts as no answer


@dataclasses.dataclass
class Job:
    """One job (or array task, "ARRAY_TASK") as Slurm lists it."""

    job_id: str
    state: str  # PENDING, RUNNING, ... (see FINAL)
    reason: str = ""  # why it waits (Resources, Priority, BeginTime ...), "None" otherwise
    restarts: int = 0  # times it was requeued (preemption, time limit, node failure)
    nodes: str = ""
    exit_code: str = ""  # "0:0", "1:0", "0:9" (code:signal)

    @property
    def active(self) -> bool:
        """Queued or running: it will run (again) without being submitted again."""
        return self.state not in FINAL


def run(command: list[str]) -> str | None:
    """The command's output, or None when it fails or Slurm is not here."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _fields(line: str) -> dict[str, str]:
    """`scontrol -o` output: KEY=VALUE pairs (only free-text fields we do not read hold spaces)."""
    return dict(item.split("=", 1) for item in line.split() if "=" in item)


def _show(kind: str, key: str) -> dict[str, dict[str, str]] | None:
    """`scontrol show KIND`: each one's fields by its `key` field."""
    out = run(["scontrol", "--oneliner", "show", kind])
    return None if out is None else {
        f[key]: f for f in map(_fields, out.splitlines()) if key in f}


def _task_ids(spec: str) -> list[str]:
    """An array's pending tasks, "0-3,7%2" -> ["0", "1", "2", "3", "7"]."""
    ids: list[str] = []
    for part in spec.split("%")[0].split(","):
        low, _, high = part.partition("-")
        if low.isdigit() and (not high or high.isdigit()):
            ids += [str(i) for i in range(int(low), int(high or low) + 1)]
    return ids


def jobs() -> dict[str, Job] | None:
    """Every job the controller lists, by id ("123", or "123_4" for task 4 of array 123)."""
    listed = _show("job", "JobId")
    if listed is None:
        return None
    found: dict[str, Job] = {}
    for f in listed.values():
        job = Job(f["JobId"], f.get("JobState", "UNKNOWN"), f.get("Reason", ""),
                  int(f.get("Restarts", "0") or 0), f.get("NodeList", ""),
                  f.get("ExitCode", ""))
        array, tasks = f.get("ArrayJobId"), f.get("ArrayTaskId")
        ids = [f"{array}_{task}" for task in _task_ids(tasks)] if array and tasks else [
            job.job_id]
        found |= {one: dataclasses.replace(job, job_id=one) for one in ids}
    return found


def states(job_ids: list[str]) -> dict[str, Job] | None:
    """The jobs `job_ids` (None: Slurm does not answer); one listed nowhere is GONE: it ended."""
    known = jobs()
    if known is None:
        return None
    forgotten = [j for j in job_ids if j not in known]
    out = run(["sacct", "--noheader", "--parsable2", "--allocations",
               "--format=JobID,State,ExitCode,NodeList", f"--jobs={','.join(forgotten)}"]
              ) if forgotten else None
    for line in (out or "").splitlines():
        parts = line.split("|")
        if len(parts) == 4 and parts[0]:
            known[parts[0]] = Job(parts[0], parts[1].split()[0], "", 0, parts[3], parts[2])
    return {j: known.get(j, Job(j, "GONE")) for j in job_ids}


def requeued_since_start() -> bool:
    """Whether Slurm has requeued the job this process is a task of since this run of it
    began (a failed node, a preemption): it runs again by itself. At the signal that ends the
    run, Slurm lists the job PENDING with its restart count raised already."""
    job_id = os.environ.get("SLURM_JOB_ID")
    # Task 0 asks, whose line the job's log shows (not every task of a large job at once).
    ask = job_id and os.environ.get("SLURM_PROCID", "0") == "0"
    out = run(["scontrol", "--oneliner", "show", "job", job_id]) if ask else None
    f = _fields(out.splitlines()[0]) if out and out.strip() else {}
    began = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    return f.get("JobState", "GONE") not in FINAL and int(f.get("Restarts", "0") or 0) > began


def max_array_size() -> int | None:
    """MaxArraySize: an array's task ids must be below it (None: Slurm did not say)."""
    for line in (run(["scontrol", "show", "config"]) or "").splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "MaxArraySize" and value.strip().isdigit():
            return int(value)
    return None


def partitions() -> dict[str, dict[str, str]] | None:
    """Each partition's settings (MaxTime, MaxNodes, TotalNodes, State ...)."""
    return _show("partition", "PartitionName")


def nodes() -> dict[str, dict[str, str]] | None:
    """Each node's settings (CPUTot, RealMemory, Gres, Partitions, State ...)."""
    return _show("node", "NodeName")


def minutes(limit: str) -> float | None:
    """A Slurm time limit ("UNLIMITED", "60", "1:00:00", "2-12:00:00") in minutes, or None."""
    if not limit or limit in ("UNLIMITED", "INFINITE", "NONE"):
        return None
    days, _, rest = limit.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    hours, mins, secs = ([0] * (3 - len(parts)) + parts) if len(parts) > 1 else (0, parts[0], 0)
    return int(days or 0) * 1440 + hours * 60 + mins + secs / 60


def gpus(gres: str) -> int:
    """The GPUs a node's Gres offers ("gpu:4", "gpu:a100:8(S:0-1)", "(null)" -> 0)."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total
