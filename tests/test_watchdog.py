"""The progress watchdog: a rank that stops making progress ends the job, named, with every
rank's Python stack on disk (app.launch.watchdog, reading app.progress)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from app import progress
from app.errors import WorkerFailed
from app.launch import stacks, watchdog
from app.launch.stacks import DUMP_SIGNAL
from app.launch.watchdog import Peer, describe, judge, waits_for_others
from conftest import HELPERS, REPO, TINY, alive, read_metrics, run_job, wait_for_rows, worker_pids

STALL = 10.0


def _peer(rank: int, moved: float, heard: float, waiting: bool, step: int | None = 7,
          done: bool = False) -> Peer:
    """A rank whose counter last moved `moved` s ago and whose record came `heard` s ago."""
    return Peer(rank, moved_at=100.0 - moved, heard_at=100.0 - heard, ticks=3, beat=3,
                step=step, host=f"node{rank}", pid=1000 + rank, waiting=waiting, done=done,
                armed=True)


def test_no_verdict_while_any_rank_moves() -> None:
    peers = [_peer(0, moved=STALL + 5, heard=0, waiting=True),
             _peer(1, moved=STALL - 1, heard=0, waiting=False)]  # slow, but moving
    assert judge(peers, 100.0, STALL) is None


def test_a_stopped_rank_is_named_and_the_waiting_one_is_not() -> None:
    peers = [_peer(0, moved=STALL, heard=0, waiting=True),
             _peer(1, moved=STALL + 1, heard=STALL + 1, waiting=False)]  # SIGSTOP: silent
    assert [p.rank for p in judge(peers, 100.0, STALL)] == [1]
    # Its last record may even say that it waited: silence alone names it.
    peers[1].waiting = True
    assert [p.rank for p in judge(peers, 100.0, STALL)] == [1]


def test_a_rank_in_a_dead_loop_is_named() -> None:
    peers = [_peer(0, moved=STALL, heard=0, waiting=True),
             _peer(1, moved=STALL, heard=0, waiting=False),  # alive, but elsewhere
             _peer(2, moved=STALL, heard=0, waiting=True)]
    assert [p.rank for p in judge(peers, 100.0, STALL)] == [1]


def test_every_rank_waiting_is_a_stall_with_no_culprit() -> None:
    peers = [_peer(r, moved=STALL, heard=0, waiting=True) for r in range(2)]
    assert judge(peers, 100.0, STALL) == []
    assert "every rank has waited in a collective" in describe(peers, [], 100.0, STALL, Path("r"))


def test_ranks_that_ended_are_not_stalled() -> None:
    peers = [_peer(0, moved=STALL, heard=STALL, waiting=False, done=True),
             _peer(1, moved=STALL, heard=0, waiting=True)]
    assert judge(peers, 100.0, STALL) == []  # (rank 1 waits for a rank that is gone)
    assert judge([peers[0]], 100.0, STALL) is None


def test_before_every_rank_has_done_its_first_step_only_a_silent_rank_is_judged() -> None:
    """Building the data set, loading a checkpoint, compiling the model: no ticks, no stall."""
    peers = [_peer(0, moved=STALL, heard=0, waiting=True),
             _peer(1, moved=STALL, heard=0, waiting=False)]  # (compiling its first step)
    peers[1].armed = False
    assert judge(peers, 100.0, STALL) is None
    # A silent rank is judged all the same: its last record may be from before its first step.
    peers[1].heard_at = 100.0 - STALL
    assert [p.rank for p in judge(peers, 100.0, STALL)] == [1]
    # Also while the ranks that wait for it have not done theirs (it stopped in its first step
    # or while building its data: the others wait in DDP's first collective).
    peers[0].armed = False
    assert [p.rank for p in judge(peers, 100.0, STALL)] == [1]
    # But a rank that only takes long (it still publishes) is not, nor is every rank at once
    # (the store did not answer: judged by the store's own clock).
    peers[1].heard_at = 100.0
    assert judge(peers, 100.0, STALL) is None
    for p in peers:
        p.heard_at = 100.0 - STALL
    assert judge(peers, 100.0, STALL) is None
    first = Peer(1, moved_at=0.0, heard_at=0.0)
    for ticks, armed in ((1, False), (2, True)):  # armed once its first step is done
        first.update({"ticks": ticks, "beat": ticks, "step": None, "place": "training",
                      "host": "h", "pid": 1, "waiting": False, "done": False}, 1.0)
        assert first.armed is armed


def test_a_rank_writing_a_checkpoint_makes_progress() -> None:
    """A large torch.save and its fsync tick nothing while they run: `busy` is progress (a
    rank stopped in a write was never judged: the job waited for distributed.timeout_s)."""
    peer = Peer(0, moved_at=0.0, heard_at=0.0)
    record = {"ticks": 5, "beat": 1, "step": 3, "place": "training", "host": "h", "pid": 1,
              "waiting": False, "done": False}
    peer.update(record, 1.0)
    peer.update({**record, "beat": 2, "busy": True}, 50.0)  # the same ticks, but writing
    assert peer.moved_at == 50.0
    # Unless it stopped in the write: its record stays, but it is no longer heard.
    peer.update({**record, "beat": 2, "busy": True}, 50.0 + STALL)
    assert peer.moved_at == 50.0 and peer.silent(50.0 + STALL, STALL)
    with progress.busy():
        record = watchdog.Watchdog(0, 2, STALL, Path("r"), print)._record()
        assert record["busy"] and record["place"] == "writing a checkpoint"


def test_a_rank_waiting_for_a_requeue_counts_as_ended() -> None:
    """A Slurm requeue: rank 0 requeues, the others sleep until Slurm ends them; not a stall
    (stall_timeout_s may be below stop.REQUEUE_WAIT_S)."""
    dog = watchdog.Watchdog(1, 2, STALL, Path("r"), print)
    assert not dog._record()["done"]
    try:
        progress.leave()
        assert dog._record()["done"]
    finally:
        progress._left = False


def test_a_wait_for_the_device_counts_as_waiting(monkeypatch) -> None:
    """With NCCL the host waits for a slow rank at the app's own device syncs (the loss
    check's read-back), not inside torch.distributed."""
    from app.training import step

    seen = []

    class Probe:
        def tolist(self) -> list[float]:
            seen.append(waits_for_others(None))
            return [1.0]

    monkeypatch.setattr(step.torch, "stack", lambda tensors: Probe())
    losses = step.FiniteLosses()
    losses.check(None, 1)
    losses.flush()
    assert seen == [True]


def test_each_verdict_writes_a_section_of_its_own(tmp_path, monkeypatch) -> None:
    """A stacks file kept from an earlier stall (or a dump by hand) does not hide the stacks
    of a new verdict."""
    path = tmp_path / "logs" / "rank1.stacks"
    path.parent.mkdir()
    path.write_text("Thread 0x1 (most recent call first):\n  an earlier dump\n")
    monkeypatch.setattr(watchdog.os, "_exit", lambda code: sys.exit(code))
    stalls = []
    dog = watchdog.Watchdog(1, 2, 0.5, tmp_path, stalls.append)
    with stacks.stacks_on_signal(path):
        for message in ("first stall", "second stall"):
            try:
                dog._end({"id": message, "time": "now", "message": message, "wake": []})
            except SystemExit as e:
                assert e.code == watchdog.EXIT_CODE
    progress.stalled.clear()
    text = path.read_text()
    assert text.startswith("Thread 0x1") and stalls == ["first stall", "second stall"]
    header, *sections = text.split("=== ")[1:]
    assert header.split(": ")[1].startswith(f"each `kill -s RTMIN+4 {os.getpid()}` writes")
    assert [s.split("rank 1: ")[1].splitlines()[0].split(" (pid")[0] for s in sections] == \
        ["first stall", "second stall"]
    assert all("most recent call first" in s for s in sections), text


def test_the_verdict_names_rank_host_pid_and_steps() -> None:
    peers = [_peer(0, moved=STALL, heard=0, waiting=True, step=12),
             _peer(1, moved=STALL, heard=STALL, waiting=False, step=11)]
    line = describe(peers, judge(peers, 100.0, STALL), 100.0, STALL, Path("/runs/a"))
    assert line.startswith("rank 1 on host node1 (pid 1001, last seen training after step 11, "
                           "not running")
    assert "while the other ranks waited at step 12" in line
    assert "distributed.stall_timeout_s=10" in line and "/runs/a/logs/rank{N}.stacks" in line


def test_a_culprit_stopped_since_its_last_record_is_woken_for_its_stacks() -> None:
    """A rank that stopped ticking (a validation), then stopped outright, is judged before it is
    silent: it is woken all the same (its stacks file stayed empty)."""
    dog = watchdog.Watchdog(0, 2, STALL, Path("r"), print)
    culprit = _peer(1, moved=STALL, heard=0, waiting=False)
    assert dog._verdict("line", [culprit])["wake"] == [[1, "node1", 1001]]


def test_what_counts_as_waiting_for_the_other_ranks() -> None:
    def frame(name: str, path: str) -> SimpleNamespace:
        return SimpleNamespace(f_code=SimpleNamespace(co_name=name, co_filename=path))

    torch_dir = os.path.join("site-packages", "torch")
    assert waits_for_others(frame("all_reduce", os.path.join(
        torch_dir, "distributed", "distributed_c10d.py")))
    assert waits_for_others(frame("_engine_run_backward", os.path.join(
        torch_dir, "autograd", "graph.py")))  # DDP's gradient all-reduce
    assert not waits_for_others(frame("forward", "/work/models.py"))
    assert not waits_for_others(None)
    with progress.waiting():  # an asynchronous collective's wait()
        assert waits_for_others(frame("should_stop", "/work/stop.py"))


def _start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "app", f"hydra.run.dir={run_dir}", *TINY, "devices=2",
         *overrides], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(HELPERS)})


def _pid_of_rank(run_dir: Path, rank: int) -> int:
    log = (run_dir / "logs" / f"rank{rank}.log").read_text()
    return int(re.search(rf"rank {rank} of \d+: pid (\d+)", log)[1])


def _assert_stacks(run_dir: Path) -> None:
    for rank in (0, 1):
        stacks = (run_dir / "logs" / f"rank{rank}.stacks").read_text()
        assert "most recent call first" in stacks and 'File "' in stacks, stacks
        assert "training/loop.py" in stacks  # the main thread, in the loop


def _stalled_run(run_dir: Path, *overrides: str, stop_rank_1: bool = False) -> str:
    """A run whose workers this process spawns (run_job), which a stall ends: the launcher's
    message. `stop_rank_1`: SIGSTOP rank 1 once training is under way."""
    if stop_rank_1:
        def stop() -> None:
            wait_for_rows(run_dir, 10)
            # Each rank publishes its step every second (stall_timeout_s / 5): after two, the
            # verdict can name the step rank 1 published last.
            time.sleep(2)
            os.kill(_pid_of_rank(run_dir, 1), signal.SIGSTOP)

        threading.Thread(target=stop, daemon=True).start()
    with pytest.raises(WorkerFailed) as failed:  # exit status 1 (tests/test_error_types.py)
        run_job(run_dir, *TINY, "devices=2", *overrides, user_code=HELPERS)
    assert not [p for p in worker_pids(run_dir) if alive(p)]
    return str(failed.value)


def test_a_stopped_rank_ends_the_job_named_with_every_stack(tmp_path) -> None:
    run_dir = tmp_path / "run"
    # (30 minutes, distributed.timeout_s, before the watchdog)
    message = _stalled_run(run_dir, "trainer.max_epochs=400", "distributed.stall_timeout_s=5",
                           stop_rank_1=True)
    # (the stop may land in a validation: 400 epochs of a few steps each)
    line = re.search(r"rank 1 on host (\S+) \(pid \d+, last seen (?:training|validating) after "
                     r"step (\d+), not running.*", message)
    assert line, message
    assert line[1] == socket.gethostname()
    trained = max(int(r["step"]) for r in read_metrics(run_dir))
    assert 0 < int(line[2]) <= trained
    assert "rank 0 on host" not in message  # the rank that waited is not blamed
    _assert_stacks(run_dir)


def test_a_rank_in_a_dead_loop_ends_the_job_named(tmp_path) -> None:
    run_dir = tmp_path / "run"
    message = _stalled_run(run_dir, "model._target_=faults.FaultyCNN", "+model.fault=hang",
                           "distributed.stall_timeout_s=5", "distributed.timeout_s=600")
    assert re.search(r"rank 1 on host \S+ \(pid \d+, last seen training after step \d+\) has made "
                     r"no progress for 5 s while the other ranks waited", message), message
    assert "rank 0 on host" not in message
    stacks = (run_dir / "logs" / "rank1.stacks").read_text()
    assert "faults.py" in stacks  # where it sleeps
    _assert_stacks(run_dir)


def test_a_rank_stopped_before_its_first_step_ends_the_job_named(tmp_path) -> None:
    """Rank 1 stops itself (SIGSTOP) in its first forward pass; rank 0 waits in the first
    gradient all-reduce. Before, nothing was judged until every rank had done a step: the job
    waited for distributed.timeout_s (600 s here)."""
    run_dir = tmp_path / "run"
    message = _stalled_run(run_dir, "model._target_=faults.FaultyCNN", "+model.fault=stop",
                           "+model.fault_call=1", "distributed.stall_timeout_s=5",
                           "distributed.timeout_s=600")
    assert re.search(r"rank 1 on host \S+ \(pid \d+, last seen before its first step, not running: "
                     r"stopped\?\) has made no progress for 5 s", message), message
    assert "rank 0 on host" not in message
    assert "faults.py" in (run_dir / "logs" / "rank1.stacks").read_text()  # woken to write it


@pytest.mark.parametrize(("rank", "place", "step"), [(0, "training", 5), (1, "validating", 22)])
def test_a_stopped_rank_is_named_with_its_host_pid_step_and_place(tmp_path, rank, place,
                                                                   step) -> None:
    """Rank 0 too, whose process serves the store the records go through (the others judge it
    by its silence); and a rank stopped in validation, after the step it validates. Before,
    both were "before its first step", rank 0 even on host ? with pid None."""
    run_dir = tmp_path / "run"
    message = _stalled_run(run_dir, "model._target_=stalls.StopsItself",
                           f"+model.stop_rank={rank}", f"+model.stop_step={step}",
                           f"+model.stop_in={place}", "distributed.stall_timeout_s=5",
                           "distributed.timeout_s=600")
    assert re.search(rf"rank {rank} on host {re.escape(socket.gethostname())} \(pid "
                     rf"{_pid_of_rank(run_dir, rank)}, last seen {place} after step {step}"
                     # (a rank heard from until it stopped may be judged before it is silent)
                     r"(, not running: stopped\?)?\) has made no progress for 5 s", message), \
        message
    assert f"rank {1 - rank} on host" not in message
    assert "stalls.py" in (run_dir / "logs" / f"rank{rank}.stacks").read_text()  # (woken)


def _torchrun_rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of the process of `rank` that torchrun started for `run_dir`."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"hydra.run.dir={run_dir}".encode() in cmdline and b"torch.distributed.run" \
                not in b" ".join(cmdline) and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    return None


def test_a_stopped_rank_under_torchrun_ends_the_job_at_once_in_one_line(tmp_path) -> None:
    """After the verdict no rank trains on (no validation, no checkpoint), and the woken rank's
    failed collective is not reported instead of the stall (no traceback)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "app", f"hydra.run.dir={run_dir}", *TINY, "trainer.max_epochs=400",
         "trainer.val_every_n_steps=1", "trainer.ckpt_every_n_steps=1",
         "distributed.stall_timeout_s=5"], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(HELPERS)})
    wait_for_rows(run_dir, 10)
    os.kill(_torchrun_rank_pid(run_dir, 1), signal.SIGSTOP)
    try:
        output, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()  # (torchrun's agent ends its ranks)
    assert proc.returncode != 0, output[-3000:]
    lines = re.findall(r".*rank 1 on host \S+ \(pid \d+, last seen (?:\D+ after step \d+|before "
                       r"its first step), not running.*waited at step (\d+).*", output)
    assert len(lines) == 1, output[-3000:]
    # (torchrun's own report of the failed rank has a traceback of torchrun's: not the app's)
    assert "Error executing job" not in output, output[-3000:]
    assert f'File "{REPO / "src" / "app"}' not in output, output[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "failed" and result["error"].startswith("Stalled: rank 1"), result
    # Rank 0 waited at step N; the woken rank may finish that step, no more.
    stopped_at = int(lines[0])
    steps = [int(r["step"]) for r in read_metrics(run_dir) if r.get("split") == "val"]
    assert max(steps) <= stopped_at + 1, (stopped_at, steps)
    saved = [int(p.stem.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*.pt")]
    assert max(saved) <= stopped_at + 1, (stopped_at, saved)


def test_every_process_of_a_run_writes_its_stacks_on_the_dump_signal(tmp_path) -> None:
    """`kill -s RTMIN+4 PID` writes stacks (and ends nothing) in the launcher and in a rank
    that no watchdog watches (stall_timeout_s=null)."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "trainer.max_epochs=400", "distributed.stall_timeout_s=null")
    try:
        wait_for_rows(run_dir, 10)
        rank1 = _pid_of_rank(run_dir, 1)
        for pid in (proc.pid, rank1):
            os.kill(pid, DUMP_SIGNAL)
        rows = len(read_metrics(run_dir))
        wait_for_rows(run_dir, rows + 5)  # still training, every process alive
        assert proc.poll() is None and alive(rank1)
    finally:
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, output[-3000:]
    for name, where in (("launcher", "spawn.py"), ("rank1", "training/loop.py")):
        stacks = (run_dir / "logs" / f"{name}.stacks").read_text()
        assert "most recent call first" in stacks and where in stacks, stacks
        # (which process: a requeued job or a resumed run appends to the same file)
        assert re.match(r"=== \S+ \S+ pid \d+ on \S+: each `kill -s RTMIN\+4 \d+` writes its "
                        r"stacks below\n", stacks), stacks
    assert not (run_dir / "logs" / "rank0.stacks").exists()  # (no dump: no file)


def _catches(pid: int, sig: int) -> bool:
    """Whether the process has a handler for `sig` (Linux's /proc/PID/status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return bool(int(re.search(r"SigCgt:\s*([0-9a-f]+)", status)[1], 16) >> (sig - 1) & 1)


@pytest.mark.skipif(DUMP_SIGNAL is None or not sys.platform.startswith("linux"),
                    reason="real-time signals and /proc: Linux")
def test_a_dump_asked_for_while_the_run_starts_goes_to_stderr(tmp_path) -> None:
    """Before, the signal's default action ended the run as it imported torch (status 166)."""
    proc = _start(tmp_path / "run", "devices=1", "trainer.max_epochs=1")
    deadline = time.monotonic() + 60
    while not _catches(proc.pid, DUMP_SIGNAL) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, DUMP_SIGNAL)  # (its first lines: Hydra and torch still to import)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    assert "most recent call first" in output and "__main__.py" in output, output[-3000:]
