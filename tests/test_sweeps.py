"""Sweep summaries and pictures: summary.csv/.md/.png, curves.png, `python -m app.report`."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime

import pytest
from omegaconf import OmegaConf

from app.config import LoggerConfig
from app.errors import UserError
from app.reporting.loggers import MLflowLogger
from conftest import LR_SWEEP, REPO, TINY, Sweep, multirun, multirun_once, read_metrics, run_job


def _summary(sweep) -> list[dict[str, str]]:
    with open(sweep / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def grid(tmp_path_factory) -> Sweep:
    """A 3x2 grid of which the two jobs of lr=1e6 fail: their loss is NaN within a few steps,
    before the first logged row (every 10). One sweep for the summary's tests of completed
    and of failed jobs, built once for the pytest workers that run them."""
    return multirun_once(tmp_path_factory, "grid-sweep", "optimizer.lr=0.01,0.003,1e6",
                         "model.dropout=0,0.3", *TINY, "trainer.max_epochs=1",
                         "trainer.log_every_n_steps=10")


def test_grid_sweep_summary_agrees_with_each_job(grid: Sweep, tmp_path) -> None:
    assert grid.returncode == 1, grid.output[-3000:]  # (the failed jobs: test below)
    rows = [r for r in _summary(grid.dir) if r["status"] == "completed"]
    assert len(rows) == 4
    bests = [float(r["best"]) for r in rows]
    assert bests == sorted(bests, reverse=True)  # val/acc: best first
    for row in rows:
        val = [float(r["acc"]) for r in read_metrics(grid.dir / row["job"])
               if r["split"] == "val"]
        assert float(row["best"]) == max(val) and float(row["final"]) == val[-1]
        assert int(row["steps"]) == 22
        assert "optimizer.lr=" in row["overrides"] and "model.dropout=" in row["overrides"]
        assert (grid.dir / row["job"] / "plots" / "curves.png").stat().st_size > 10_000
    assert "| job | overrides | status |" in (grid.dir / "summary.md").read_text()
    assert "| job | overrides | status |" in grid.output  # printed at the end
    assert (grid.dir / "summary.png").read_bytes()[:4] == b"\x89PNG"
    # `python -m app.report SWEEP` builds the summary again from the job directories.
    sweep = grid.copy_to(tmp_path)
    (sweep / "summary.csv").unlink()
    report = subprocess.run([sys.executable, "-m", "app.report", str(sweep)], cwd=REPO,
                            capture_output=True, text=True)
    assert report.returncode == 0 and report.stdout.count("| completed |") == 4
    shared = _summary(grid.dir)
    for row in shared:  # (the copy's run directories are its own)
        assert row["run_dir"] == str(grid.dir / row["job"])
        row["run_dir"] = str(sweep / row["job"])
    assert _summary(sweep) == shared


def test_jobs_with_the_same_overrides_each_run_in_their_own_directory(tmp_path) -> None:
    # (The launcher once took the first job's composed config for the second: one directory,
    # the second job refused as RunDirInUse, and the sweep said it completed.)
    proc, jobs = multirun(tmp_path, "hydra/launcher=submitit_local", "seed=1,1", *TINY,
                          "trainer.max_steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [j["num"] for j in jobs] == [0, 1]
    for num in (0, 1):
        hydra_cfg = OmegaConf.load(tmp_path / "sweep" / str(num) / ".hydra" / "hydra.yaml")
        assert hydra_cfg.hydra.job.num == num
    assert [r["status"] for r in _summary(tmp_path / "sweep")] == ["completed", "completed"]


def test_sweeper_params_given_on_the_command_line_are_swept(tmp_path) -> None:
    # (hydra.sweeper.params is null in Hydra's basic sweeper, which took no key from the
    # command line: a traceback.)
    proc, jobs = multirun(tmp_path, "+hydra.sweeper.params.seed='1,2'", *TINY,
                          "trainer.max_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _summary(tmp_path / "sweep")
    assert len(jobs) == 2 and [r["status"] for r in rows] == ["completed", "completed"]
    assert sorted(o for r in rows for o in r["overrides"].split() if o.startswith("seed=")) == [
        "seed=1", "seed=2"]
    # Other values into the same sweep directory: refused, as for a sweep typed as seed=3,4.
    proc, _ = multirun(tmp_path, "+hydra.sweeper.params.seed='3,4'", *TINY, "trainer.max_steps=2")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "was used by a sweep of other values" in proc.stdout + proc.stderr


def test_failed_job_is_listed_and_the_sweep_goes_on(faulty_sweep: Sweep) -> None:
    assert faulty_sweep.returncode == 1
    assert "job #0 failed: RuntimeError: injected fault" in faulty_sweep.output  # #0 failed ...
    assert [j["status"] for j in faulty_sweep.jobs] == ["COMPLETED"] * 4  # ... the others ran
    assert "| job | overrides | status |" in faulty_sweep.output
    rows = {r["job"]: r for r in _summary(faulty_sweep.dir)}
    for job in ("1", "2", "3"):
        assert rows[job]["status"] == "completed" and rows[job]["best"]
    assert rows["0"]["status"] == "failed"
    assert rows["0"]["error"] == "RuntimeError: injected fault"


def test_report_redraws_a_run(tmp_path, trained) -> None:
    # (A sweep's summary: test_grid_sweep_summary_agrees_with_each_job.)
    (trained / "plots" / "curves.png").unlink()
    run = subprocess.run([sys.executable, "-m", "app.report", str(trained)], cwd=REPO,
                         capture_output=True, text=True)
    assert run.returncode == 0 and "completed, 88 steps" in run.stdout
    assert (trained / "plots" / "curves.png").is_file()
    (tmp_path / "empty").mkdir()
    empty = subprocess.run([sys.executable, "-m", "app.report", str(tmp_path / "empty")],
                           cwd=REPO, capture_output=True, text=True)
    assert empty.returncode == 2 and "neither a run directory" in empty.stderr


def test_report_of_a_folder_of_single_runs_writes_nothing(tmp_path, capsys) -> None:
    """`outputs/DAY` holds runs, not a sweep's jobs: no summary of them is written there."""
    from app.report import main

    day = tmp_path / "day"
    for num in range(2):
        run_dir = _job_dir(day, num, [f"seed={num}"], [], {"status": "completed"})
        (run_dir / ".hydra" / "hydra.yaml").write_text("hydra:\n  mode: RUN\n")
    assert main([str(day)]) == 2
    assert "a folder of single runs" in capsys.readouterr().err
    assert not list(day.glob("summary.*"))
    (day / "multirun.yaml").write_text("{}\n")  # Hydra's mark of a sweep directory
    assert main([str(day)]) == 0
    assert (day / "summary.csv").is_file()


def test_optuna_search_runs_trials_and_reports_the_best(optuna_sweep: Sweep) -> None:
    assert optuna_sweep.returncode == 0, optuna_sweep.output[-3000:]
    result = OmegaConf.load(optuna_sweep.dir / "optimization_results.yaml")
    values = [j["value"] for j in optuna_sweep.jobs]
    assert len(values) == 3 and result.best_value == max(values)
    assert set(result.best_params) == {"optimizer.lr", "model.channels"}
    assert "Best value" in optuna_sweep.output


def test_rerun_sweep_skips_finished_jobs_and_resumes_the_rest(tmp_path) -> None:
    args = ["optimizer.lr=0.01,0.003", *TINY, "trainer.max_epochs=3",
            "trainer.ckpt_every_n_epochs=1"]
    sweep = tmp_path / "sweep"
    first = subprocess.Popen(
        [sys.executable, "-m", "app", "-m", *args, f"hydra.sweep.dir={sweep}"], cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    checkpoint = sweep / "1" / "checkpoints" / "last.pt"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not checkpoint.is_file():
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)  # the whole sweep dies while job 1 trains
    first.wait()
    assert (sweep / "0" / "result.json").is_file() and not (sweep / "1" / "result.json").exists()

    proc, jobs = multirun(tmp_path, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = [(sweep / str(n) / "train.log").read_text() for n in (0, 1)]
    assert "already finished at step 66: nothing to train" in logs[0]
    assert "resumed from" in logs[1] and "done: step 66" in logs[1]
    rows = _summary(sweep)
    assert len(rows) == 2 and {r["status"] for r in rows} == {"completed"}
    # Job 1 ran twice (killed, then resumed): its wall time counts both attempts.
    job1 = next(r for r in rows if r["job"] == "1")
    last_attempt = json.loads((sweep / "1" / "result.json").read_text())["wall_s"]
    assert job1["attempts"] == "2" and float(job1["wall_s"]) > last_attempt


def test_mlflow_and_tensorboard_together(tmp_path) -> None:
    from mlflow.tracking import MlflowClient  # an optional extra (installed by make install)

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run = run_job(tmp_path / "run", *TINY, "trainer.max_epochs=1", "logger=mlflow",
                  "logger.tensorboard=true", f"logger.mlflow_uri={uri}").run_dir
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    run_id = (run / ".mlflow_run_id").read_text().strip()
    client = MlflowClient(uri)
    history = client.get_metric_history(run_id, "train/loss")
    losses = [float(r["loss"]) for r in read_metrics(run) if r["split"] == "train"]
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == losses
    assert "config.yaml" in [a.path for a in client.list_artifacts(run_id)]
    assert list((tmp_path / "mlartifacts").rglob("config.yaml"))  # beside the store
    assert not (REPO / "mlruns").exists()  # not in the directory the run started from


def test_mlflow_missing_is_a_clear_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if it were not installed
    with pytest.raises(UserError, match="pip install mlflow-skinny"):
        MLflowLogger(tmp_path, LoggerConfig(mlflow=True, mlflow_uri="sqlite:///x.db"), {})


def _job_dir(sweep, num: int, overrides: list[str], log: list[str], result: dict | None,
             rows: list[str] | None = None):
    """A job directory as a run leaves it: overrides, train.log, metrics.csv, result.json."""
    run_dir = sweep / str(num)
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(
        "".join(f"- {o}\n" for o in overrides))
    (run_dir / "train.log").write_text("".join(f"{line}\n" for line in log))
    (run_dir / "metrics.csv").write_text("step,epoch,split,loss,lr,acc\n" + "".join(
        f"{r}\n" for r in rows or []))
    if result is not None:
        (run_dir / "result.json").write_text(json.dumps(result))
    return run_dir


def _record(clock: str, message: str) -> str:
    return f"[2026-12-03 {clock},000][app.training.loop][INFO] - {message}"


def test_summary_counts_every_attempt_and_the_step_a_job_failed_at(tmp_path) -> None:
    from app.sweeps.summary import ATTEMPT, write_summary

    sweep = tmp_path / "sweep"
    # Job 0 was killed after 30 s, then resumed an hour later and completed in 5 s.
    resumed = _job_dir(sweep, 0, ["optimizer.lr=0.01"], [
        _record("10:00:00", f"{ATTEMPT}: pid 11"), _record("10:00:30", "step 20/44 ..."),
        _record("11:00:00", f"{ATTEMPT}: pid 12"), _record("11:00:05", "done: step 44")],
        {"status": "completed", "wall_s": 5.0, "error": None},
        rows=["44,1,val,0.5,,0.9"])
    finished = datetime(2026, 12, 3, 11, 0, 6).timestamp()
    os.utime(resumed / "result.json", (finished, finished))
    # Job 1 failed at step 5, before its first logged row (log_every_n_steps=10).
    _job_dir(sweep, 1, ["optimizer.lr=1e6"], [_record("10:00:00", f"{ATTEMPT}: pid 13")],
             {"status": "failed", "wall_s": 2.0, "error": "AppError: the training loss was "
              "nan at step 5: training stopped"})
    # Job 2 completed once, then a second attempt was killed 20 s in (no new result.json).
    killed = _job_dir(sweep, 2, ["optimizer.lr=0.1"], [
        _record("10:00:00", f"{ATTEMPT}: pid 14"), _record("10:00:04", "done: step 44"),
        _record("10:10:00", f"{ATTEMPT}: pid 15"), _record("10:10:20", "step 10/44 ...")],
        {"status": "completed", "wall_s": 4.5, "error": None}, rows=["44,1,val,0.6,,0.8"])
    written = datetime(2026, 12, 3, 10, 0, 5).timestamp()
    os.utime(killed / "result.json", (written, written))

    write_summary(sweep)
    rows = {r["job"]: r for r in _summary(sweep)}
    assert (float(rows["0"]["wall_s"]), rows["0"]["attempts"]) == (35.0, "2")
    assert (float(rows["2"]["wall_s"]), rows["2"]["attempts"]) == (24.0, "2")
    assert rows["1"]["status"] == "failed" and rows["1"]["steps"] == "5"
    assert (sweep / "1" / "plots" / "curves.png").is_file()  # drawn by the summary


def test_summary_shows_bools_as_typed(tmp_path) -> None:
    """Hydra's sweeper writes a typed `false` into overrides.yaml as Python's `False`."""
    from app.sweeps.summary import collect

    for num, ema in enumerate(["False", "True"]):
        _job_dir(tmp_path, num, [f"trainer.ema={ema}", "trainer.progress_bar=False"], [], None)
    jobs = {job["job"]: job for job in collect(tmp_path)}
    assert jobs["0"]["overrides"] == "trainer.ema=false trainer.progress_bar=false"
    assert jobs["1"]["params"] == {"trainer.ema": "true"}


def test_a_job_that_fails_mid_training_has_its_step_and_curves(grid: Sweep) -> None:
    failed = [r for r in _summary(grid.dir) if "1e6" in r["overrides"]
              or "1000000" in r["overrides"]]
    assert len(failed) == 2
    for row in failed:
        assert row["status"] == "failed" and "at step" in row["error"]
        assert int(row["steps"]) > 0 and row["attempts"] == "1" and float(row["wall_s"]) > 0
        assert (grid.dir / row["job"] / "plots" / "curves.png").is_file()
        log = (grid.dir / row["job"] / "train.log").read_text()
        assert log.count("attempt started") == 1


def test_summary_picture_names_what_became_of_jobs_without_a_value(tmp_path) -> None:
    from matplotlib.text import Text
    from PIL import Image

    from app.sweeps.plots import draw_summary, summary_figure

    jobs = [{"job": str(n), "params": {"optimizer.lr": lr, "model.dropout": d},
             "best": best, "status": status}
            for n, (lr, d, best, status) in enumerate([
                ("0.003", "0", 0.9, "completed"), ("0.003", "0.3", 0.8, "completed"),
                ("1e6", "0", None, "failed"), ("1e6", "0.3", None, "running or killed")])]
    path = draw_summary(tmp_path, jobs, "val/acc")
    assert path == tmp_path / "summary.png" and draw_summary(tmp_path, [], "val/acc") is None
    with Image.open(path) as image:
        image.verify()  # the whole file decodes
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (1300, 450)  # bars and a heat map
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.png"]  # no temporary file
    figure = summary_figure(tmp_path, jobs, "val/acc")
    assert len(figure.axes) == 3  # bars, heat map, its colour bar
    texts = [t.get_text() for t in figure.findobj(Text)]
    # No bar and an empty cell: the picture says why, in both panels.
    assert texts.count("failed") == 2 and texts.count("running or killed") == 2, texts
    assert texts.count("0.9000") == 1  # a cell of the heat map
    # Without a 2-D grid: the bars alone; a sweep of many jobs gets a taller picture.
    jobs = [dict(j, params={"optimizer.lr": j["params"]["optimizer.lr"]}) for j in jobs[:2]]
    figure = summary_figure(tmp_path, jobs, "val/acc")
    assert len(figure.axes) == 1 and tuple(figure.bbox.size) == (800, 450)
    assert tuple(summary_figure(tmp_path, jobs * 30, "val/acc").bbox.size) == (800, 1210)


def test_a_sweep_of_other_values_into_a_used_sweep_directory_runs_nothing(
        lr_sweep: Sweep, tmp_path) -> None:
    """Job #1 would have resumed the run directory of another learning rate as its own (and
    reported its result). A job's identity is its whole override set: a value every job shares
    (a longer schedule) is another job too; the same command resumes. (Into a copy of the
    session's sweep of optimizer.lr=0.01,0.003.)"""
    assert lr_sweep.returncode == 0, lr_sweep.output[-2000:]
    sweep = lr_sweep.copy_to(tmp_path)
    same_values = LR_SWEEP[:-1]
    other, jobs = multirun(tmp_path, *same_values, "optimizer.lr=0.01,0.02")
    assert other.returncode == 2 and len(jobs) == 2  # (the first sweep's returns only)
    assert ("was used by a sweep of other values: job #1: its run directory "
            f"{sweep / '1'} holds a job of optimizer.lr=0.003, this one is "
            "optimizer.lr=0.02") in other.stdout + other.stderr
    assert "optimizer.lr=0.003" in (sweep / "1" / ".hydra" / "overrides.yaml"
                                    ).read_text()  # untouched
    longer, jobs = multirun(tmp_path, *[o.replace("=3", "=4") if "max_epochs" in o else o
                                        for o in LR_SWEEP])
    assert longer.returncode == 2 and len(jobs) == 2, longer.stderr[-2000:]
    assert (f"job #0: its run directory {sweep / '0'} holds a job of "
            "trainer.max_epochs=3, this one is trainer.max_epochs=4") in longer.stdout
    same, jobs = multirun(tmp_path, *LR_SWEEP)
    assert same.returncode == 0 and len(jobs) == 4, same.stderr[-2000:]


@pytest.mark.parametrize("subdir, name", [(None, "0"), ("j${hydra.job.id}", "j0")])
def test_a_one_job_sweep_of_another_value_into_its_directory_runs_nothing(
        tmp_path, subdir, name) -> None:
    """With one job every key is shared: seed=2 resumed seed=1's finished run and reported its
    result as seed=2's. Run directories named otherwise than by the job number too."""
    own = [f"hydra.sweep.subdir={subdir}"] if subdir else []
    first, _ = multirun(tmp_path, "seed=1", *TINY, "trainer.max_steps=2", *own)
    assert first.returncode == 0, first.stderr[-2000:]
    other, jobs = multirun(tmp_path, "seed=2", *TINY, "trainer.max_steps=2", *own)
    assert other.returncode == 2 and len(jobs) == 1, other.stderr[-2000:]
    assert (f"job #0: its run directory {tmp_path / 'sweep' / name} holds a job of seed=1, "
            "this one is seed=2") in other.stdout + other.stderr
