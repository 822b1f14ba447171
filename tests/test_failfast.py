"""A failure anywhere ends the whole job promptly, says where, and leaves no process behind.

The faults and signals whose driver is the same (start a job of two ranks, maybe do something
to it, read how it ended) are one table, TRIALS; the trials with steps of their own follow it,
and the launcher's logic runs in this process (`run_job`) where the console is not the
subject."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from app.errors import WorkerFailed
from conftest import (
    HELPERS,
    REPO,
    TINY,
    alive,
    assert_ok,
    assert_same_weights,
    load_state,
    read_metrics,
    run_app,
    run_job,
    still_alive,
    wait_for_rows,
    worker_pids,
)


def _start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "app", f"hydra.run.dir={run_dir}", *overrides], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(HELPERS)})


def _pid_of_rank(run_dir: Path, rank: int) -> int:
    log = (run_dir / "logs" / f"rank{rank}.log").read_text()
    return int(re.search(rf"rank {rank} of \d+: pid (\d+)", log)[1])


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


# -- the table: a fault or a signal, and how the job must end ------------------------------------

@dataclass(frozen=True)
class Trial:
    """One `python -m app` of two ranks, in a process group of its own (a terminal's foreground
    job); the launcher and its workers are the subject. `act`, once 10 metric rows are logged,
    does something to the job and returns values for the words ({server}); `said` are in the
    console ({step}: the step of checkpoints/last.pt, which `saved` requires), `not_said` are
    not; `files` maps a file of the run to words in it; `status` is result.json's. Every trial
    also ends with no process of the job left running (a loader worker included)."""

    pins: str  # the behaviour the row pins
    overrides: tuple[str, ...]
    exit_code: int
    said: tuple[str, ...]
    not_said: tuple[str, ...] = ("Traceback",)
    act: Callable[[subprocess.Popen, Path], dict] | None = None
    saved: bool = False
    files: dict[str, tuple[str, ...]] = field(default_factory=dict)
    status: str | None = None


def _sigterm_to_rank_1(proc: subprocess.Popen, run_dir: Path) -> dict:
    os.kill(_pid_of_rank(run_dir, 1), signal.SIGTERM)
    return {}


def _ctrl_c(proc: subprocess.Popen, run_dir: Path) -> dict:
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: every process of the group
    return {}


def _sigkill_to_rank_1(proc: subprocess.Popen, run_dir: Path) -> dict:
    os.kill(_pid_of_rank(run_dir, 1), signal.SIGKILL)
    return {}


def _sigterm_to_the_group(proc: subprocess.Popen, run_dir: Path) -> dict:
    os.killpg(proc.pid, signal.SIGTERM)  # a closed session, `kill -- -PGID`: the server too
    return {}


def _kill_the_worker_server(proc: subprocess.Popen, run_dir: Path) -> dict:
    server = _parent(_pid_of_rank(run_dir, 0))
    assert server != proc.pid and _parent(server) == proc.pid  # the forkserver
    os.kill(server, signal.SIGKILL)
    return {"server": server}


FAULTY = [*TINY, "devices=2", "model._target_=faults.FaultyCNN", "distributed.timeout_s=5"]
TRAINING = (*TINY, "devices=2", "trainer.max_epochs=400")  # (until it is stopped)

TRIALS = {
    "a failing rank": Trial(
        "a rank's exception ends the job at once in one console line; the rank's traceback is "
        "in its own log", (*FAULTY, "+model.fault=raise"), 1,
        said=("rank 1 failed: RuntimeError: injected fault",),
        files={"logs/rank1.log": ("Traceback", "injected fault")}),
    "a user error on rank 1": Trial(
        "a UserError on one rank exits 2, as with one process (rank 0 fails too, in its next "
        "collective: the cause and the status are rank 1's)",
        (*FAULTY, "+model.fault=user_error"), 2,
        said=("rank 1 failed: UserError: injected bad input",), status="failed",
        files={"result.json": ("UserError: injected bad input",)}),
    "a failure of rank 0": Trial(
        "rank 0 serves the store: once it is gone, the other rank's watchdog printed a C++ "
        "warning with its stack on every call (some 15 lines a second); none now",
        (*FAULTY, "+model.fault=user_error", "+model.fault_rank=0"), 2,
        said=("rank 0 failed: UserError: injected bad input",),
        not_said=("Traceback", "TCPStore", "frame #")),
    "SIGTERM to one worker": Trial(
        "a cluster agent or a user may signal one process of the job, not its launcher: a stop "
        "with a checkpoint, not a failure", TRAINING, 128 + signal.SIGTERM, act=_sigterm_to_rank_1,
        saved=True, status="interrupted",
        said=("stopped by SIGTERM sent to a worker; the workers saved a checkpoint at step "
              "{step}",)),
    "Ctrl-C": Trial(
        "Ctrl-C (SIGINT to every process of the group) stops every process with a checkpoint",
        TRAINING, 128 + signal.SIGINT, act=_ctrl_c, saved=True, said=("stopped by SIGINT",)),
    "SIGKILL to a rank with loader workers": Trial(
        "a rank killed outright (the OOM killer) leaves none of its loader workers running: "
        "they are its children, not those of a forkserver of its own, which outlived it",
        (*TRAINING, "data.num_workers=1"), 1, act=_sigkill_to_rank_1,
        said=("rank 1 (pid", "was killed by SIGKILL; the other workers were stopped")),
    "SIGTERM to the process group": Trial(
        "a SIGTERM to every process of the job (the worker server included, which it ends) is "
        "a stop with a checkpoint, not the server's death", TRAINING, 128 + signal.SIGTERM,
        act=_sigterm_to_the_group, saved=True, status="interrupted",
        said=("stopped by SIGTERM; the workers saved a checkpoint at step {step}",),
        not_said=("Traceback", "worker server")),
    "SIGTERM to the process group with loader workers": Trial(
        "the loader workers get it too (a closed session, Slurm's scancel), and ignore it as "
        "PyTorch makes them ignore Ctrl-C: killed by it, they failed the stop's last batches "
        "(no validation: a worker starting has PyTorch's handler until it ignores it)",
        (*TRAINING, "data.num_workers=1", "trainer.val_every_n_epochs=null"),
        128 + signal.SIGTERM, act=_sigterm_to_the_group,
        saved=True, status="interrupted",
        said=("stopped by SIGTERM; the workers saved a checkpoint at step {step}",),
        not_said=("Traceback", "data loading failed")),
    "a killed worker server": Trial(
        "the forkserver killed under the workers ends them, said in one line (no exit codes)",
        TRAINING, 1, act=_kill_the_worker_server,
        said=("the worker server (forkserver) ended under the workers: they were stopped",),
        not_said=("Traceback", "exit codes")),
}


@pytest.mark.parametrize("name", list(TRIALS))
def test_a_fault_or_a_signal_ends_the_job_as_the_table_says(name, tmp_path) -> None:
    trial = TRIALS[name]
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    with open(out, "w") as sink:  # (a pipe would wait for workers that outlive the launcher)
        proc = subprocess.Popen(
            [sys.executable, "-m", "app", f"hydra.run.dir={run_dir}", *trial.overrides],
            cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(HELPERS)})
    try:
        values, started = {}, []
        if trial.act is not None:
            wait_for_rows(run_dir, 10)
            started = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
            values = trial.act(proc, run_dir)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # (Read once what the job started has ended: what it prints on its way out counts.)
    left = still_alive(started, timeout=15)
    for pid in left:  # (not for the next test to find)
        os.kill(pid, signal.SIGKILL)
    output = out.read_text()
    said = f"{name}: {trial.pins}\n{output[-3000:]}"  # (a failure names what the row pins)
    assert proc.returncode == trial.exit_code, said
    workers = worker_pids(run_dir)
    assert len(workers) == 2 and not [p for p in workers if alive(p)], said
    assert not left, (left, said)
    if trial.saved:
        values["step"] = load_state(run_dir / "checkpoints" / "last.pt")["loop"]["step"]
        assert values["step"] > 0
    assert all(words.format(**values) in output for words in trial.said), said
    assert not [words for words in trial.not_said if words in output], said
    for file, words in trial.files.items():
        text = (run_dir / file).read_text()
        assert all(w in text for w in words), (file, words, text[-3000:])
    if trial.status is not None:
        assert json.loads((run_dir / "result.json").read_text())["status"] == trial.status


# -- in this process, and the trials of their own -----------------------------------------------

@pytest.mark.parametrize("fault,words", [
    ("kill", ["rank 1 (pid", "killed by SIGKILL"]),
    ("hang", ["distributed.timeout_s=5", "rank(s) 1 did not exit"]),
])
def test_a_rank_that_dies_or_hangs_ends_the_job(fault, words, tmp_path) -> None:
    # The workers spawned from this process (the launcher's code, not its console, is the
    # subject); WorkerFailed is the CLI's exit status 1 (tests/test_error_types.py).
    run_dir = tmp_path / "run"
    with pytest.raises(WorkerFailed) as failed:
        run_job(run_dir, *FAULTY, f"+model.fault={fault}", user_code=HELPERS)
    for word in words:
        assert word in str(failed.value), str(failed.value)
    pids = worker_pids(run_dir)
    assert len(pids) == 2 and not [p for p in pids if alive(p)]


def test_sigterm_to_the_launcher_checkpoints_and_resume_is_exact(tmp_path) -> None:
    """The launcher's stop (its console, exit status and workers are the subject), then the
    resume of the checkpoint both ranks saved at it: bit-identical to an uninterrupted run. The
    resume and the reference run here (`run_job`: the same overrides and run directory, so
    resume=auto, as the same command again; the CLI's own resume: tests/test_resume.py)."""
    overrides = [*TINY, "devices=2", "trainer.max_epochs=6", "trainer.ckpt_every_n_epochs=null"]
    run_dir = tmp_path / "interrupted"
    proc = _start(run_dir, *overrides)
    wait_for_rows(run_dir, 30)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "Traceback" not in output
    stopped_at = load_state(run_dir / "checkpoints" / "last.pt")["loop"]["step"]
    assert 0 < stopped_at < 6 * 11
    # (Rank 0 once took rank 1's stop, recorded a moment earlier, for a failure: "no
    # checkpoint was saved at the stop" although both had saved.)
    assert f"stopped by SIGTERM; the workers saved a checkpoint at step {stopped_at}" in \
        output, output[-3000:]
    assert not [p for p in worker_pids(run_dir) if alive(p)]

    run_job(run_dir, *overrides)  # resume=auto
    assert f"resumed from {run_dir / 'checkpoints' / 'last.pt'} at step {stopped_at}" in \
        (run_dir / "logs" / "rank0.log").read_text()
    reference = run_job(tmp_path / "reference", *overrides).run_dir  # (uninterrupted)
    assert_same_weights(reference / "checkpoints" / "last.pt",
                        run_dir / "checkpoints" / "last.pt")
    assert read_metrics(run_dir) == read_metrics(reference)


def test_sigterm_before_training_records_the_run_as_interrupted(tmp_path) -> None:
    """A SIGTERM while the data set is built: exit 143, one line, result.json "interrupted"
    (it ended the process at once: no line, no result.json; app.status said "killed?"), and
    the run's lock is free for the next command (here, `run_job`)."""
    run_dir, marker = tmp_path / "run", tmp_path / "building"
    proc = _start(run_dir, *TINY, "data._target_=faults.SlowDigits", "+data.setup_s=60",
                  f"+data.marker={marker}")
    for _ in range(600):
        if marker.exists() or proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "stopped by SIGTERM" in output and "Traceback" not in output
    assert json.loads((run_dir / "result.json").read_text())["status"] == "interrupted"
    run_job(run_dir, *TINY, "trainer.max_steps=2")  # (a held lock: RunDirInUse)
    assert load_state(run_dir / "checkpoints" / "last.pt")["loop"]["step"] == 2


def _stop_with_rank_1_stopped(run_dir: Path, *overrides: str) -> tuple[int, str, list[Path]]:
    """SIGSTOP rank 1, then SIGTERM the launcher: its exit code and output, and the
    checkpoints there were before."""
    proc = _start(run_dir, *TINY, "devices=2", "trainer.max_epochs=400", *overrides)
    wait_for_rows(run_dir, 30)  # past the checkpoint of epoch 1
    os.kill(_pid_of_rank(run_dir, 1), signal.SIGSTOP)
    before = sorted((run_dir / "checkpoints").glob("step-*.pt"))
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=240)
    assert not [p for p in worker_pids(run_dir) if alive(p)]
    assert "Traceback" not in output
    return proc.returncode, output, before


def test_a_stop_that_a_stopped_rank_blocks_says_that_no_checkpoint_was_saved(tmp_path) -> None:
    run_dir = tmp_path / "run"
    code, output, before = _stop_with_rank_1_stopped(
        run_dir, "distributed.stall_timeout_s=null", "distributed.timeout_s=10")
    assert code == 128 + signal.SIGTERM, output[-3000:]
    # None written at the stop. A periodic checkpoint (an epoch's end) may still have been
    # written after `before` was listed (the background writer, slow under load; it failed
    # a fresh `make test` once): none at another step.
    after = sorted((run_dir / "checkpoints").glob("step-*.pt"))
    per_epoch = int(re.search(r"(\d+) steps/epoch",
                              (run_dir / "logs" / "rank0.log").read_text())[1])
    assert all(int(p.stem.split("-")[1]) % per_epoch == 0 for p in set(after) - set(before))
    # (Rank 0 fails its collective at timeout_s and reports it; under heavy load it may not
    # before the launcher's deadline, and is then named too.)
    assert re.search(r"stopped by SIGTERM, but no checkpoint was saved at the stop "
                     r"\(rank\(s\) (0, )?1 did not stop", output), output[-3000:]
    # (That later periodic checkpoint, where there is one, is the last: CI saw one.)
    assert f"the last checkpoint is checkpoints/{after[-1].name}" in output, output[-3000:]
    assert "saved a checkpoint" not in output


def test_a_stop_with_a_stopped_rank_reports_what_was_saved(tmp_path) -> None:
    # The stall watchdog wakes the stopped rank to write its stacks (SIGCONT): the stop may
    # then complete with a checkpoint, or not. Either way the launcher says which.
    run_dir = tmp_path / "run"
    code, output, before = _stop_with_rank_1_stopped(run_dir, "distributed.stall_timeout_s=5")
    assert code == 128 + signal.SIGTERM, output[-3000:]
    saved = re.search(r"stopped by SIGTERM; the workers saved a checkpoint at step (\d+)", output)
    after = sorted((run_dir / "checkpoints").glob("step-*.pt"))
    if saved:
        assert after[-1].name == f"step-{int(saved[1]):08d}.pt" and after != before
    else:
        assert "stopped by SIGTERM, but no checkpoint was saved at the stop" in output, output
        # A periodic checkpoint (an epoch's end) may still have been written after `before`
        # was listed (the background writer, slow under load); none at another step.
        per_epoch = int(re.search(r"(\d+) steps/epoch",
                                  (run_dir / "logs" / "rank0.log").read_text())[1])
        assert all(int(p.stem.split("-")[1]) % per_epoch == 0 for p in set(after) - set(before))


@pytest.mark.parametrize("devices", ["devices=1", "devices=2"])
def test_a_sigterm_after_the_run_completed_leaves_it_completed(tmp_path, devices) -> None:
    run_dir = tmp_path / "run"
    # (the helper callback keeps the process 5 s after its job: the window to signal it in)
    proc = _start(run_dir, *TINY, devices, "trainer.max_epochs=1",
                  "+hydra.callbacks.linger._target_=linger.Linger",
                  "+hydra.callbacks.linger.seconds=5")
    result = run_dir / "result.json"
    while proc.poll() is None and not result.is_file():
        time.sleep(0.01)
    assert json.loads(result.read_text())["status"] == "completed"
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    assert json.loads(result.read_text())["status"] == "completed"
    assert "SIGTERM arrived after the run had completed: nothing was stopped" in output


FINALIZING = """
import sys, time
from app.signals import stop_signals_stop_nothing
stop_signals_stop_nothing()
class Slow:  # a module global: its __del__ runs as the interpreter finalizes
    def __del__(self):
        print("finalizing", flush=True)
        time.sleep(2)
slow = Slow()
"""


def test_a_signal_while_the_process_finalizes_stops_nothing(tmp_path) -> None:
    """Python puts back the default action of the signals it handles when it finalizes (torch's
    clean-up makes that a few tenths of a second): a SIGTERM there ended a completed run with
    -15. From the first exit handler on, the stop signals are ignored."""
    out = tmp_path / "out.txt"
    with open(out, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-c", FINALIZING], cwd=REPO, stdout=sink,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while "finalizing" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, out.read_text()


def test_a_killed_launcher_leaves_nothing_behind_after_the_next_start(tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, *TINY, "devices=2", "trainer.max_epochs=400")
    wait_for_rows(run_dir, 30)
    # multiprocessing's folder of sockets (the worker server's): Python's own (pymp-*) was
    # left for good by a launcher killed with SIGKILL.
    sockets = list(Path(tempfile.gettempdir()).glob(f"app-mp-{proc.pid}-*"))
    assert len(sockets) == 1
    proc.kill()
    proc.wait()
    assert not still_alive(worker_pids(run_dir))
    live = Path(tempfile.gettempdir()) / f"app-mp-{os.getpid()}-kept"  # a live launcher's
    live.mkdir()
    try:
        assert_ok(run_app(run_dir, *TINY, "devices=2", "trainer.max_epochs=1"))  # (finished)
        assert not sockets[0].exists() and live.is_dir()
    finally:
        live.rmdir()
