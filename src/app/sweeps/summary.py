"""The table of a sweep: `summary.csv`, `summary.md` and `summary.png` in the sweep directory.

Rebuilt from the run directories themselves (their `metrics.csv`, `result.json` and
`.hydra/overrides.yaml`), so it covers every launcher, failed and killed jobs included, and
`python -m app.report` can redraw it for a sweep that is still running.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import re
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from app.env import this_process
from app.reporting.curves import draw_curves
from app.reporting.results import RESULT, read_metrics, read_result
from app.rundir.lock import claim_for_job, claim_for_run, refused
from app.rundir.record import TRAINED_NOTHING
from app.rundir.writable import check
from app.signals import stop_signals_stop_nothing
from app.sweeps.plots import draw_summary

log = logging.getLogger(__name__)

COLUMNS = ["job", "overrides", "status", "best", "final", "steps", "wall_s", "attempts",
           "run_dir", "error"]
# A job run again (resumed, requeued) appends to its train.log: each process that runs it
# marks its start there (SweepSummary.on_job_start), and its last record marks its end.
ATTEMPT = "attempt started"
RECORD = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[[^]]*\]\[\w+\] - (.*)")


def wall_time(run_dir: Path, last_wall_s: float | None) -> tuple[float | None, int]:
    """The job's wall time over all its attempts, and their number. result.json holds the
    last attempt's own wall time; each attempt's (start, end), killed ones too, is read from
    the records of train.log (their times are this machine's local time)."""
    path = run_dir / "train.log"
    spans: list[list[float]] = []
    idle = set()  # the attempts that trained nothing (a refused command, a re-run of a run done)
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        match = RECORD.match(line)
        if match is None:
            continue  # a record's continuation lines (a traceback, a config)
        at = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if not spans or match[2].startswith(ATTEMPT):
            spans.append([at, at])
        spans[-1][1] = max(spans[-1][1], at)
        if match[2].startswith(TRAINED_NOTHING):
            idle.add(len(spans) - 1)
    spans = [span for i, span in enumerate(spans) if i not in idle]
    if len(spans) <= 1:
        return last_wall_s, max(len(spans), last_wall_s is not None)
    earlier, (start, end) = sum(e - s for s, e in spans[:-1]), spans[-1]
    if last_wall_s is None or (run_dir / RESULT).stat().st_mtime < start:
        last_wall_s = end - start  # the last attempt wrote no result.json (running, killed)
    return earlier + last_wall_s, len(spans)


def job_summary(run_dir: Path) -> dict[str, Any]:
    """Status, best and final value of the monitored metric (from the run's saved config:
    val/acc, max by default), steps reached, and wall time over every attempt of one run."""
    config = run_dir / ".hydra" / "config.yaml"
    trainer = OmegaConf.load(config).get("trainer", {}) if config.is_file() else {}
    monitor, mode = trainer.get("monitor", "val/acc"), str(trainer.get("monitor_mode", "max"))
    split, _, name = monitor.partition("/")
    rows = read_metrics(run_dir)
    values = [float(r[name]) for r in rows if r["split"] == split and r.get(name)]
    values = [v for v in values if not math.isnan(v)]
    result = read_result(run_dir)
    wall_s, num_attempts = wall_time(run_dir, result.get("wall_s"))
    # The furthest step the job is known to have reached: its last logged metrics, its newest
    # checkpoint, or the step its error names (a job can fail before it logs anything).
    logged = max((int(r["step"]) for r in rows), default=0)
    steps = [logged] if logged else []
    steps += [int(p.stem.removeprefix("step-")) for p in (run_dir / "checkpoints").glob(
        "step-*.pt") if p.stem.removeprefix("step-").isdigit()]
    named = re.search(r"at step (\d+)", result.get("error") or "")
    steps += [int(named[1])] if named else []
    return {
        "status": result.get("status") or ("running or killed" if rows else "no result"),
        "monitor": monitor,
        "best": (max if mode == "max" else min)(values) if values else None,
        "final": values[-1] if values else None,
        "steps": max(steps, default=None),
        "wall_s": wall_s,
        "attempts": num_attempts,
        "error": result.get("error"),
        "mode": mode,
        "slowest_rank": slowest_rank(run_dir),
    }


def slowest_rank(run_dir: Path) -> dict[str, Any] | None:
    """{rank, host, excess}: the rank most busy before the gradients' all-reduce and its
    excess over the other ranks' median (0.35: 35% more), from a run with
    trainer.telemetry=true and several ranks (None without)."""
    try:
        found = json.loads((run_dir / "logs" / "telemetry.json").read_text())["straggler"]
        return {"rank": int(found["rank"]), "host": str(found["host"]),
                "excess": float(found["excess"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def said_slowest(found: dict[str, Any]) -> str:
    return f"rank {found['rank']} on {found['host']} +{100 * found['excess']:.0f}%"


def curves_note(summary: dict[str, Any]) -> str | None:
    """What a job's curves say about how it ended, when it did not complete."""
    if summary["status"] == "completed":
        return None
    at = f" at step {summary['steps']}" if summary["steps"] else ""
    return f"{summary['status']}{at}" + (f": {summary['error']}" if summary["error"] else "")


def overrides_of(run_dir: Path) -> list[str]:
    """The run's command-line overrides, Hydra's own left out."""
    path = run_dir / ".hydra" / "overrides.yaml"
    found = OmegaConf.load(path) if path.is_file() else []
    # Hydra's sweeper writes a bool typed `false` back as Python's `False`: shown as typed.
    return [re.sub(r"=(True|False)$", lambda m: f"={m[1].lower()}", str(o)) for o in found
            if not str(o).lstrip("+~").startswith("hydra.")]


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One entry per job directory of the sweep, by number."""
    run_dirs = sorted((p.parent.parent for p in sweep_dir.glob("*/.hydra/overrides.yaml")),
                      key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit()
                                     else 0, p.name))
    jobs = [{"job": run_dir.name, "overrides": " ".join(overrides), "run_dir": str(run_dir),
             "overrides_list": overrides, **job_summary(run_dir)}
            for run_dir in run_dirs for overrides in [overrides_of(run_dir)]]
    # The keys that differ between jobs name them; the rest is noise in a table.
    common = set.intersection(*(set(j["overrides_list"]) for j in jobs)) if jobs else set()
    for job in jobs:
        job["params"] = dict(o.lstrip("+").split("=", 1) for o in job["overrides_list"]
                             if o not in common and "=" in o)
    return jobs


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, dict):  # (slowest_rank)
        return said_slowest(value)
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def columns(jobs: list[dict[str, Any]]) -> list[str]:
    """The table's columns: the slowest rank's where a job measured it (trainer.telemetry)."""
    return COLUMNS + ["slowest_rank"] * any(job.get("slowest_rank") for job in jobs)


def markdown(jobs: list[dict[str, Any]]) -> str:
    shown = columns(jobs)
    rows = [shown, ["---"] * len(shown)]
    rows += [[_cell(job.get(c)).replace("|", "\\|") for c in shown] for job in jobs]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def write_summary(sweep_dir: Path, draw: bool = True) -> list[dict[str, Any]]:
    """The sweep's jobs, best first (jobs without a value last), in its summary files."""
    jobs = collect(sweep_dir)
    sign = -1 if jobs and jobs[0]["mode"] == "max" else 1
    jobs.sort(key=lambda j: (j["best"] is None, sign * (j["best"] or 0)))
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns(jobs), extrasaction="ignore")
        writer.writeheader()
        # Full precision in the CSV (it is for programs); 6 digits in the markdown table.
        writer.writerows({**job, "slowest_rank": _cell(job.get("slowest_rank"))}
                         for job in jobs)  # (None as an empty cell)
    monitor = jobs[0]["monitor"] if jobs else "val/acc"
    (sweep_dir / "summary.md").write_text(
        f"# Sweep {sweep_dir}\n\nSorted by best {monitor}.\n\n{markdown(jobs)}\n")
    if draw:
        draw_summary(sweep_dir, jobs, monitor)
        for job in jobs:  # a job that did not complete never drew its own
            if job["status"] != "completed":
                draw_curves(Path(job["run_dir"]), note=curves_note(job))
    return jobs


class SweepSummary(Callback):
    """Hydra callback: mark each attempt of a job in its train.log; keep the sweep's table
    current after each job; print it at the end."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from app.sweeps.dirs import refuse_other_values

        if not str(config.hydra.sweep.dir).strip():  # (`hydra.sweep.dir=$DIR`, DIR unset)
            print("hydra.sweep.dir is empty: give the sweep's directory, or leave it out for "
                  "a new one under outputs/multirun/", file=sys.stderr)
            sys.exit(2)
        check(Path(os.path.abspath(config.hydra.sweep.dir)), "sweep directory")
        refuse_other_values(config, log)

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Before Hydra writes .hydra/ and opens train.log: a refused command writes nothing.
        claim_for_run(config)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if this_process().rank != 0:
            return  # (every task of a SLURM job starts with Hydra's train.log handler)
        # A job of a sweep takes the run's lock here (a single run did in on_run_start):
        # refused, it marks nothing in the other command's train.log.
        if config.hydra.mode == RunMode.MULTIRUN and not claim_for_job(
                Path(config.hydra.runtime.output_dir), config.get("machine_rank", 0)):
            return
        # To the log files only: a console has no use for it.
        record = logging.LogRecord(__name__, logging.INFO, __file__, 0, "%s: pid %d",
                                   (ATTEMPT, os.getpid()), None)
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.FileHandler):
                handler.handle(record)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if this_process().rank != 0:  # every task of a SLURM job calls this: one writes
            return
        run_dir = Path(config.hydra.runtime.output_dir)
        summary = job_summary(run_dir)
        # Training draws the curves only at its end; a refused job's run is another command's.
        if summary["status"] != "completed" and not refused(run_dir):
            draw_curves(run_dir, note=curves_note(summary))
        if config.hydra.mode == RunMode.MULTIRUN:
            # Without the picture: drawing after every job would cost more than the table.
            write_summary(Path(config.hydra.sweep.dir), draw=False)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if OmegaConf.select(config, "hydra.launcher.wait", default=True) is False or \
                OmegaConf.select(config, "hydra.launcher.dry_run", default=False) is True:
            return  # submitted and not waited for: python -m app.report, once they end
        stop_signals_stop_nothing()  # every job has ended: a signal now would only lose the table
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = write_summary(sweep_dir)
        log.info("sweep summary (%s):\n%s", sweep_dir / "summary.md", markdown(jobs))
        failed = [j for j in jobs if j["status"] != "completed"]
        for job in failed:
            log.error("job #%s %s: %s (%s)", job["job"], job["status"], job["error"] or "",
                      job["run_dir"])
        if failed:
            sys.exit(1)  # the sweep ran to its end, but not every job completed
