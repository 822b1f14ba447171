"""Shared helpers: run a job in this process (`run_job`) or the real CLI in a subprocess
(`run_app`, where the process is the subject), read what a run left behind."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# What `python -m app` sets before MKL's first call (app.env.reproducible_matmuls):
# the in-process runs below must round as the CLI's do, and before torch computes anything.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
# One intra-op thread for every `python -m app` the tests start (they inherit this), as for
# the jobs run in this process below: several pytest workers on two cores, each process taking
# a thread per core, spin against each other (OpenMP's waiting threads burn the other's CPU).
# Ranks started by the app share the cores by themselves (share_cpu_threads). A test that is
# about the thread count sets distributed.omp_threads, which wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from app.config import AppConfig, register_schemas, to_app_config  # noqa: E402
from app.from_run import apply_run  # noqa: E402
from app.resolvers import register_resolvers  # noqa: E402

torch.set_num_threads(1)  # (OMP_NUM_THREADS above; set here too for a torch already imported)

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
class Job:
    """What a job run in this process returned, and the lines it logged (as the CLI prints)."""

    value: float | None
    run_dir: Path
    output: str


def run_job(run_dir: Path, *overrides: str, user_code: Path | None = None) -> Job:
    """`python -m app OVERRIDES hydra.run.dir=run_dir` in this process: the config composed,
    converted and validated as the entry does, then the same `launch()` (a bad config raises
    its UserError here instead of exiting 2; failed workers raise WorkerFailed). With
    `devices=N` the workers start as the CLI starts them, from the worker server
    (forkserver) this process keeps for all its runs: a DDP run costs a second or two instead
    of a new interpreter, a new server and its imports. Their lines go to their logs
    (`logs/rank*.log`), not to `Job.output`. `user_code`: a folder of the user's modules, as
    PYTHONPATH gives it to the CLI (workers get this process's sys.path). The process is left
    as it was (`_process_left_alone`), so the runs of one pytest worker cannot affect each
    other."""
    from app.env import SINGLE  # (torch, the whole app: once per test process)
    from app.launch.run import launch

    register_schemas()
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose("config", overrides=list(overrides))
    run_dir.mkdir(parents=True, exist_ok=True)  # (Hydra makes it for `python -m app`)
    with _process_left_alone(user_code) as output:
        cfg = to_app_config(apply_run(composed, list(overrides)))
        value = launch(cfg, run_dir, SINGLE)  # a test process is never a rank of a job
    return Job(value, run_dir, output.getvalue())


# The signals whose handlers the app sets while it runs (stop, requeue, stack dumps), and
# SIGCHLD, which PyTorch's DataLoader takes over in a process that did not keep it out.
_SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD]


@contextlib.contextmanager
def _process_left_alone(user_code: Path | None) -> Iterator[io.StringIO]:
    """Capture the log lines of a run (root logger at INFO, Hydra's format), and afterwards
    put back what a run sets for the whole process: torch's determinism, cuDNN and TF32
    flags, the thread count, the default dtype, environment variables, signal handlers, the
    logging setup, the working directory, sys.path and the user's modules."""
    flags = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    cudnn = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
             torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    environ, cwd, path = dict(os.environ), os.getcwd(), list(sys.path)
    handlers = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    root = logging.getLogger()
    root_state = (root.level, list(root.handlers))
    output = io.StringIO()
    capture = logging.StreamHandler(output)
    capture.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    root.addHandler(capture)
    root.setLevel(logging.INFO)
    if user_code is not None:
        sys.path.insert(0, str(user_code))
    # A DataLoader with workers made directly by an earlier test of this process installed
    # PyTorch's SIGCHLD handler, which a fresh `python -m app` never has (the app keeps it out):
    # with it, a killed loader worker is told by the handler, not by the app.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        yield output
    finally:
        root.setLevel(root_state[0])
        root.handlers[:] = root_state[1]
        torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
        (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
         torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) = cudnn
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        sys.path[:] = path
        if user_code is not None:  # the next test's user code may reuse a module name
            for name, module in list(sys.modules.items()):
                if str(getattr(module, "__file__", None) or "").startswith(str(user_code)):
                    del sys.modules[name]
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


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
        # (PYTHONPATH kept: where app is not installed, as on the GPU machine, it finds app)
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(HELPERS), os.environ.get("PYTHONPATH")]))})
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


def check_summary(sweep: Path, num_jobs: int, completed_only: bool = False
                  ) -> list[dict[str, str]]:
    """The sweep's summary files exist and each row (of a completed job, if `completed_only`)
    agrees with that job's metrics.csv."""
    with open(sweep / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == num_jobs
    for row in rows:
        if completed_only and row["status"] != "completed":
            continue
        val = [float(r["acc"]) for r in read_metrics(sweep / row["job"]) if r["split"] == "val"]
        assert float(row["best"]) == max(val) and float(row["final"]) == val[-1]
    assert (sweep / "summary.md").is_file()
    assert (sweep / "summary.png").read_bytes()[:4] == b"\x89PNG"
    return rows


# Files whose tests share one module fixture (a training run) run on one pytest worker; the
# tests of the other files spread one by one over the workers (`make test`: --dist loadgroup),
# so one long file does not set the suite's end. (The Slurm tests run side by side: the
# cluster's nodes have room for several of their small jobs at once.)
ONE_WORKER = ("test_resume.py", "test_checkpoint_faults.py")
# The files of the longest tests (Slurm jobs, signals, timeouts, DDP runs) are handed out
# first, so that the workers end together instead of one finishing a long test alone; those
# of a test over 30 s in CI first of all (the stock launcher's own tests, a requeue, a resumed
# Optuna sweep, a sweep larger than MaxArraySize, a local sweep's stop, a kill during sharded
# writes, a requeue after a killed task or a failed node, a refused command's record).
LONG_FIRST = ("test_good_citizen.py", "test_slurm.py", "test_optuna_resume.py",
              "test_cluster_ops.py", "test_submit_stop.py", "test_fsdp.py",
              "test_slurm_recovery.py", "test_run_record.py", "test_failfast.py",
              "test_resume.py", "test_ddp.py", "test_watchdog.py", "test_sweeps.py",
              "test_features.py", "test_reliability.py")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the test ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in ONE_WORKER:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))  # (stable)


# The runs several test files read, made once per test session (tests/shared_runs.py): its
# fixtures are imported here for pytest to find them.
from shared_runs import (  # noqa: E402,F401
    FAULTY_SWEEP,
    LR_SWEEP,
    OPTUNA_SWEEP,
    Sweep,
    built_once,
    faulty_sweep,
    lr_sweep,
    multirun_once,
    optuna_sweep,
    trained,
)

# hydra-submitit-launcher's own tests run in their folder, as their authors run them
# (tests/test_good_citizen.py): their module changes the working directory when imported.
collect_ignore = ["peer"]
