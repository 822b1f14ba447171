"""The GPU lane (`make test-gpu`, marker `gpu`): what only a CUDA machine can check. Skipped
with the reason on machines without CUDA (CI's, this project's CPU machines): a skip there is
not a pass. Tests that need two GPUs say so where one is lent."""

from __future__ import annotations

import pytest
import torch

from app.errors import UserError
from conftest import HELPERS, TINY, multirun, read_metrics, run_job

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: run `make test-gpu` on a GPU machine")]
CUDA = ["accelerator=cuda", "accelerator_strict=true", *TINY]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason="needs 2 GPUs (NCCL takes one device per rank)")


@pytest.mark.parametrize("precision", ["32", "bf16-mixed", "16-mixed"])
def test_each_precision_trains_on_the_gpu(tmp_path, precision) -> None:
    job = run_job(tmp_path / "run", *CUDA, f"precision={precision}")
    assert job.value is not None and job.value > 0.5, (precision, job.value)  # (chance: 0.1)
    assert "on cuda x 1" in job.output, job.output[-2000:]


def test_compile_trains_on_the_gpu(tmp_path) -> None:
    job = run_job(tmp_path / "run", *CUDA, "compile=true", "precision=bf16-mixed")
    assert job.value is not None and job.value > 0.5


def test_telemetry_reads_cuda_events_and_memory(tmp_path) -> None:
    job = run_job(tmp_path / "run", *CUDA, "trainer.telemetry=true", "trainer.max_epochs=1")
    rows = [r for r in read_metrics(job.run_dir) if r["split"] == "train"]
    assert all(float(r["time/compute_s"]) > 0 for r in rows), rows
    assert all(float(r["mem/cuda_max_allocated_mb"]) > 0 for r in rows), rows
    assert "mfu" in rows[0] or "H100" not in torch.cuda.get_device_name()  # (a known GPU)


def test_an_out_of_memory_error_writes_the_allocator_s_snapshot(tmp_path) -> None:
    with pytest.raises(torch.OutOfMemoryError):
        run_job(tmp_path / "run", *CUDA, "trainer.telemetry=true",
                "model._target_=faults.FaultyCNN", "+model.fault=oom", "+model.fault_rank=0",
                user_code=HELPERS)
    assert (tmp_path / "run" / "logs" / "rank0.memory.pickle").stat().st_size > 0


def test_occupy_reserves_gpu_memory(tmp_path) -> None:
    job = run_job(tmp_path / "run", *CUDA, "occupy=0.05", "trainer.max_epochs=1")
    assert "occupy=0.05: reserved" in job.output, job.output[-2000:]


def test_device_id_picks_the_device_and_a_missing_one_is_one_line(tmp_path) -> None:
    run_job(tmp_path / "run", *CUDA, "device_id=0", "trainer.max_epochs=1")
    with pytest.raises(UserError, match=f"device_id={torch.cuda.device_count()}"):
        run_job(tmp_path / "missing", *CUDA, f"device_id={torch.cuda.device_count()}")


@two_gpus
def test_nccl_ddp_on_two_gpus(tmp_path) -> None:
    job = run_job(tmp_path / "run", *CUDA, "devices=2")
    assert job.value is not None and job.value > 0.5


@two_gpus
def test_sync_batchnorm_on_two_gpus(tmp_path) -> None:
    job = run_job(tmp_path / "run", *CUDA, "devices=2", "model.batch_norm=true",
                  "distributed.sync_batchnorm=true")
    assert job.value is not None and job.value > 0.5


def test_sharded_checkpoints_of_gpu_tensors_resume(tmp_path) -> None:
    """distributed.strategy=fsdp on one GPU: nothing to shard, but its checkpoints are
    sharded ones, written from CUDA tensors (DCP copies them to host memory in the
    background) and resumed onto the GPU; activation checkpointing on the GPU too."""
    from app.checkpoint import sharded

    overrides = [*CUDA, "distributed.strategy=fsdp", "precision=bf16-mixed", "trainer.ema=true",
                 "model=mlp", "trainer.activation_checkpointing=[Sequential]"]
    overrides = [o for o in overrides if not o.startswith("model.channels")]
    run = tmp_path / "run"
    run_job(run, *overrides, "trainer.max_epochs=2")
    assert sharded.is_sharded(run / "checkpoints" / "last.pt")
    job = run_job(run, *overrides, "trainer.max_epochs=3")
    assert job.value is not None and job.value > 0.5
    assert "resumed from" in job.output and "at step" in job.output


@two_gpus
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_fsdp_on_two_gpus(tmp_path, precision) -> None:
    """FSDP2 over NCCL with its mixed-precision policy (16-mixed with the loss scaler), a
    sharded checkpoint and its resume on the same two GPUs."""
    overrides = [*CUDA, "devices=2", "distributed.strategy=fsdp", f"precision={precision}"]
    run = tmp_path / "run"
    run_job(run, *overrides, "trainer.max_epochs=2")
    job = run_job(run, *overrides, "trainer.max_epochs=4")
    assert job.value is not None and job.value > 0.5
    assert "at step" in (run / "logs" / "rank0.log").read_text()


def test_submitit_local_sweep_jobs_each_get_their_own_gpu(tmp_path) -> None:
    """Two jobs of a local sweep at once, one GPU each (CUDA_VISIBLE_DEVICES slices: job k
    takes GPU k mod the GPUs); on a machine with one GPU there is nothing to split, and both
    train on it side by side."""
    proc, jobs = multirun(tmp_path, "hydra/launcher=submitit_local", *CUDA,
                          "trainer.max_epochs=1", "optimizer.lr=0.01,0.003")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert len(jobs) == 2
    gpus = torch.cuda.device_count()
    for num in (0, 1):
        sliced = f"job #{num}: CUDA_VISIBLE_DEVICES={num % gpus}"
        assert (sliced in output) == (gpus > 1), output[-3000:]
        assert " on cuda x 1:" in (tmp_path / "sweep" / str(num) / "train.log").read_text()
