"""Bad checkpoints and failing disks: nothing lost, every failure explained in one line.

The runs under test raise the app's error classes in this process (`run_job`); the entry's
turning each class into one line and its exit status is tests/test_error_types.py's. The full
disk is a `python -m app` of its own (a file size limit for that process only)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest
import torch

from app.errors import AppError, DataItemError, UserError, WorkerFailed, WriteFailed
from conftest import HELPERS, REPO, TINY, load_state, run_job


def _trained(tmp_path, *extra: str):
    """A finished run with a periodic checkpoint per epoch (22 steps each)."""
    return run_job(tmp_path / "run", *TINY, "trainer.keep_last=10", *extra).run_dir


def _fails(error: type[AppError], run_dir, *overrides: str, words: tuple[str, ...]) -> str:
    """The run raises `error` (its exit status: 2 for a UserError, 1 otherwise), with a
    message whose first line holds every one of `words` (the line the user sees)."""
    with pytest.raises(error) as raised:
        run_job(run_dir, *overrides, user_code=HELPERS)
    line = str(raised.value).splitlines()[0]
    for word in words:
        assert word in line, line
    return line


def test_resume_skips_a_corrupt_last_checkpoint_and_names_it(tmp_path) -> None:
    run_dir = _trained(tmp_path, "trainer.max_epochs=3")
    ckpts = run_dir / "checkpoints"
    # last.pt is a hard link to step-66: corrupting it corrupts both names.
    (ckpts / "last.pt").write_bytes((ckpts / "last.pt").read_bytes()[:1000])  # truncated
    (ckpts / "step-00000044.pt").write_bytes(b"\0" * 4096)  # zero-filled
    resumed = run_job(run_dir, *TINY, "trainer.keep_last=10", "trainer.max_epochs=4")
    assert f"skipping {ckpts / 'last.pt'}" in resumed.output
    assert f"skipping {ckpts / 'step-00000044.pt'}" in resumed.output
    assert f"resumed from {ckpts / 'step-00000022.pt'} at step 22" in resumed.output
    assert load_state(ckpts / "last.pt")["loop"]["step"] == 88


def test_resume_with_no_loadable_checkpoint_stops_instead_of_starting_afresh(tmp_path) -> None:
    run_dir = _trained(tmp_path, "trainer.max_epochs=1")
    for path in (run_dir / "checkpoints").glob("*.pt"):
        path.unlink()
        path.write_bytes(os.urandom(2048))  # garbage
    before = (run_dir / "metrics.csv").read_text()
    _fails(UserError, run_dir, *TINY, "trainer.max_epochs=2",
           words=("resume=auto: no checkpoint in", "last.pt", "step-00000022.pt"))
    assert (run_dir / "metrics.csv").read_text() == before  # the run's records are untouched


def test_a_checkpoint_of_another_model_or_optimizer_is_a_clear_error(tmp_path) -> None:
    run_dir = _trained(tmp_path, "trainer.max_epochs=1")
    last = run_dir / "checkpoints" / "last.pt"
    _fails(UserError, tmp_path / "m", *TINY, "model.channels=[8,32]", f"resume={last}",
           words=("does not match the model", "shape", "channels"))
    _fails(UserError, tmp_path / "o", *TINY, "optimizer=sgd", f"resume={last}",
           words=("torch.optim.AdamW", "torch.optim.SGD", "ckpt="))


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path) -> None:
    marker = tmp_path / "code-ran"
    payload = _RunsCode()
    payload.marker = marker
    bad = tmp_path / "evil.pt"
    torch.save({"model": {}, "extra": payload}, bad)
    for mode in ("trainer=eval", "trainer=trainval"):
        overrides = [f"ckpt={bad}"] if mode == "trainer=eval" else [f"resume={bad}"]
        _fails(UserError, tmp_path / mode.split("=")[1], *TINY, mode, *overrides,
               words=("refused", "could run code"))
    assert not marker.exists()


def test_a_full_disk_is_a_clear_error_and_keeps_the_last_checkpoint(tmp_path) -> None:
    run_dir = _trained(tmp_path, "model.channels=[32,64]", "trainer.max_epochs=1")
    last = run_dir / "checkpoints" / "last.pt"
    before = last.read_bytes()
    limit = len(before) // 2  # every new checkpoint is bigger than this; logs stay smaller

    def full_disk() -> None:  # writing past `limit` bytes fails with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run(
        [sys.executable, "-m", "app", f"hydra.run.dir={run_dir}", *TINY,
         "model.channels=[32,64]", "trainer.max_epochs=2"],
        cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=full_disk)
    output = proc.stdout + proc.stderr
    assert proc.returncode == WriteFailed.exit_code == 1, output[-3000:]
    assert "could not be written" in output and "Traceback" not in output
    assert last.read_bytes() == before  # the previous checkpoint, intact
    assert not list(run_dir.glob("checkpoints/.*.tmp"))  # no half-written file left
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*.pt")) == [
        "step-00000022.pt"]


NAN_AT_CALL_5 = ["model._target_=faults.FaultyCNN", "+model.fault=nan_loss",
                 "+model.fault_rank=0"]


def test_a_nonfinite_loss_stops_the_run_and_is_never_checkpointed(tmp_path) -> None:
    run_dir = _trained(tmp_path, "trainer.max_epochs=1")  # a good checkpoint at step 22
    good = load_state(run_dir / "checkpoints" / "last.pt")
    _fails(AppError, run_dir, *TINY, "trainer.keep_last=10", "trainer.max_epochs=2",
           *NAN_AT_CALL_5, words=("the training loss was nan at step 27", "skip_nonfinite"))
    last = load_state(run_dir / "checkpoints" / "last.pt")
    assert last["loop"]["step"] == 22
    assert all(torch.equal(last["model"][k], good["model"][k]) for k in good["model"])


def test_the_loss_check_reads_the_device_once_per_ten_steps_one_step_late(monkeypatch) -> None:
    """The losses are read back together (one stack, one copy), never the step just queued,
    and the first non-finite one is named; `flush` reads them all."""
    from app.training import step

    reads: list[int] = []
    stack = torch.stack
    monkeypatch.setattr(step.torch, "stack",
                        lambda tensors: reads.append(len(tensors)) or stack(tensors))
    losses = step.FiniteLosses()
    for i in range(1, 22):
        losses.check(torch.tensor(1.0), i)
    assert reads == [10, 10]  # at steps 11 and 21: steps 1-10, 11-20; step 21 not yet read
    losses.flush()
    assert reads == [10, 10, 1]
    for i in range(22, 30):
        losses.check(torch.tensor(float("inf") if i in (25, 27) else 1.0), i)
    with pytest.raises(AppError, match="the training loss was inf at step 25"):
        losses.flush()


def test_a_nonfinite_loss_is_never_validated_or_logged(tmp_path) -> None:
    """Between two reads of the losses, a validation reads them first: its metrics never come
    from weights a non-finite loss made (nor does a logged loss)."""
    run_dir = tmp_path / "run"
    _fails(AppError, run_dir, *TINY, "trainer.log_every_n_steps=1000",
           "trainer.val_every_n_steps=6", *NAN_AT_CALL_5,
           words=("the training loss was nan at step 5",))
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert rows[1:] == [], rows  # no validation (step 6) and no training row was logged


@pytest.mark.parametrize("rank", [0, 1])
def test_with_two_ranks_the_first_nonfinite_step_is_named_whichever_rank_had_it(
        tmp_path, rank) -> None:
    """The other rank's loss turns NaN a step later (the averaged gradients carry it there):
    every rank reads the same losses, so the error names step 5 whichever rank fails first."""
    _fails(WorkerFailed, tmp_path / "run", *TINY, "devices=2", "trainer.max_steps=30",
           "model._target_=faults.FaultyCNN", "+model.fault=nan_loss",
           f"+model.fault_rank={rank}",
           words=("the training loss was nan at step 5 on one rank at least",))


def test_skip_nonfinite_skips_and_counts_the_step(tmp_path) -> None:
    result = run_job(tmp_path / "run", *TINY, "trainer.max_epochs=1",
                     "trainer.skip_nonfinite=true", *NAN_AT_CALL_5, user_code=HELPERS)
    assert "1 step(s) skipped for a non-finite loss" in result.output
    state = load_state(result.run_dir / "checkpoints" / "last.pt")
    assert state["train_step"]["skipped"] == 1 and state["loop"]["step"] == 22
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def _faulty_data(fault: str, workers: int) -> list[str]:
    return ["data._target_=faults.FaultyDigits", f"+data.fault={fault}",
            f"data.num_workers={workers}", "trainer.max_epochs=1"]


def test_a_data_item_that_fails_is_named_with_its_index(tmp_path) -> None:
    for workers in (0, 2):
        _fails(DataItemError, tmp_path / f"w{workers}", *TINY, *_faulty_data("raise", workers),
               words=("training item 7 failed to load: ValueError: corrupt sample",))


def test_a_data_item_that_fails_under_ddp_ends_every_rank(tmp_path) -> None:
    _fails(WorkerFailed, tmp_path / "run", *TINY, *_faulty_data("raise", 0), "devices=2",
           words=("failed: DataItemError: training item 7 failed to load",))


def test_a_loader_worker_that_dies_is_a_clear_error(tmp_path) -> None:
    _fails(AppError, tmp_path / "run", *TINY, *_faulty_data("kill", 2),
           words=("data loading failed: DataLoader worker (pid", "was killed by SIGKILL"))
