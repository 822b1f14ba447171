"""How a run counts its steps: what an epoch's steps leave out, and a resume in steps of
another size (another number of ranks, the batch per rank kept), under DDP and FSDP alike:
it counts the steps left from where it is, and its learning-rate schedule ends at its end."""

from __future__ import annotations

import pytest

from app.checkpoint import sharded
from conftest import TINY, load_state, read_metrics, run_job

# 2 epochs of the digits' 1438 training samples in batches of 64 a rank; a short warm-up, so
# that the resumes below are in the cosine decay.
RUN = [*TINY, "trainer.max_epochs=2", "scheduler.warmup_steps=2",
       "trainer.ckpt_every_n_steps=5", "trainer.ckpt_every_n_epochs=null",
       "trainer.val_every_n_epochs=null", "trainer.keep_last=100"]


def _trained(run_dir) -> dict[int, float]:
    """The learning rate logged after each step (that of the next step), by step."""
    return {int(r["step"]): float(r["lr"]) for r in read_metrics(run_dir) if r["split"] == "train"}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_resume_on_other_ranks_ends_its_schedule_at_its_end(strategy, tmp_path) -> None:
    on = [*RUN, f"distributed.strategy={strategy}"]
    two = run_job(tmp_path / "two", *on, "devices=2").run_dir  # 11 steps an epoch, 22
    # Step 5 of 11 on two ranks is 640 samples into the epoch: step 10 of 22 on one, which
    # has 12 + 22 to go. (It logged 44 steps, its schedule ended at step 22: lr 0 since.)
    one = run_job(tmp_path / "one", *on, "devices=1",
                  f"resume={two / 'checkpoints' / 'step-00000005.pt'}")
    assert "on cpu x 1: 22 steps/epoch, 39 steps," in one.output
    lrs = _trained(one.run_dir)
    assert list(lrs) == list(range(6, 40))
    assert all(a > b for a, b in zip(lrs.values(), list(lrs.values())[1:], strict=False))
    assert lrs[38] > 0 and lrs[39] == 0
    # Its decay goes on from where it was, at a slower pace: between the 2 ranks' 5th and 6th.
    assert _trained(two)[5] > lrs[6] > _trained(two)[6]
    # And back: step 15 on one rank, 20 of 22, is 10 of 11 on two (kept at 20, the epoch,
    # past its end, never ended).
    checkpoint = one.run_dir / "checkpoints" / "step-00000015.pt"
    back = run_job(tmp_path / "back", *on, "devices=2", f"resume={checkpoint}").run_dir
    rank0 = (back / "logs" / "rank0.log").read_text()
    assert "on cpu x 2: 11 steps/epoch, 27 steps," in rank0
    lrs = _trained(back)
    assert list(lrs) == list(range(16, 28)) and lrs[26] > 0 and lrs[27] == 0
    last = back / "checkpoints" / "last.pt"
    loop = (sharded.read_full(last) if strategy == "fsdp" else load_state(last))["loop"]
    assert (loop["step"], loop["epoch"], loop["batch"]) == (27, 2, 0)


def test_the_samples_an_epochs_steps_leave_out_are_said_once(tmp_path) -> None:
    short = [*TINY, "trainer.max_steps=1"]
    job = run_job(tmp_path / "partial", *short)  # 22 steps of 64: 1408 of 1438
    assert ("22 steps/epoch, 1 steps, 1438 train / 359 val samples, 30 train samples left "
            "out each epoch (a partial batch; drop_last)") in job.output
    assert job.output.count("left out") == 1
    whole = run_job(tmp_path / "whole", *short, "data.batch_size=719")
    assert "2 steps/epoch, 1 steps, 1438 train / 359 val samples\n" in whole.output
    assert "left out" not in whole.output
