"""`run=DIR`: evaluate, predict, export and fine-tune an earlier run (a sweep's job here) by its
directory, with nothing retyped: the model, data and precision come from its saved config,
the weights from its best.pt (or `ckpt=last`); the command line still wins."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from app.errors import UserError
from conftest import LR_SWEEP, Sweep, run_job


@pytest.fixture(scope="module")
def sweep(lr_sweep: Sweep) -> Path:
    """A real sweep of two jobs of settings other than the defaults (an evaluation that retyped
    nothing must still build this model, on this data), as the CLI writes it (each job's
    .hydra/config.yaml); one, shared by the pytest workers and the files that read it."""
    assert lr_sweep.returncode == 0, lr_sweep.output[-3000:]
    return lr_sweep.dir


def _best(sweep: Path) -> dict[str, float]:
    with open(sweep / "summary.csv", newline="") as f:
        return {row["job"]: float(row["best"]) for row in csv.DictReader(f)}


def test_evaluating_a_run_by_its_directory_gives_the_metric_of_training(sweep, tmp_path) -> None:
    best = _best(sweep)
    for job in ("0", "1"):
        evaluated = run_job(tmp_path / f"eval{job}", "trainer=eval", f"run={sweep / job}")
        assert evaluated.value == best[job]  # val/acc of best.pt, recomputed
        record = json.loads((tmp_path / f"eval{job}" / "eval.json").read_text())
        assert record["ckpt"] == str(sweep / job / "checkpoints" / "best.pt")
        assert "model, data, precision from its config" in evaluated.output


def test_ckpt_last_and_an_explicit_path(sweep, tmp_path) -> None:
    run_job(tmp_path / "last", "trainer=eval", f"run={sweep / '0'}", "ckpt=last")
    record = json.loads((tmp_path / "last" / "eval.json").read_text())
    assert record["ckpt"] == str(sweep / "0" / "checkpoints" / "last.pt")
    other = sweep / "1" / "checkpoints" / "last.pt"  # the other job's weights, same model
    run_job(tmp_path / "path", "trainer=eval", f"run={sweep / '0'}", f"ckpt={other}")
    assert json.loads((tmp_path / "path" / "eval.json").read_text())["ckpt"] == str(other)


def test_the_command_line_wins_and_a_difference_is_one_line(sweep, tmp_path) -> None:
    job = run_job(tmp_path / "bigger", "trainer=eval", f"run={sweep / '0'}",
                  "data.val_batch_size=256", "precision=bf16-mixed")
    said = [line for line in job.output.splitlines() if "differs from the run" in line]
    assert len(said) == 1 and "precision=bf16-mixed (the run: 32)" in said[0], job.output
    assert "data.val_batch_size" not in said[0]  # (the run's value: not a difference)
    with pytest.raises(UserError, match="does not match the model"):
        run_job(tmp_path / "other", "trainer=eval", f"run={sweep / '0'}",
                "model.channels=[8,32]")


def test_predict_export_and_fine_tune_from_a_run(sweep, tmp_path) -> None:
    run_job(tmp_path / "predict", "trainer=predict", f"run={sweep / '1'}")
    assert (tmp_path / "predict" / "predictions.png").is_file()
    run_job(tmp_path / "export", "trainer=export", f"run={sweep / '1'}")
    assert list((tmp_path / "export").rglob("model.pt2"))
    tuned = run_job(tmp_path / "tune", f"run={sweep / '1'}", "trainer.max_epochs=1")
    assert f"loaded weights from {sweep / '1' / 'checkpoints' / 'best.pt'}" in tuned.output


@pytest.mark.parametrize("make, words", [
    (lambda d: None, "no such run directory"),
    (lambda d: d.mkdir(), "not a run directory (it has no .hydra/config.yaml)"),
    (lambda d: ((d / ".hydra").mkdir(parents=True),
                (d / ".hydra" / "config.yaml").write_text("model: [unclosed\n")),
     "its .hydra/config.yaml does not load"),
    (lambda d: ((d / ".hydra").mkdir(parents=True),
                (d / ".hydra" / "config.yaml").write_text("precision: '32'\n")),
     "the run has no checkpoint"),
], ids=["missing", "empty", "broken-config", "no-checkpoint"])
def test_what_is_not_a_usable_run_is_one_line(tmp_path, make, words) -> None:
    run = tmp_path / "run"
    make(run)
    with pytest.raises(UserError, match=words.replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.")):
        run_job(tmp_path / "eval", "trainer=eval", f"run={run}")


def test_a_run_checkpoint_word_without_a_run_is_refused(tmp_path) -> None:
    with pytest.raises(UserError, match="ckpt=best names a checkpoint of a run"):
        run_job(tmp_path / "eval", "trainer=eval", "ckpt=best")


def test_run_and_resume_together_are_refused(sweep, tmp_path) -> None:
    with pytest.raises(UserError, match="choose one"):
        run_job(tmp_path / "both", f"run={sweep / '0'}",
                f"resume={sweep / '1' / 'checkpoints' / 'last.pt'}")


def test_a_key_the_runs_model_lacks_is_named_and_a_file_is_not_a_run(sweep, tmp_path,
                                                                     caplog) -> None:
    from hydra import compose, initialize_config_dir

    from app.from_run import apply_run
    from conftest import CONF_DIR

    overrides = ["trainer=eval", f"run={sweep / '0'}", "+model.hidden=[7]"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose("config", overrides=overrides)
    with caplog.at_level("WARNING", logger="app.from_run"):
        apply_run(composed, overrides)
    assert "model.hidden=[7] (the run has no model.hidden)" in caplog.text
    with pytest.raises(UserError, match="a file, not a run directory"):
        run_job(tmp_path / "file", "trainer=eval",
                f"run={sweep / '0' / 'checkpoints' / 'best.pt'}")


def test_resuming_a_finished_run_longer_warns_that_its_schedule_ended(sweep, tmp_path) -> None:
    import shutil

    run = tmp_path / "again"
    shutil.copytree(sweep / "0", run)
    job = run_job(run, *LR_SWEEP[:3], "trainer.max_epochs=4", "optimizer.lr=0.01")
    assert "resumed with trainer.max_epochs=4 (saved: 3): the learning-rate schedule goes on " \
           "as it was saved" in job.output, job.output[-2000:]


def test_a_runs_relative_data_root_is_read_from_where_the_run_was_started(tmp_path, monkeypatch,
                                                                           caplog) -> None:
    """A run trained with data.root=shapes, started in `started`: evaluated from another folder,
    its data is still started/shapes (it was "no such folder"), and the run= line says so."""
    from hydra import compose, initialize_config_dir

    from app.config import register_schemas
    from app.from_run import apply_run
    from conftest import CONF_DIR

    register_schemas()
    started, elsewhere, run = tmp_path / "started", tmp_path / "elsewhere", tmp_path / "run"
    for folder in (started / "shapes", elsewhere, run / ".hydra", run / "checkpoints"):
        folder.mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(
        "data:\n  _target_: app.data.ImageFolder\n  root: shapes\n  train_split: train\n"
        "precision: '32'\n")
    (run / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    cwd: {started}\n")
    (run / "checkpoints" / "best.pt").write_bytes(b"")
    (started / "train").mkdir()  # (a folder by a split's name: train_split is not a path)

    def data(*overrides: str) -> dict:
        overrides = ("trainer=eval", f"run={run}", *overrides)
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            composed = compose("config", overrides=list(overrides))
        caplog.clear()
        with caplog.at_level("INFO", logger="app.from_run"):
            return dict(apply_run(composed, list(overrides)).data)

    monkeypatch.chdir(elsewhere)
    assert data() == {"_target_": "app.data.ImageFolder", "root": str(started / "shapes"),
                      "train_split": "train"}
    assert f"run={run}: data, precision from its config (data.root=shapes as " \
           f"{started / 'shapes'}: relative to {started}, where the run was started), " \
           f"weights from" in caplog.text
    assert data("+data.root=mine")["root"] == "mine"  # the command line's: relative to here
    (started / "shapes").rmdir()
    assert data()["root"] == "shapes"  # (not there: left as the run had it, and said)
    assert f"data.root=shapes (from its config) is neither in {started}, where the run was " \
           "started, nor here: give data.root=/ABS/PATH" in caplog.text
    (started / "shapes").mkdir()
    monkeypatch.chdir(started)  # from the folder it was started in: as it was
    assert data()["root"] == "shapes" and "relative to" not in caplog.text
