"""Trackers across a run's life: MLflow and W&B get the flattened config as parameters, and a
run that resumes (in its directory or in another one) continues the same tracker run, its
steps going on; the store defaults to the runs' folder, not the working directory. The Slurm
requeue case is in test_slurm (the preemption test)."""

from __future__ import annotations

import os
import sys

import pytest

from app.errors import UserError
from conftest import HELPERS, TINY, read_metrics, run_job

mlflow = pytest.importorskip("mlflow")  # (an optional extra; `make install` installs it)
from mlflow.tracking import MlflowClient  # noqa: E402


def _one_run(uri: str):
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("app")
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


def _train_steps(client: MlflowClient, run_id: str) -> list[int]:
    return [m.step for m in sorted(client.get_metric_history(run_id, "train/loss"),
                                   key=lambda m: m.step)]


def test_the_config_is_logged_as_parameters(tmp_path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_job(tmp_path / "run", *TINY, "trainer.max_epochs=1", "logger=mlflow",
            f"logger.mlflow_uri={uri}", "optimizer.lr=0.003")
    _, run = _one_run(uri)
    params = run.data.params
    assert params["optimizer.lr"] == "0.003" and params["model.channels"] == "[8, 16]"
    assert params["trainer.max_epochs"] == "1" and params["model._target_"] == "app.models.CNN"


def test_a_resumed_run_continues_its_mlflow_run(tmp_path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    logged = [*TINY, "logger=mlflow", f"logger.mlflow_uri={uri}"]
    first = tmp_path / "first"
    run_job(first, *logged, "trainer.max_epochs=2")
    run_job(first, *logged, "trainer.max_epochs=3")  # resume=auto: the same directory
    # Another directory, resuming from the first's checkpoint: the id comes with it.
    other = tmp_path / "other"
    run_job(other, *logged, "trainer.max_epochs=4",
            f"resume={first / 'checkpoints' / 'last.pt'}")
    client, run = _one_run(uri)  # one MLflow run for all three
    assert run.info.run_id == (first / ".mlflow_run_id").read_text().strip() == \
        (other / ".mlflow_run_id").read_text().strip()
    last = max(int(r["step"]) for r in read_metrics(other))
    assert last > 0 and _train_steps(client, run.info.run_id) == list(range(1, last + 1))
    losses = [float(r["loss"]) for r in read_metrics(other) if r["split"] == "train"]
    history = sorted(client.get_metric_history(run.info.run_id, "train/loss"),
                     key=lambda m: m.step)
    assert [m.value for m in history][-len(losses):] == losses


def test_the_store_defaults_to_the_runs_folder(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_dir = tmp_path / "outputs" / "2026-12-04" / "10-00-00"
    run_job(run_dir, *TINY, "trainer.max_epochs=1", "logger=mlflow")
    assert (tmp_path / "outputs" / "mlflow.db").is_file()
    assert not list(elsewhere.iterdir()) and not (tmp_path / "mlruns").exists()
    assert os.getcwd() == str(tmp_path)


@pytest.mark.parametrize("store", ["file://{}", "{}"])
def test_a_file_store_that_mlflow_refuses_is_one_line(tmp_path, monkeypatch, store) -> None:
    """The store of older MLflow docs (a folder, `file://DIR`), which MLflow 3 refuses: it was
    MLflow's exception and a 52-line traceback, exit 1."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = store.format(tmp_path / "mlruns")
    with pytest.raises(UserError) as err:
        run_job(tmp_path / "run", *TINY, "trainer.max_steps=1", "logger=mlflow",
                f"logger.mlflow_uri={uri}")
    assert str(err.value) == (
        f"logger.mlflow_uri={uri}: a file store, which MLflow {mlflow.__version__} no longer "
        f"opens: give a database, e.g. logger.mlflow_uri=sqlite:///{tmp_path / 'mlruns.db'} "
        "(or set MLFLOW_ALLOW_FILE_STORE=true)")
    assert err.value.exit_code == 2


def test_a_resumed_run_continues_its_wandb_run_offline(tmp_path) -> None:
    pytest.importorskip("wandb")
    sys.path.insert(0, str(HELPERS))
    from wandb_files import offline_runs

    logged = [*TINY, "logger=wandb", "logger.wandb_mode=offline", "optimizer.lr=0.003"]
    first, other = tmp_path / "first", tmp_path / "other"
    run_job(first, *logged, "trainer.max_epochs=2")
    run_job(first, *logged, "trainer.max_epochs=3")  # resume=auto: the same directory
    run_job(other, *logged, "trainer.max_epochs=4", f"resume={first / 'checkpoints' / 'last.pt'}")
    attempts = offline_runs(first) + offline_runs(other)
    assert len(attempts) == 3 and len({a["id"] for a in attempts}) == 1  # one W&B run
    assert attempts[0]["config"]["optimizer.lr"] == 0.003  # the config, flattened
    steps = [row["_step"] for a in attempts for row in a["history"] if "train/loss" in row]
    last = max(int(r["step"]) for r in read_metrics(other))
    assert steps == list(range(1, last + 1))  # every step once, in order, across attempts


def test_wandb_online_without_an_account_is_one_clear_error(tmp_path, monkeypatch) -> None:
    """(CI has no W&B key: the run failed with W&B's login traceback.) The MLflow run opened
    before it ends as failed, not left running."""
    pytest.importorskip("wandb")
    from app.errors import UserError

    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # (no ~/.netrc: no key W&B could find)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with pytest.raises(UserError, match=r"logger\.wandb: .*(API key|log in).*"
                                        r"logger\.wandb_mode=offline"):
        run_job(tmp_path / "run", *TINY, "trainer.max_epochs=1", "logger=wandb",
                "logger.wandb_mode=online", "logger.mlflow=true", f"logger.mlflow_uri={uri}")
    _, run = _one_run(uri)
    assert run.info.status == "FAILED"
