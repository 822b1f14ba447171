"""The progress watchdog: a rank that stops making progress ends the job, named, with every
rank's Python stack on disk (app.watchdog)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from app import watchdog
from app.watchdog import Peer, describe, judge
from conftest import HELPERS, REPO, TINY, alive, read_metrics, wait_for_rows, worker_pids

STALL = 10.0


def _peer(rank: int, moved: float, heard: float, waiting: bool, step: int | None = 7,
          done: bool = False) -> Peer:
    """A rank whose counter last moved `moved` s ago and whose record came `heard` s ago."""
    return Peer(rank, moved_at=100.0 - moved, heard_at=100.0 - heard, ticks=3, beat=3,
                step=step, host=f"node{rank}", pid=1000 + rank, waiting=waiting, done=done)


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


def test_the_verdict_names_rank_host_pid_and_steps() -> None:
    peers = [_peer(0, moved=STALL, heard=0, waiting=True, step=12),
             _peer(1, moved=STALL, heard=STALL, waiting=False, step=11)]
    line = describe(peers, judge(peers, 100.0, STALL), 100.0, STALL, Path("/runs/a"))
    assert line.startswith("rank 1 on host node1 (pid 1001, last step 11, not running")
    assert "while the other ranks waited at step 12" in line
    assert "distributed.stall_timeout_s=10" in line and "/runs/a/logs/rank{N}.stacks" in line


def test_what_counts_as_waiting_for_the_other_ranks() -> None:
    def frame(name: str, path: str) -> SimpleNamespace:
        return SimpleNamespace(f_code=SimpleNamespace(co_name=name, co_filename=path))

    torch_dir = os.path.join("site-packages", "torch")
    assert watchdog._waits_for_others(frame("all_reduce", os.path.join(
        torch_dir, "distributed", "distributed_c10d.py")))
    assert watchdog._waits_for_others(frame("_engine_run_backward", os.path.join(
        torch_dir, "autograd", "graph.py")))  # DDP's gradient all-reduce
    assert not watchdog._waits_for_others(frame("forward", "/work/models.py"))
    assert not watchdog._waits_for_others(None)
    with watchdog.waiting():  # an asynchronous collective's wait()
        assert watchdog._waits_for_others(frame("should_stop", "/work/stop.py"))


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
        assert "train.py" in stacks  # the main thread, in the loop


def test_a_stopped_rank_ends_the_job_named_with_every_stack(tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "trainer.max_epochs=400", "distributed.stall_timeout_s=5")
    wait_for_rows(run_dir, 10)
    time.sleep(2)  # (a record or two after the start; not needed for the verdict)
    os.kill(_pid_of_rank(run_dir, 1), signal.SIGSTOP)
    output, _ = proc.communicate(timeout=240)  # 30 minutes (distributed.timeout_s) before
    assert proc.returncode == 1, output[-3000:]
    line = re.search(r"rank 1 on host (\S+) \(pid \d+, last step (\d+), not running.*", output)
    assert line, output[-3000:]
    assert line[1] == socket.gethostname()
    trained = max(int(r["step"]) for r in read_metrics(run_dir))
    assert 0 < int(line[2]) <= trained
    assert "rank 0 on host" not in output  # the rank that waited is not blamed
    assert "Traceback" not in output
    _assert_stacks(run_dir)
    assert not [p for p in worker_pids(run_dir) if alive(p)]


def test_a_rank_in_a_dead_loop_ends_the_job_named(tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "model._target_=faults.FaultyCNN", "+model.fault=hang",
                  "distributed.stall_timeout_s=5", "distributed.timeout_s=600")
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 1, output[-3000:]
    assert re.search(r"rank 1 on host \S+ \(pid \d+, last step \d+\) has made no progress "
                     r"for 5 s while the other ranks waited", output), output[-3000:]
    assert "rank 0 on host" not in output and "Traceback" not in output
    stacks = (run_dir / "logs" / "rank1.stacks").read_text()
    assert "faults.py" in stacks  # where it sleeps
    _assert_stacks(run_dir)
    assert not [p for p in worker_pids(run_dir) if alive(p)]
