"""`distributed.max_restarts`: local workers restarted from the last checkpoint after one
dies by a signal (the OOM killer, a crash), resuming exactly; an exception is not retried."""

from __future__ import annotations

import pytest

from app.errors import UserError, WorkerFailed
from conftest import HELPERS, TINY, assert_same_weights, read_metrics, run_job

# 6 epochs of 11 steps, a checkpoint after each; rank 1 fails at its 30th step (epoch 3).
TRAINING = [*TINY, "devices=2", "trainer.max_epochs=6", "trainer.ckpt_every_n_epochs=1"]
FAULT = ["model._target_=faults.FaultyCNN", "+model.fault_call=30", "distributed.timeout_s=5"]


def test_a_killed_worker_restarts_all_from_the_checkpoint_bit_identical(tmp_path) -> None:
    once = tmp_path / "fired"  # the fault fires once: the restarted workers run through
    job = run_job(tmp_path / "run", *TRAINING, *FAULT, "+model.fault=kill",
                  f"+model.fault_once={once}", "distributed.max_restarts=2", user_code=HELPERS)
    assert once.is_file()
    said = job.output  # the launcher's lines
    assert "rank 1 (pid" in said and "killed by SIGKILL" in said, said[-3000:]
    assert "restarting the 2 workers from the last checkpoint (1 of " \
           "distributed.max_restarts=2)" in said, said[-3000:]
    rank0 = (job.run_dir / "logs" / "rank0.log").read_text()
    assert "last.pt at step 22 (epoch 2)" in rank0, rank0[-3000:]  # epoch 2's checkpoint
    reference = run_job(tmp_path / "reference", *TRAINING).run_dir  # (uninterrupted)
    assert_same_weights(reference / "checkpoints" / "last.pt",
                        job.run_dir / "checkpoints" / "last.pt")
    assert read_metrics(job.run_dir) == read_metrics(reference)


def test_restarts_run_out(tmp_path) -> None:
    # The fault fires in every run: one restart, then the failure, saying so.
    with pytest.raises(WorkerFailed) as failed:
        run_job(tmp_path / "run", *TRAINING, *FAULT, "+model.fault=kill",
                "distributed.max_restarts=1", user_code=HELPERS)
    message = str(failed.value)
    assert "killed by SIGKILL" in message and "restarted 1 time(s)" in message, message
    assert "distributed.max_restarts=1" in message


def test_an_exception_is_not_retried(tmp_path) -> None:
    with pytest.raises(WorkerFailed) as failed:
        run_job(tmp_path / "run", *TRAINING, *FAULT, "+model.fault=raise",
                "distributed.max_restarts=3", user_code=HELPERS)
    assert "RuntimeError: injected fault" in str(failed.value)
    assert "restart" not in str(failed.value)


@pytest.mark.parametrize("override, words", [
    ("distributed.max_restarts=-1", "distributed.max_restarts=-1"),
    ("nodes=2", "distributed.max_restarts needs nodes=1"),
])
def test_restarts_that_cannot_be_done_are_refused(tmp_path, override, words) -> None:
    with pytest.raises(UserError, match=words.replace(".", r"\.")):
        run_job(tmp_path / "run", *TRAINING, "distributed.max_restarts=1", override)
