"""A SIGTERM that reaches a job's task while its run is still being set up (submitit ignores
SIGTERM there) is held, and stops the loop at its first step with a checkpoint: it is not
lost, with the job then training to its end."""

from __future__ import annotations

import os
import signal

import pytest

from app.errors import Interrupted
from app.signals import held, hold_sigterm
from conftest import run_job


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
