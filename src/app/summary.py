"""The table of a sweep: `summary.csv`, `summary.md` and `summary.png` in the sweep directory.

Rebuilt from the run directories themselves (their `metrics.csv`, `result.json` and
`.hydra/overrides.yaml`), so it covers every launcher, failed and killed jobs included, and
`python -m app.report` can redraw it for a sweep that is still running.
"""

from __future__ import annotations

import csv
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from app.cluster_env import detect
from app.plots import draw_summary
from app.results import run_summary

log = logging.getLogger(__name__)

COLUMNS = ["job", "overrides", "status", "best", "final", "steps", "wall_s", "run_dir", "error"]


def _overrides(run_dir: Path) -> list[str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    found = OmegaConf.load(path) if path.is_file() else []
    return [str(o) for o in found if not str(o).lstrip("+~").startswith("hydra.")]


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One entry per job directory of the sweep, best first; jobs without a value last."""
    run_dirs = sorted((p.parent.parent for p in sweep_dir.glob("*/.hydra/overrides.yaml")),
                      key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit()
                                     else 0, p.name))
    jobs = []
    for run_dir in run_dirs:
        overrides = _overrides(run_dir)
        jobs.append({"job": run_dir.name, "overrides": " ".join(overrides),
                     "run_dir": str(run_dir), "overrides_list": overrides,
                     **run_summary(run_dir)})
    # The keys that differ between jobs name them; the rest is noise in a table.
    common = set.intersection(*(set(j["overrides_list"]) for j in jobs)) if jobs else set()
    for job in jobs:
        job["params"] = dict(o.lstrip("+").split("=", 1) for o in job["overrides_list"]
                             if o not in common and "=" in o)
    descending = bool(jobs) and jobs[0]["mode"] == "max"
    jobs.sort(key=lambda j: (j["best"] is None,
                             -(j["best"] or 0) if descending else (j["best"] or 0)))
    return jobs


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def markdown(jobs: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for job in jobs:
        cells = [_cell(job[c]).replace("|", "\\|") for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_summary(sweep_dir: Path, draw: bool = True) -> list[dict[str, Any]]:
    jobs = collect(sweep_dir)
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        # Full precision in the CSV (it is for programs); 6 digits in the markdown table.
        writer.writerows({c: "" if j[c] is None else j[c] for c in COLUMNS} for j in jobs)
    monitor = jobs[0]["monitor"] if jobs else "val/acc"
    (sweep_dir / "summary.md").write_text(
        f"# Sweep {sweep_dir}\n\nSorted by best {monitor}.\n\n{markdown(jobs)}\n")
    if draw:
        draw_summary(sweep_dir, jobs, monitor)
    return jobs


class SweepSummary(Callback):
    """Hydra callback: keep the sweep's table current after each job; print it at the end."""

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        rank_env = detect(os.environ)  # every task of a SLURM job calls this: one writes
        if config.hydra.mode == RunMode.MULTIRUN and (rank_env is None or rank_env.rank == 0):
            # Without the picture: drawing after every job would cost more than the table.
            write_summary(Path(config.hydra.sweep.dir), draw=False)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = write_summary(sweep_dir)
        log.info("sweep summary (%s):\n%s", sweep_dir / "summary.md", markdown(jobs))
        failed = [j for j in jobs if j["status"] != "completed"]
        for job in failed:
            log.error("job #%s %s: %s (%s)", job["job"], job["status"], job["error"] or "",
                      job["run_dir"])
        if failed:
            sys.exit(1)  # the sweep ran to its end, but not every job completed
