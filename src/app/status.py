"""`python -m app.status DIR`: one line per job of a sweep directory (or for one run
directory): queued, running at step N of M, requeued K times, completed with its metric,
failed with its task and error, cancelled, preempted and waiting to run again.

States come from Slurm (`app.slurm`: the controller lists a job until MinJobAge after its
end, sacct where there is accounting) for the jobs a submission recorded
(`submission.json`), and from the run directories otherwise (result.json, metrics.csv, the
run's lock, train.log). Exits 1 while any job has failed (or ended without completing), 0
otherwise, 2 for a path that is neither. --json prints one JSON document instead
(docs/json.md names its fields).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter
from contextlib import suppress
from pathlib import Path
from typing import Any

from app import slurm
from app.reporting.results import JSON_HELP, emit, folder_arg
from app.rundir.lock import LOCK_NAME
from app.sweeps.summary import collect, job_summary, overrides_of, said_slowest

PROGRESS = re.compile(r"\] - step (\d+)/(\d+) ")  # the loop's log line: "step N/M epoch E: ..."
TAIL_BYTES = 1 << 16  # of train.log, where the last progress line is
# How a job that did not complete ended (the command exits 1 while any did).
ENDED_BADLY = {"failed", "cancelled", "interrupted", "ended"}


def progress(run_dir: Path) -> tuple[int, int] | None:
    """The step and the total steps of the last progress line in the run's log."""
    path = run_dir / "train.log"
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    found = PROGRESS.findall(text)
    return (int(found[-1][0]), int(found[-1][1])) if found else None


def reached(run_dir: Path) -> tuple[int, int] | None:
    """The step the run reached, and its total steps: its last progress line's, or its last
    checkpoint's when later (a stop saves one between logging steps: cancelled at 47, not at
    the 40 logged)."""
    done = progress(run_dir)
    return None if done is None else (max(done[0], checkpoint_step(run_dir) or 0), done[1])


def _where(run_dir: Path) -> str:
    at = reached(run_dir)
    return "" if at is None else f" at step {at[0]} of {at[1]}"


def checkpoint_step(run_dir: Path) -> int | None:
    """The step of the checkpoint a requeued job resumes from: the periodic checkpoint that
    `checkpoints/last.pt` is (a hard link to its file, a symbolic link to a sharded one's
    directory). From the names alone, no checkpoint read: None where last.pt is a copy."""
    folder = run_dir / "checkpoints"
    for path in folder.glob("step-*.pt"):  # (app.checkpoint.io.periodic_name)
        with suppress(OSError, ValueError):
            if path.samefile(folder / "last.pt"):
                return int(path.stem.removeprefix("step-"))
    return None


def from_run_dir(run_dir: Path) -> tuple[str, str]:
    """(status, what to say) from what the run directory holds."""
    if not run_dir.is_dir():
        return "not started", "not started (no run directory yet)"
    summary = job_summary(run_dir)
    status = summary["status"]
    again = f", {summary['attempts']} attempts" if (summary["attempts"] or 0) > 1 else ""
    if status == "completed":
        best = "" if summary["best"] is None else \
            f"best {summary['monitor']} {summary['best']:.6g}, "
        slow = f"; slowest {said_slowest(summary['slowest_rank'])}" \
            if summary["slowest_rank"] else ""
        return status, f"completed: {best}step {summary['steps'] or 0}{again}{slow}"
    if status in ENDED_BADLY:
        return status, f"{status}{_where(run_dir)}: {summary['error'] or 'no error recorded'}"
    if status == "requeued":  # (Slurm's own account of it is gone: no accounting, or purged)
        return "queued", f"requeued{_where(run_dir)}, waiting to run again{again}"
    try:  # a live process on this host that holds the run's lock (a local run)
        pid, host = (run_dir / LOCK_NAME).read_text().split()
        os.kill(int(pid), 0)
    except (OSError, ValueError):
        host = None
    if host == os.uname().nodename:
        return "running", f"running{_where(run_dir)} (pid {int(pid)}){again}"
    if status == "no result" and not (run_dir / "train.log").exists():
        return "not started", "not started"
    return "ended", f"ended without a result{_where(run_dir)} (killed?)"


def from_slurm(job: slurm.Job, run_dir: Path, failure: str | None) -> tuple[str, str]:
    """(status, what to say) of a job Slurm still lists."""
    again = f", requeued {job.restarts} time(s)" if job.restarts else ""
    state, reason = job.state, job.reason
    if state == "PENDING":
        why = "held" if reason == "JobHeldUser" else f"PENDING: {reason}" if reason and \
            reason != "None" else "PENDING"
        if not job.restarts:
            return "queued", f"queued ({why})"
        # It starts again from its last checkpoint's step (the steps logged after it are
        # trained again), else from where its log ends.
        step, done = checkpoint_step(run_dir), progress(run_dir)
        logged = "" if done is None or done[0] == step else f", logged to step {done[0]}"
        start = _where(run_dir) if step is None else f" from step {step}" \
            f"{'' if done is None else f' of {done[1]}'} (its last checkpoint{logged})"
        return "queued", f"waiting to run again{start} ({why}){again}"
    if state in ("RUNNING", "COMPLETING", "CONFIGURING"):
        # The run may have completed while Slurm still ends its job (submitit's own ending,
        # the step's teardown): its record says so. (A requeued run's earlier "interrupted"
        # is not the end of the run that now runs again.)
        status, said = from_run_dir(run_dir)
        if status == "completed":
            return status, f"{said}{again} (Slurm is ending its job)"
        verb = "ending" if state == "COMPLETING" else "running"
        return "running", f"{verb} on {job.nodes or '?'}{_where(run_dir)}{again}"
    if state in ("SUSPENDED", "PREEMPTED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                 "RESIZING", "STOPPED"):
        said = f"{state.lower()}{_where(run_dir)}, waiting to run again"
        step = checkpoint_step(run_dir)
        return "queued", f"{said}{'' if step is None else f' from step {step}'}{again}"
    status, said = from_run_dir(run_dir)
    if state == "COMPLETED" and status == "completed":
        return status, said + again
    if state == "CANCELLED":
        return "cancelled", f"cancelled{_where(run_dir)}{again}"
    if failure:
        what = failure
    elif status in ("failed", "interrupted"):
        what = said
    elif status == "ended":  # (the state says why)
        what = f"ended without a result{_where(run_dir)}"
    else:
        what = f"exit {job.exit_code or '?'}"
    return "failed", f"{state}: {what}{again}"


def failure_of(record: dict[str, Any], sweep_dir: Path, job: dict[str, Any], state: str
               ) -> str | None:
    """How a Slurm job that ended without completing failed: its task and error (from the
    tasks' results and srun's report), as the waiting command reports it."""
    if state not in slurm.FINAL or state == "COMPLETED":
        return None
    import submitit

    from app.sweeps.job_end import describe, outcomes

    folder = record.get("submitit_folder") or str(sweep_dir / ".submitit" / "%j")
    sjob = submitit.SlurmJob(folder=folder, job_id=job["job_id"],
                             tasks=range(int(job.get("tasks", 1))))
    results = outcomes(sjob, grace_s=0)
    if all(r is not None and r[0] == "success" for r in results):
        return None
    task, what, _ = describe(sjob, state, results)
    return f"failed{'' if task is None else f' in task {task}'}: {what}"


def _job(job: int | str | None, slurm_job_id: str | None, status: str, detail: str,
         overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """One job as the text and --json give it."""
    at = reached(run_dir)
    return {"job": int(job) if isinstance(job, str) and job.isdigit() else job,
            "slurm_job_id": slurm_job_id, "status": status, "detail": detail,
            "step": None if at is None else at[0], "total_steps": None if at is None else at[1],
            "overrides": overrides, "run_dir": str(run_dir)}


def line(job: dict[str, Any]) -> str:
    if job["job"] is None:
        return f"run {job['run_dir']}: {job['detail']}"
    slurm_job = "" if job["slurm_job_id"] is None else f" (slurm job {job['slurm_job_id']})"
    return f"job #{job['job']}{slurm_job}: {job['detail']} [{' '.join(job['overrides'])}]"


def sweep_jobs(sweep_dir: Path) -> list[dict[str, Any]]:
    """Each job of a sweep directory (`_job`), by number."""
    from app.errors import RecordUnreadable
    from app.sweeps.record import jobs_by_num, read

    try:
        record = read(sweep_dir)
    except RecordUnreadable as e:
        print(f"warning: {e}: the jobs are read from their run directories", file=sys.stderr)
        record = {}
    recorded = jobs_by_num(record)
    if not recorded:  # a sweep that was waited for, or run locally: its run directories
        return [_job(job["job"], None, *from_run_dir(Path(job["run_dir"])),
                     job["overrides_list"], Path(job["run_dir"])) for job in collect(sweep_dir)]
    known = slurm.states([job["job_id"] for job in recorded.values()]) or {}
    jobs = []
    for num, job in sorted(recorded.items()):
        run_dir = Path(job["run_dir"])
        listed = known.get(job["job_id"])
        if listed is None or listed.state == "GONE":  # forgotten by Slurm: the run directory
            status, said = from_run_dir(run_dir)
            if status == "not started" and listed is not None:
                status, said = "ended", "ended without starting (Slurm no longer lists it)"
        else:
            failure = failure_of(record, sweep_dir, job, listed.state)
            status, said = from_slurm(listed, run_dir, failure)
        params = [o for o in job.get("overrides", []) if not o.startswith("hydra.")]
        jobs.append(_job(num, job["job_id"], status, said, params, run_dir))
    return jobs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.status", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=folder_arg, help="a sweep directory or a run directory")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)
    args = parser.parse_args(argv)
    path = args.path
    if (path / "submission.json").is_file() or any(path.glob("*/.hydra/overrides.yaml")):
        kind, jobs = "sweep", sweep_jobs(path)
    elif (path / ".hydra").is_dir() or (path / "metrics.csv").is_file():
        kind, jobs = "run", [_job(None, None, *from_run_dir(path), overrides_of(path), path)]
    else:
        print(f"error: {path} is neither a sweep directory (submission.json or job folders "
              f"with .hydra/) nor a run directory (.hydra/, metrics.csv)", file=sys.stderr)
        return 2
    counts = Counter(job["status"] for job in jobs)
    if args.json:
        emit({"path": str(path), "kind": kind, "jobs": jobs, "counts": dict(sorted(
            counts.items()))})
    else:
        for job in jobs:
            print(line(job))
        print(f"{len(jobs)} job(s): " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    return 1 if any(s in ENDED_BADLY for s in counts) else 0


if __name__ == "__main__":
    sys.exit(main())
