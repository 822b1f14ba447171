"""A SIGTERM that reaches a job's task while its run is still being set up (submitit ignores
SIGTERM there) is held, and stops the loop at its first step with a checkpoint: it is not
lost, with the job then training to its end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from app.errors import Interrupted
from app.signals import held, hold_sigterm
from conftest import make_config, run_job


@pytest.fixture
def sigterm_held():
    before = signal.getsignal(signal.SIGTERM)
    hold_sigterm()
    os.kill(os.getpid(), signal.SIGTERM)  # (handled before kill returns: to this thread)
    try:
        yield
    finally:
        held()  # (none left for a later test)
        signal.signal(signal.SIGTERM, before)


def test_a_sigterm_held_before_the_loop_stops_it_at_its_first_step(
        tmp_path, sigterm_held) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(Interrupted) as stopped:
        run_job(run_dir, "trainer.max_epochs=50")
    assert stopped.value.signum == signal.SIGTERM
    assert "at step 1; checkpoint saved" in str(stopped.value), stopped.value
    assert (run_dir / "checkpoints" / "last.pt").is_file()


def test_a_sigterm_held_before_the_workers_start_stops_them(tmp_path, sigterm_held) -> None:
    """The launcher passes it on as they start (a worker stopped before its loop has nothing
    to save, and says so)."""
    with pytest.raises(Interrupted) as stopped:
        run_job(tmp_path / "run", "trainer.max_epochs=50", "devices=2")
    assert stopped.value.signum == signal.SIGTERM
    assert str(stopped.value).startswith("stopped by SIGTERM"), stopped.value


def test_nothing_is_held_without_a_signal() -> None:
    before = signal.getsignal(signal.SIGTERM)
    try:
        hold_sigterm()
        assert held() is None
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("in_a_job", [True, False])
def test_a_rank_that_left_its_loop_ignores_the_stop_its_launcher_passes_on(in_a_job) -> None:
    """Its launcher (ours, torchrun's agent) sends each rank the stop it got, which may arrive
    after the rank left the loop: ignored there, or the rank would die before recording its end
    (a SIGTERM to the process group then ended a run as "no checkpoint was saved at the stop").
    A run in the user's own process gets its handlers back."""
    import torch.distributed as tdist

    from app.training.stop import StopRequest

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    if in_a_job:
        tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        with StopRequest() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            while not stop.should_stop():
                pass
        after = {sig: signal.getsignal(sig) for sig in before}
        assert after == ({sig: signal.SIG_IGN for sig in before} if in_a_job else before)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        if in_a_job:
            tdist.destroy_process_group()


def test_a_signal_that_ends_the_worker_server_as_the_workers_start_is_a_stop(
        tmp_path, monkeypatch) -> None:
    """A SIGTERM to the process group as the workers start ends the worker server too, and the
    start fails on its socket (EOFError): that is the stop, in one line (it was a traceback
    and a run recorded as failed)."""
    import torch.multiprocessing

    from app.launch import spawn
    from app.launch.plan import How, Plan

    def start_processes(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # (handled before kill returns)
        raise EOFError("unexpected EOF")

    monkeypatch.setattr(torch.multiprocessing, "start_processes", start_processes)
    cfg = make_config("devices=2", "distributed.start_method=spawn")  # (no server to start)
    with pytest.raises(Interrupted) as stopped:
        spawn.spawn(cfg, tmp_path, Plan(How.spawn, "cpu", "gloo", devices=2,
                                        url="tcp://127.0.0.1:1"))
    assert stopped.value.signum == signal.SIGTERM
    assert str(stopped.value) == ("stopped by SIGTERM as the workers started: there is no "
                                  "checkpoint yet")


def test_a_stop_signal_in_a_deferred_block_comes_after_it() -> None:
    """A Ctrl-C that cut the launcher's `import torch` short left torch half imported: the
    signal was lost, or the process died of it (-2) after its line. Held for the import, it is
    raised after it."""
    from app.signals import deferred

    went_on = False
    with pytest.raises(KeyboardInterrupt):
        with deferred():
            os.kill(os.getpid(), signal.SIGINT)  # (handled before kill returns)
            went_on = True
    assert went_on


PRESTART = """
import multiprocessing.forkserver, os, signal
from app.launch import spawn
from conftest import make_config
multiprocessing.forkserver.ensure_running = lambda: os.kill(os.getpid(), signal.SIGINT)
try:
    spawn.prestart(make_config("devices=2"))
except KeyboardInterrupt:
    print("answered", signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set()))
"""


def test_ctrl_c_as_the_worker_server_starts_is_answered_after_it() -> None:
    """The server is started with Ctrl-C ignored (it imports torch before it sets handlers of
    its own); the launcher's Ctrl-C in that moment was lost, and the run trained on. (In a
    process of one thread, as the launcher is then: another thread would take the signal.)"""
    proc = subprocess.run([sys.executable, "-c", PRESTART], capture_output=True, text=True,
                          cwd=Path(__file__).parent, timeout=120)
    assert proc.stdout.strip() == "answered False", proc.stdout + proc.stderr
