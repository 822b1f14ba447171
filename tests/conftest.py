"""Shared helpers: run the real CLI in a subprocess, read what a run left behind."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from app.config import AppConfig, register_schemas

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"
HELPERS = Path(__file__).resolve().parent / "helpers"  # test-only user code (PYTHONPATH)

# A small CNN on digits: whole runs take a second or two on a 2-core CPU.
TINY = [
    "model.channels=[8,16]",
    "trainer.max_epochs=4",
    "trainer.log_every_n_steps=1",
    "trainer.progress_bar=false",
]

# A model whose checkpoint takes a while to write (~64 MB), saved after every step.
BIG = ["model=mlp", "model.hidden=[4096]", "data=synthetic", "data.input_shape=[4096]",
       "data.num_samples=400", "data.batch_size=16", "trainer.max_epochs=null",
       "trainer.max_steps=30", "trainer.val_every_n_epochs=null",
       "trainer.ckpt_every_n_steps=1", "trainer.ckpt_every_n_epochs=null",
       "trainer.keep_last=2", "trainer.progress_bar=false"]


def make_config(*overrides: str) -> AppConfig:
    """The typed config `python -m app OVERRIDES` would run, composed in this process."""
    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return OmegaConf.to_object(cfg)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_app(run_dir: Path, *overrides: str, timeout: float = 300, env: dict | None = None
            ) -> Result:
    """`python -m app` with `hydra.run.dir=run_dir`, as a user would type it."""
    cmd = [sys.executable, "-m", "app", f"hydra.run.dir={run_dir}", *overrides]
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    return Result(proc.returncode, proc.stdout, proc.stderr, run_dir)


def assert_ok(result: Result) -> Result:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.output[-4000:]}"
    return result


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def load_state(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_state(a)["model"], load_state(b)["model"]
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), f"{key} differs between {a} and {b}"



def weight_gap(a: Path, b: Path) -> float:
    """The largest absolute difference between two checkpoints' weights (0: bit-identical)."""
    wa, wb = load_state(a)["model"], load_state(b)["model"]
    assert wa.keys() == wb.keys()
    return max((wa[k].double() - wb[k].double()).abs().max().item() for k in wa)

def multirun(tmp_path, *overrides: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """`python -m app -m OVERRIDES` into tmp_path/sweep; what each job returned to Hydra."""
    record = tmp_path / "returns.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "app", "-m", *overrides, f"hydra.sweep.dir={tmp_path / 'sweep'}",
         "+hydra.callbacks.record._target_=recorder.Recorder",
         f"+hydra.callbacks.record.path={record}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(HELPERS)})
    jobs = [json.loads(line) for line in record.read_text().splitlines()] \
        if record.is_file() else []
    return proc, sorted(jobs, key=lambda j: j["num"])  # parallel jobs end in any order


def worker_pids(run_dir: Path) -> list[int]:
    """The pids the workers of a run logged (logs/rank*.log)."""
    pids = []
    for log in (run_dir / "logs").glob("rank*.log"):
        pids += [int(p) for p in re.findall(r"rank \d+ of \d+: pid (\d+)", log.read_text())]
    return pids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited; only its exit status is left


def still_alive(pids: list[int], timeout: float = 60) -> list[int]:
    """The pids among `pids` that are still running after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while [p for p in pids if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def wait_for_rows(run_dir: Path, rows: int, timeout: float = 120) -> None:
    """Wait until a run being trained has logged more than `rows` lines of metrics.csv."""
    metrics = run_dir / "metrics.csv"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) > rows:
            return
        time.sleep(0.05)


def check_summary(sweep: Path, num_jobs: int) -> list[dict[str, str]]:
    """The sweep's summary files exist and each row agrees with that job's metrics.csv."""
    with open(sweep / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == num_jobs
    for row in rows:
        val = [float(r["acc"]) for r in read_metrics(sweep / row["job"]) if r["split"] == "val"]
        assert float(row["best"]) == max(val) and float(row["final"]) == val[-1]
    assert (sweep / "summary.md").is_file()
    assert (sweep / "summary.png").read_bytes()[:4] == b"\x89PNG"
    return rows


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny training run, shared by the tests that need a checkpoint."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    assert_ok(run_app(run_dir, *TINY))
    return run_dir
