"""Metric sinks of rank 0: `metrics.csv` always; TensorBoard, MLflow and Weights & Biases
when the `logger` group asks."""

from __future__ import annotations

import csv
import io
import logging
import urllib.parse
from pathlib import Path
from typing import Any

from app.config import LoggerConfig
from app.errors import Interrupted, UserError, first_line
from app.files import appending, write_text_atomically

log = logging.getLogger(__name__)

KEY_COLUMNS = ["step", "epoch", "split"]


class CSVLogger:
    """One row per logged step and split: step, epoch, split, then the metric names.

    A metric name seen for the first time adds a column; the file is then rewritten with the
    wider header, so it stays one valid table. When a run resumes in its own directory, rows
    logged after the checkpoint it resumes from are dropped: they will be logged again.
    """

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        self.path = path
        self.columns = list(KEY_COLUMNS)
        rows: list[dict[str, Any]] = []
        kept = None
        if resume_step is not None and path.is_file():
            # A run killed while appending can leave a partial last line: it is dropped.
            with open(path, newline="") as f:  # (as written: csv's \r\n line ends)
                kept = f.read()
            lines = kept.splitlines(keepends=True)
            if lines and not lines[-1].endswith("\n"):
                lines.pop()
            reader = csv.DictReader(lines)
            self.columns = list(reader.fieldnames or KEY_COLUMNS)
            rows = [r for r in reader if int(r["step"]) <= resume_step]
        self._rewrite(rows, kept)

    def _rewrite(self, rows: list[dict[str, Any]], kept: str | None = None) -> None:
        # Written aside and renamed: a kill mid-write leaves the previous table, not half of it.
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=self.columns)
        writer.writeheader()
        writer.writerows(rows)
        # (The same table is left untouched: a re-run of a finished run changes nothing.)
        if text.getvalue() != kept:
            write_text_atomically(self.path, text.getvalue())

    def log(self, step: int, epoch: int, split: str, metrics: dict[str, float]) -> None:
        row = {"step": step, "epoch": epoch, "split": split, **metrics}
        new = [k for k in metrics if k not in self.columns]
        if new:
            # The rows are read back from the file, not kept: a long run logs millions.
            try:
                with open(self.path, newline="") as f:
                    rows = list(csv.DictReader(f))
            except FileNotFoundError:  # (removed by hand: the table starts again)
                rows = []
            self.columns += new
            self._rewrite([*rows, row])
            return
        with appending(self.path) as f:  # a failed append leaves no partial row
            csv.DictWriter(f, fieldnames=self.columns).writerow(row)


def output_root(run_dir: Path) -> Path:
    """The folder the runs go to (`outputs/` of `outputs/DAY/TIME`, of a sweep's
    `outputs/multirun/DAY/TIME/N` too): the first folder of the run directory below the
    working directory, else the run directory's parent."""
    run_dir = run_dir.resolve()
    try:
        return Path.cwd() / run_dir.relative_to(Path.cwd()).parts[0]
    except (ValueError, IndexError):
        return run_dir.parent


class MLflowLogger:
    """One MLflow run per training run: a resumed run continues it (its id is kept in the
    checkpoints and in the run directory), also when it resumes in another directory or
    after a Slurm requeue. A new MLflow run gets the flattened config as parameters."""

    def __init__(self, run_dir: Path, config: LoggerConfig, trackers: dict[str, str]) -> None:
        try:
            # Imported here: an optional extra, and about a second to import.
            import mlflow
        except ImportError as e:
            raise UserError("logger.mlflow=true needs MLflow: pip install mlflow-skinny "
                            "(or pip install -e '.[mlflow]')") from e
        self.mlflow = mlflow
        uri = config.mlflow_uri or f"sqlite:///{output_root(run_dir) / 'mlflow.db'}"
        artifacts = None
        if uri.startswith("sqlite:///"):  # SQLite creates the file, not its folder
            store = Path(uri.removeprefix("sqlite:///")).resolve().parent
            store.mkdir(parents=True, exist_ok=True)
            # Artifacts beside the database, not in ./mlruns of wherever the run started.
            artifacts = (store / "mlartifacts").as_uri()
        mlflow.set_tracking_uri(uri)
        try:
            known = mlflow.get_experiment_by_name(config.mlflow_experiment) is not None
        except mlflow.exceptions.MlflowException as e:
            if _file_store_refused(uri):
                local = Path(urllib.parse.urlparse(uri).path).resolve()
                raise UserError(
                    f"logger.mlflow_uri={uri}: a file store, which MLflow {mlflow.__version__} "
                    f"no longer opens: give a database, e.g. logger.mlflow_uri=sqlite:///"
                    f"{local.with_suffix('.db')} (or set MLFLOW_ALLOW_FILE_STORE=true)") from e
            raise
        if not known:
            mlflow.create_experiment(config.mlflow_experiment, artifact_location=artifacts)
        mlflow.set_experiment(config.mlflow_experiment)
        id_file = run_dir / ".mlflow_run_id"
        run_id = trackers.get("mlflow") or (id_file.read_text().strip() if id_file.is_file()
                                            else None)
        self.run = self._start(run_id, run_dir, uri)
        self.new = self.run.info.run_id != run_id
        trackers["mlflow"] = self.run.info.run_id
        id_file.write_text(self.run.info.run_id + "\n")

    def _start(self, run_id: str | None, run_dir: Path, uri: str) -> Any:
        name, tags = f"{run_dir.parent.name}/{run_dir.name}", {"run_dir": str(run_dir)}
        if run_id is not None:
            try:
                return self.mlflow.start_run(run_id=run_id, tags=tags)
            except self.mlflow.exceptions.MlflowException as e:
                log.warning("MLflow run %s (of the checkpoint) cannot be continued in %s (%s): "
                            "a new MLflow run starts", run_id, uri, first_line(e))
        return self.mlflow.start_run(run_name=name, tags=tags)

    def log_params(self, params: dict[str, Any]) -> None:
        # (MLflow sends them 100 at a time itself; 500 characters: its oldest value limit)
        self.mlflow.log_params({k: str(v)[:500] for k, v in params.items()})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def close(self, error: BaseException | None = None) -> None:
        status = "FINISHED" if error is None else "KILLED" if isinstance(error, (
            Interrupted, KeyboardInterrupt)) else "FAILED"
        self.mlflow.end_run(status=status)


def _file_store_refused(uri: str) -> bool:
    """Whether MLflow refuses `uri` for being a file store (a folder, `file://`: the store of
    older MLflow docs), as MLflow 3 does unless MLFLOW_ALLOW_FILE_STORE is set."""
    try:
        from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
    except ImportError:  # (an MLflow before 3: file stores are fine)
        return False
    return not MLFLOW_ALLOW_FILE_STORE.get() and urllib.parse.urlparse(uri).scheme in ("", "file")


class WandbLogger:
    """One Weights & Biases run per training run, on rank 0, written under the run directory
    (`wandb/`): a resumed or requeued run continues it (`resume="allow"` with the id kept in
    the checkpoints). `logger.wandb_mode=offline` needs no network or account: `wandb sync
    RUN_DIR/wandb/offline-run-*` uploads later, the attempts of one run into one W&B run."""

    def __init__(self, run_dir: Path, config: LoggerConfig, trackers: dict[str, str]) -> None:
        try:
            import wandb
        except ImportError as e:
            raise UserError("logger.wandb=true needs Weights & Biases: pip install wandb "
                            "(or pip install -e '.[wandb]')") from e
        id_file = run_dir / ".wandb_run_id"
        run_id = trackers.get("wandb") or (id_file.read_text().strip() if id_file.is_file()
                                           else None)
        self.new = run_id is None
        try:
            self.run = wandb.init(
                project=config.wandb_project, dir=str(run_dir), id=run_id, resume="allow",
                mode=config.wandb_mode, name=f"{run_dir.parent.name}/{run_dir.name}",
                # The console stays ours (the progress bar, the log lines): W&B reads no output.
                settings=wandb.Settings(console="off", silent=True))
        except wandb.errors.Error as e:  # no API key, no network: W&B's words, and the way out
            raise UserError(f"logger.wandb: {first_line(e)} (logger.wandb_mode="
                            f"offline logs without an account; wandb sync uploads later)") from e
        trackers["wandb"] = self.run.id
        id_file.write_text(self.run.id + "\n")

    def log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self, error: BaseException | None = None) -> None:
        self.run.finish(exit_code=0 if error is None else 1)


class MetricLogger:
    """The metric sinks of rank 0; several can be active at once (csv is always)."""

    def __init__(self, run_dir: Path, config: LoggerConfig, resume_step: int | None,
                 run_ids: dict[str, str] | None = None) -> None:
        """`run_ids`: the trackers' run ids, restored from the checkpoint on resume; filled
        here, and saved with each checkpoint."""
        self.csv = CSVLogger(run_dir / "metrics.csv", resume_step)
        self.tb = None
        if config.tensorboard:
            # Imported here, paid only when used: a slow import (docs/measurements.md).
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=resume_step)
        run_ids = {} if run_ids is None else run_ids
        self.mlflow = MLflowLogger(run_dir, config, run_ids) if config.mlflow else None
        self.trackers: list[MLflowLogger | WandbLogger] = [self.mlflow] if self.mlflow else []
        try:
            if config.wandb:
                self.trackers.append(WandbLogger(run_dir, config, run_ids))
        except BaseException as e:
            self.close(e)  # the sinks opened already end with the error
            raise

    def log(self, step: int, epoch: int, split: str, metrics: dict[str, float]) -> None:
        self.csv.log(step, epoch, split, metrics)
        named = {f"{split}/{k}": v for k, v in metrics.items()}
        if self.tb is not None:
            for name, value in named.items():
                self.tb.add_scalar(name, value, step)
        for tracker in self.trackers:
            tracker.log(step, named)

    def log_config(self, config: Any) -> None:
        """The run's config: as text (TensorBoard, MLflow), and flattened as the trackers'
        parameters, so that runs can be filtered by learning rate or model."""
        from omegaconf import OmegaConf

        from app.flat import leaves

        node = OmegaConf.structured(config)
        text = OmegaConf.to_yaml(node)
        if self.tb is not None:
            self.tb.add_text("config", f"```\n{text}\n```")
        if self.mlflow is not None:
            self.mlflow.mlflow.log_text(text, "config.yaml")
        for tracker in self.trackers:  # once, in a new tracker run: a parameter cannot change
            if tracker.new:
                tracker.log_params(leaves(node))

    def close(self, error: BaseException | None = None) -> None:
        """`error`: what stopped the run early (None: it ended)."""
        if self.tb is not None:
            self.tb.close()
        for tracker in self.trackers:
            tracker.close(error)
