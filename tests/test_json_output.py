"""`--json` of app.report and of the Slurm dry run (`hydra.launcher.dry_run=json`), and that
docs/json.md lists exactly the fields each command prints (app.status's and app.runs' own
tests: tests/test_status.py, tests/test_runs.py)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from app import report, runs, status
from conftest import REPO, TINY, Sweep


def _json(main: Any, *argv: str) -> tuple[int, Any]:
    """Exit status and document of `main([*argv, "--json"])`, stdout holding that alone."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*argv, "--json"])
    return code, json.loads(out.getvalue())


@pytest.fixture(scope="module")
def outputs(faulty_sweep: Sweep, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the session's faulty sweep (job #0 failed), `multirun/sweep`: app.report
    writes its summary into it."""
    assert faulty_sweep.returncode == 1, faulty_sweep.output[-3000:]
    return faulty_sweep.copy_to(tmp_path_factory.mktemp("json") / "multirun").parent.parent


def _dry_run(tmp_path: Path, form: str, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app", "launcher=slurm", f"hydra.launcher.dry_run={form}",
         f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra.launcher.partition=debug",
         "optimizer.lr=0.1,0.01", *TINY, *overrides],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess,
                                                                subprocess.CompletedProcess]:
    """The same dry run as JSON and as text (a cluster is not needed: without one, its
    problem is that Slurm does not answer)."""
    tmp_path = tmp_path_factory.mktemp("dry-run")
    return _dry_run(tmp_path, "json"), _dry_run(tmp_path, "true")


def test_report_json_of_a_sweep_and_of_a_run(outputs) -> None:
    sweep = outputs / "multirun" / "sweep"
    code, said = _json(report.main, str(sweep))
    assert code == 0 and (said["kind"], said["sweep_dir"]) == ("sweep", str(sweep))
    assert said["files"] == [str(sweep / n) for n in ("summary.csv", "summary.md",
                                                     "summary.png")]
    *done, failed = said["jobs"]  # (best first: the failed job, without a value, last)
    assert [j["best"] for j in done] == sorted((j["best"] for j in done), reverse=True)
    assert sorted(j["job"] for j in done) == [1, 2, 3] and failed["job"] == 0
    assert (failed["status"], failed["error"], failed["best"]) == (
        "failed", "RuntimeError: injected fault", None)
    assert failed["params"] == {"model.fault_rank": "0", "model.fault_call": "5"}
    assert "+model.fault_call=5" in failed["overrides"]
    assert failed["run_dir"] == str(sweep / "0") and failed["monitor_mode"] == "max"
    code, run = _json(report.main, str(sweep / "1"))
    assert code == 0 and (run["kind"], run["run_dir"]) == ("run", str(sweep / "1"))
    assert run["curves"] == str(sweep / "1" / "plots" / "curves.png")
    assert {k: run[k] for k in ("status", "steps", "best")} == {
        k: next(j for j in done if j["job"] == 1)[k] for k in ("status", "steps", "best")}


def test_a_json_dry_run_is_one_document_with_what_the_text_says(dry_runs) -> None:
    as_json, text = dry_runs
    said = json.loads(as_json.stdout)  # (stdout holds the document alone)
    assert as_json.returncode == text.returncode == (2 if said["problems"] else 0), \
        as_json.stderr[-2000:]
    assert [line.removeprefix("problem: ") for line in text.stdout.splitlines()
            if line.startswith("problem: ")] == said["problems"]
    assert [j["job"] for j in said["jobs"]] == [0, 1]
    assert "optimizer.lr=0.01" in said["jobs"][1]["overrides"]
    for job in said["jobs"]:
        assert f"job #{job['job']}: {' '.join(job['overrides'])} -> {job['run_dir']}" in \
            text.stdout
    (array,) = said["arrays"]
    assert array["jobs"] == [0, 1] and "#SBATCH --array=0-1%2" in array["sbatch_script"]
    assert array["sbatch_script"] in text.stdout
    assert (said["nodes"], said["tasks_per_node"], said["ranks"], said["timeout_min"]) == \
        (1, 1, 1, 60)
    assert f"each job: 1 node(s) x 1 task(s) = 1 rank(s); per node 0 GPU(s), " \
           f"{said['cpus_per_node']} CPU(s)" in text.stdout


def test_a_dry_run_of_another_form_is_refused(tmp_path) -> None:
    done = _dry_run(tmp_path, "yes")
    assert done.returncode == 2
    assert "hydra.launcher.dry_run=yes: give true (the dry run's report), json (the report as " \
           "one JSON document) or false (nothing was submitted)" in done.stdout + done.stderr


def documented() -> dict[str, set[str]]:
    """Each table of docs/json.md (`<!-- fields: NAME -->` before it): its field names."""
    text = (REPO / "docs" / "json.md").read_text()
    tables = re.findall(r"<!-- fields: (\S+) -->\n\| field \| type \| meaning \|\n\|[- |]+\|\n"
                        r"((?:\|.*\|\n)+)", text)
    assert len(tables) == len(re.findall("<!-- fields:", text)), "a marker without its table"
    return {name: {f for row in rows.splitlines()
                   for f in re.findall(r"`(\w+)`", row.split("|")[1])}
            for name, rows in tables}


def test_docs_list_exactly_the_fields_each_command_prints(outputs, dry_runs, tmp_path) -> None:
    sweep = outputs / "multirun" / "sweep"
    _, listed = _json(runs.main, "ls", str(outputs))
    _, shown = _json(runs.main, "show", str(sweep / "1"))
    _, diff = _json(runs.main, "diff", str(sweep / "0"), str(sweep / "1"))
    _, state = _json(status.main, str(sweep))
    _, sweep_report = _json(report.main, str(sweep))
    _, run_report = _json(report.main, str(sweep / "1"))
    printed = {
        "runs.ls": set(listed[0]), "runs.show": set(shown) - set(listed[0]),
        "runs.diff": set(diff), "status": set(state), "status.jobs": set(state["jobs"][0]),
        "report.run": set(run_report), "report.sweep": set(sweep_report),
        "report.sweep.jobs": set(sweep_report["jobs"][0]),
        "dry_run": set(json.loads(dry_runs[0].stdout))}
    assert set(diff["a"]) == set(listed[0])  # (diff's runs are as ls gives them)
    assert documented() == printed
