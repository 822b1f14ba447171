"""`distributed.strategy=fsdp` on the CPU (gloo, 2 ranks): FSDP2 trains as DDP does, its
sharded checkpoints resume exactly, reshard to another number of ranks, convert to and from
single files, and serve every single-process reader (eval, export, run=).

"Equal up to summation order": FSDP reduce-scatters the gradients where DDP all-reduces them,
and a rank count changes how the loss and gradients are summed, so those comparisons allow
float32 rounding (1e-5 on weights after 15 steps); the same run resumed on the same ranks
must be bit-identical."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from app.checkpoint import sharded
from app.ckpt import convert
from app.ckpt import main as ckpt_main
from app.errors import UserError, WorkerFailed
from conftest import TINY, Job, read_metrics, run_job

FSDP = ["distributed.strategy=fsdp"]
# 15 steps of 2 ranks x 32 samples, a checkpoint every 5; no dropout, so that a run on one
# rank of 64 samples a step sees the same batches as two of 32 (DistributedSampler's split).
STEPS = [*TINY, "model.dropout=0", "trainer.max_epochs=null", "trainer.max_steps=15",
         "trainer.ckpt_every_n_steps=5", "trainer.ckpt_every_n_epochs=null",
         "trainer.val_every_n_epochs=null", "trainer.val_every_n_steps=5",
         "trainer.keep_last=100"]


def _log(job: Job) -> str:
    """What rank 0 logged (a job of several ranks logs to logs/rank*.log)."""
    rank0 = job.run_dir / "logs" / "rank0.log"
    return rank0.read_text() if rank0.is_file() else job.output


def _full(path: Path) -> dict:
    return sharded.read_full(path) if sharded.is_sharded(path) else \
        torch.load(path, map_location="cpu", weights_only=True)


def _gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _copy_checkpoint(source: Path, run_dir: Path) -> Path:
    """One checkpoint of a run as the only one of a new run directory (resume=auto takes it)."""
    target = run_dir / "checkpoints" / source.name
    target.parent.mkdir(parents=True)
    shutil.copytree(source, target)
    return target


@pytest.mark.parametrize("model", ["cnn", "mlp"])
def test_fsdp_trains_as_ddp_does(model, tmp_path) -> None:
    """The digits CNN and the MLP, 4 epochs on 2 ranks: the same accuracy each epoch. The CNN
    with a validation batch that gives the ranks unequal numbers of batches; the MLP with
    what acts on the sharded state: clipping (a norm over both ranks' shards), accumulation,
    the EMA (which then validates)."""
    overrides = [*TINY, f"model={model}", "model.dropout=0", "devices=2", "optimizer.lr=0.01"]
    if model == "cnn":  # rank 0 validates 180 samples in 2 batches, rank 1 179 in 1 (lockstep)
        overrides.append("data.val_batch_size=179")
    if model == "mlp":
        overrides = [o for o in overrides if not o.startswith("model.channels")] + [
            "trainer.grad_clip_norm=0.5", "trainer.accumulate_grad_batches=2",
            "trainer.ema=true", "trainer.ema_warmup_steps=5", "trainer.ema_decay=0.9"]
    ddp = run_job(tmp_path / "ddp", *overrides)
    fsdp = run_job(tmp_path / "fsdp", *overrides, *FSDP)
    assert "sharded over 2 ranks" in _log(fsdp)
    checkpoint = fsdp.run_dir / "checkpoints" / "last.pt"
    assert sharded.is_sharded(checkpoint) and (checkpoint / "__1_0.distcp").is_file()
    gap = _gap(_full(ddp.run_dir / "checkpoints" / "last.pt")["model"],
               _full(checkpoint)["model"])
    assert gap < 1e-4, gap
    accuracies = [[float(r["acc"]) for r in read_metrics(job.run_dir) if r["split"] == "val"]
                  for job in (ddp, fsdp)]
    assert len(accuracies[0]) == 4 and ddp.value > 0.5
    assert accuracies[0] == pytest.approx(accuracies[1], abs=0.006)  # (2 of 359 samples)


def test_fsdp_resumes_bit_identically(tmp_path) -> None:
    """With everything a step has: EMA, accumulation, clipping, bf16 mixed precision (FSDP's
    policy), dropout (each rank its own), activation checkpointing."""
    overrides = [*STEPS, "model.dropout=0.1", "devices=2", *FSDP, "trainer.ema=true",
                 "trainer.accumulate_grad_batches=2", "trainer.grad_clip_norm=0.5",
                 "precision=bf16-mixed", "data.batch_size=16",
                 "trainer.activation_checkpointing=[Sequential]"]
    reference = run_job(tmp_path / "reference", *overrides).run_dir
    source = reference / "checkpoints" / "step-00000005.pt"
    _copy_checkpoint(source, tmp_path / "resumed")
    resumed = run_job(tmp_path / "resumed", *overrides)
    assert "resumed from" in _log(resumed) and "at step 5" in _log(resumed)
    a = _full(reference / "checkpoints" / "last.pt")
    b = _full(resumed.run_dir / "checkpoints" / "last.pt")
    for key in ("model", "optimizer", "train_step", "loop", "rng"):
        assert _equal(a[key], b[key]), key
    after = [r for r in read_metrics(reference) if int(r["step"]) > 5]
    assert [r for r in read_metrics(resumed.run_dir) if int(r["step"]) > 5] == after


def test_a_model_sharded_as_one_unit_validates_then_checkpoints(tmp_path) -> None:
    # wrap=[MLP], the model itself: the root holds every parameter. After a validation (a
    # forward without backward) they stayed gathered, and the checkpoint's optimizer state
    # failed (KeyError in torch's get_optimizer_state_dict).
    steps = [o for o in STEPS if not o.startswith("model.")]  # (TINY's are the CNN's)
    job = run_job(tmp_path / "run", *steps, "model=mlp", "model.hidden=[32]", "devices=2",
                  *FSDP, "distributed.fsdp.wrap=[MLP]")
    assert "fsdp: 0 unit(s) and the model sharded over 2 ranks" in _log(job)
    assert (job.run_dir / "checkpoints" / "step-00000015.pt" / ".metadata").is_file()


def test_a_checkpoint_of_two_ranks_resumes_on_one_on_two_and_on_four(tmp_path) -> None:
    """2 -> 1 -> 2 ranks and 2 -> 4, the global batch kept (one rank takes 64 samples a step,
    four 16): the weights and the model's outputs end as the unsharded DDP run's, up to
    summation order."""
    two = [*STEPS, "devices=2", "data.batch_size=32"]
    one = [*STEPS, "devices=1", "data.batch_size=64"]
    ddp = run_job(tmp_path / "ddp", *two).run_dir
    first = run_job(tmp_path / "first", *two, *FSDP).run_dir
    _copy_checkpoint(first / "checkpoints" / "step-00000005.pt", tmp_path / "on_one")
    on_one = run_job(tmp_path / "on_one", *one, *FSDP)
    assert "at step 5" in _log(on_one)
    written_by_one = on_one.run_dir / "checkpoints" / "step-00000010.pt"
    assert sorted(p.name for p in written_by_one.glob("*.distcp")) == ["__0_0.distcp"]
    _copy_checkpoint(written_by_one, tmp_path / "on_two")
    on_two = run_job(tmp_path / "on_two", *two, *FSDP)
    assert "at step 10" in _log(on_two)
    final = _full(on_two.run_dir / "checkpoints" / "last.pt")
    reference = _full(ddp / "checkpoints" / "last.pt")
    assert final["loop"]["step"] == reference["loop"]["step"] == 15
    assert _gap(final["model"], reference["model"]) < 1e-5

    from app.models import CNN

    def outputs(weights: dict) -> torch.Tensor:
        model = CNN(input_shape=(1, 8, 8), num_classes=10, channels=[8, 16], dropout=0.0)
        model.load_state_dict(weights)
        torch.manual_seed(0)
        return model.eval()(torch.randn(256, 1, 8, 8))

    assert (outputs(final["model"]) - outputs(reference["model"])).abs().max() < 1e-4
    # 2 -> 4: the first run's checkpoint of 2 ranks on 4 (16 samples each), to the end.
    _copy_checkpoint(first / "checkpoints" / "step-00000005.pt", tmp_path / "on_four")
    on_four = run_job(tmp_path / "on_four", *STEPS, "devices=4", "data.batch_size=16", *FSDP)
    assert "at step 5" in _log(on_four)
    four = _full(on_four.run_dir / "checkpoints" / "last.pt")
    assert len(list((on_four.run_dir / "checkpoints" / "last.pt").glob("*.distcp"))) == 4
    assert _gap(four["model"], reference["model"]) < 1e-5


def test_single_process_readers_take_a_sharded_checkpoint(tmp_path) -> None:
    run = run_job(tmp_path / "run", *STEPS, "devices=2", *FSDP).run_dir
    best = run / "checkpoints" / "best.pt"
    assert best.is_symlink() and sharded.is_sharded(best)
    step = _full(best)["loop"]["step"]
    (row,) = [r for r in read_metrics(run) if r["split"] == "val" and int(r["step"]) == step]
    evaluated = run_job(tmp_path / "eval", *TINY, "trainer=eval", f"ckpt={best}")
    assert f"(step {step}) on 359 validation samples" in _log(evaluated)
    assert f"acc {float(row['acc']):.4f}" in _log(evaluated)
    exported = run_job(tmp_path / "export", *TINY, "trainer=export", f"ckpt={best}")
    assert "max abs diff vs eager" in _log(exported)
    assert (tmp_path / "export" / "export" / "model.pt2").is_file()
    predicted = run_job(tmp_path / "predict", *TINY, "trainer=predict", f"ckpt={best}")
    assert "predicted 359 inputs" in _log(predicted)


def test_convert_round_trip_keeps_everything(tmp_path) -> None:
    run = run_job(tmp_path / "run", *STEPS, "trainer.max_steps=5", "devices=2", *FSDP,
                  "trainer.ema=true").run_dir
    source = run / "checkpoints" / "last.pt"
    one_file, back = tmp_path / "one.pt", tmp_path / "back.pt"
    assert "(one file)" in convert(source, one_file)
    assert one_file.is_file()
    assert "(sharded)" in convert(one_file, back)
    original, converted = _full(source), _full(back)
    assert _equal(original, converted)
    assert _equal(original, torch.load(one_file, weights_only=True))
    # The single file resumes under ddp, exactly where the sharded one stopped.
    resumed = run_job(tmp_path / "resumed", *STEPS, "trainer.max_steps=6", "devices=2",
                      "trainer.ema=true", f"resume={one_file}")
    assert "at step 5" in _log(resumed)
    with pytest.raises(UserError, match="exists"):
        convert(one_file, back)
    assert ckpt_main(["convert", str(tmp_path / "missing.pt"), str(tmp_path / "x")]) == 2


def test_a_ddp_run_continues_under_fsdp_and_back(tmp_path) -> None:
    """resume=auto across strategies in one run directory: a file resumed by a sharded model,
    a sharded checkpoint by DDP."""
    base = [*STEPS, "devices=2", "trainer.ema=true"]
    run = tmp_path / "run"
    run_job(run, *base, "trainer.max_steps=5")
    assert (run / "checkpoints" / "last.pt").is_file()
    assert "at step 5" in _log(run_job(run, *base, "trainer.max_steps=10", *FSDP))
    assert sharded.is_sharded(run / "checkpoints" / "last.pt")
    assert "at step 10" in _log(run_job(run, *base, "trainer.max_steps=15"))
    assert (run / "checkpoints" / "last.pt").is_file()
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["best.pt", "last.pt", "step-00000005.pt", "step-00000010.pt",
                     "step-00000015.pt"]


def test_resume_skips_a_sharded_checkpoint_whose_shards_are_lost(tmp_path) -> None:
    run = tmp_path / "run"
    overrides = [*STEPS, "devices=2", *FSDP, "trainer.keep_last=1"]
    run_job(run, *overrides, "trainer.max_steps=10")
    checkpoints = run / "checkpoints"
    # keep_last=1: step 5 pruned, step 10 is last; best.pt keeps its directory.
    kept = {p.name for p in checkpoints.iterdir()}
    assert "step-00000010.pt" in kept and "step-00000005.pt" not in kept or \
        os.readlink(checkpoints / "best.pt") == "step-00000005.pt"
    (checkpoints / "step-00000010.pt" / "__1_0.distcp").unlink()
    best = os.readlink(checkpoints / "best.pt")
    if best == "step-00000010.pt":  # (then nothing older is left: the error names the loss)
        with pytest.raises(UserError, match="shard files missing: __1_0.distcp"):
            run_job(run, *overrides)
        return
    resumed = run_job(run, *overrides)
    assert "skipping" in _log(resumed) and "shard files missing" in _log(resumed)


def test_a_kill_during_sharded_writes_leaves_only_whole_checkpoints(tmp_path) -> None:
    """SIGKILL to the whole job while its ranks write (a ~16 MB model saved every step, in
    the background): every checkpoint under a step name reads whole, and the same command
    again (here `run_job`: what it reads is the subject, not the process) runs to its end."""
    big = ["model=mlp", "model.hidden=[2048]", "data=synthetic", "data.input_shape=[2048]",
           "data.num_samples=400", "data.batch_size=16", "trainer.max_epochs=null",
           "trainer.max_steps=40", "trainer.val_every_n_epochs=null",
           "trainer.ckpt_every_n_steps=1", "trainer.ckpt_every_n_epochs=null",
           "trainer.keep_last=3", "trainer.progress_bar=false", "devices=2", *FSDP]
    run = tmp_path / "run"
    command = [sys.executable, "-m", "app", *big, f"hydra.run.dir={run}"]
    for delay in (4.0, 5.5):
        proc = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not list((run / "checkpoints").glob(".step-*.tmp")) and \
                time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        time.sleep(delay / 100)  # inside a write, most times
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for path in (run / "checkpoints").glob("step-*.pt"):
            sharded.read_full(path)  # every name a resume reads is a whole checkpoint
    again = _log(run_job(run, *big)).split("rank 0 of 2: pid")[-1]  # (this launch's lines)
    assert "done: step 40" in again
    assert not list((run / "checkpoints").glob(".*.tmp"))


def test_fsdp_settings_that_name_no_module_are_refused(tmp_path) -> None:
    with pytest.raises(WorkerFailed, match=r"distributed.fsdp.wrap: the model has no module of "
                                        r"class Block \(its classes: .*Linear"):
        run_job(tmp_path / "run", *STEPS, "devices=2", *FSDP, "distributed.fsdp.wrap=[Block]")
    with pytest.raises(UserError, match="trainer.activation_checkpointing: the model has no "
                                        "module of class Nope"):
        run_job(tmp_path / "run2", *STEPS, "trainer.activation_checkpointing=[Nope]")


def test_activation_checkpointing_changes_no_number(tmp_path) -> None:
    """The recompute draws the same dropout masks (the forward's random state is restored),
    so the weights are bit-identical with and without it, and under fsdp with a unit per
    Linear too."""
    mlp = ["model=mlp", "model.dropout=0.3", *[s for s in STEPS if not s.startswith("model.")
                                               ], "trainer.max_steps=6"]
    plain = run_job(tmp_path / "plain", *mlp).run_dir
    checkpointed = run_job(tmp_path / "ac", *mlp,
                           "trainer.activation_checkpointing=[Sequential]")
    assert "activation checkpointing: 1 module(s)" in _log(checkpointed)
    assert _equal(_full(plain / "checkpoints" / "last.pt")["model"],
                  _full(checkpointed.run_dir / "checkpoints" / "last.pt")["model"])
    two = ["devices=2", *FSDP, "distributed.fsdp.wrap=[Linear]"]
    a = run_job(tmp_path / "fsdp", *mlp, *two).run_dir
    b = run_job(tmp_path / "fsdp_ac", *mlp, *two,
                "trainer.activation_checkpointing=[Linear]").run_dir
    assert _equal(_full(a / "checkpoints" / "last.pt")["model"],
                  _full(b / "checkpoints" / "last.pt")["model"])


def test_damaged_sharded_checkpoints_are_skipped_or_named(tmp_path) -> None:
    """A shard cut short, a step directory that lost its index: a resume falls back to the
    checkpoint before, naming why; a checkpoint of another model is one line."""
    run = tmp_path / "run"
    overrides = [*STEPS, "devices=2", *FSDP]
    run_job(run, *overrides, "trainer.max_steps=10")
    checkpoints = run / "checkpoints"
    shard = checkpoints / "step-00000010.pt" / "__1_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(1000)
    text = _log(run_job(run, *overrides, "trainer.max_steps=10"))
    assert "at step 5" in text
    assert "skipping" in text and "shorter than the index says (cut short): __1_0.distcp" in text
    # The resumed run wrote step 10 again, over the damaged one: whole now.
    sharded.read_full(checkpoints / "step-00000010.pt")
    (checkpoints / "step-00000010.pt" / ".metadata").unlink()
    resumed = run_job(run, *overrides, "trainer.max_steps=12")
    assert "at step 5" in _log(resumed) and "without DCP's index" in _log(resumed)
    with pytest.raises(WorkerFailed, match="does not fit this run's model and optimizer"):
        run_job(run, *[o for o in overrides if not o.startswith("model.channels")],
                "model.channels=[8,32]", "trainer.max_steps=14")


def test_fsdp_then_ddp_writes_a_step_over_its_sharded_directory(tmp_path) -> None:
    """A ddp run resumed from an earlier step of an fsdp run in the same directory writes its
    step file where a sharded directory of that step is."""
    run = tmp_path / "run"
    run_job(run, *STEPS, "devices=2", *FSDP, "trainer.max_steps=10")
    checkpoints = run / "checkpoints"
    assert (checkpoints / "step-00000010.pt").is_dir()
    run_job(run, *STEPS, "devices=2", "trainer.max_steps=10",
            f"resume={checkpoints / 'step-00000005.pt'}")
    assert (checkpoints / "step-00000010.pt").is_file()
    assert (checkpoints / "last.pt").is_file() and not (checkpoints / "last.pt").is_symlink()
    assert not list(checkpoints.glob(".*"))


def test_batch_norm_statistics_resume_exactly_under_fsdp(tmp_path) -> None:
    """Each rank updates its buffers with its own batches: rank 0's are copied to all after
    each step (distributed.broadcast_buffers), so the checkpoint's copy is every rank's."""
    overrides = [*STEPS, "model=resnet", "model.channels=[4,8]", "devices=2", *FSDP,
                 "trainer.max_steps=10", "data.batch_size=16"]
    reference = run_job(tmp_path / "reference", *overrides).run_dir
    _copy_checkpoint(reference / "checkpoints" / "step-00000005.pt", tmp_path / "resumed")
    resumed = run_job(tmp_path / "resumed", *overrides).run_dir
    after = [r for r in read_metrics(reference) if int(r["step"]) > 5]
    assert [r for r in read_metrics(resumed) if int(r["step"]) > 5] == after
    a, b = _full(reference / "checkpoints" / "last.pt"), _full(resumed / "checkpoints" / "last.pt")
    assert _equal(a["model"], b["model"])
