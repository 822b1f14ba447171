"""`python -m app.report PATH`: redraw the pictures and print the table of a run or a sweep
directory, finished, failed or still running. --json prints one JSON document instead of
the text (docs/json.md names its fields)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from app.reporting.curves import draw_curves
from app.reporting.results import JSON_HELP, emit, folder_arg
from app.rundir.name import is_job_of_sweep
from app.sweeps.summary import curves_note, job_summary, markdown, write_summary


def _fields(summary: dict[str, Any]) -> dict[str, Any]:
    """A run's summary (`job_summary`, a sweep's job) as --json gives it."""
    found = {k: summary[k] for k in ("status", "error", "monitor", "best", "final", "steps",
                                     "wall_s", "attempts", "slowest_rank")}
    return {**found, "monitor_mode": summary["mode"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.report", description=__doc__)
    parser.add_argument("path", type=folder_arg, help="a run directory or a sweep directory")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)
    args = parser.parse_args(argv)
    path = args.path
    if (path / "metrics.csv").is_file():
        summary = job_summary(path)
        curves = draw_curves(path, note=curves_note(summary))
        if args.json:
            emit({"kind": "run", "run_dir": str(path), **_fields(summary), "curves": curves})
            return 0
        print(f"run {path}: {summary['status']}, {summary['steps'] or 0} steps, best "
              f"{summary['monitor']} {summary['best']}, final {summary['final']}")
        print(f"curves: {curves}")
        return 0
    job_dirs = [p.parent.parent for p in path.glob("*/.hydra/overrides.yaml")]
    if job_dirs and not any(map(is_job_of_sweep, job_dirs)):  # (a day's folder of runs)
        print(f"error: {path} is a folder of single runs, not a sweep directory: "
              f"`python -m app.runs ls {path}` lists them, and `python -m app.report RUN_DIR` "
              f"draws one", file=sys.stderr)
        return 2
    if job_dirs:
        jobs = write_summary(path)
        for job in jobs:  # (write_summary drew those of the jobs that did not complete)
            if job["status"] == "completed":
                draw_curves(Path(job["run_dir"]))
        files = [path / name for name in ("summary.csv", "summary.md", "summary.png")]
        if args.json:
            emit({"kind": "sweep", "sweep_dir": str(path), "jobs": [
                {"job": int(job["job"]) if job["job"].isdigit() else job["job"],
                 **_fields(job), "overrides": job["overrides_list"], "params": job["params"],
                 "run_dir": job["run_dir"]} for job in jobs], "files": files})
            return 0
        print(markdown(jobs))
        print(f"\n{', '.join(map(str, files))}")
        return 0
    print(f"error: {path} is neither a run directory (metrics.csv) nor a sweep directory "
          f"(job folders with .hydra/)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
