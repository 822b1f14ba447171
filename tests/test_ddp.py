"""Several processes for real (gloo on the CPU): spawn, torchrun, sweeps, exact resume.

The DDP arithmetic (batch split, evaluation counts, exact resume) runs in this process
(`run_job`, whose workers are real processes too); the CLI where the processes are the
subject: the default job's console, start methods, torchrun, sweeps."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conftest import (
    TINY,
    assert_ok,
    assert_same_weights,
    check_summary,
    load_state,
    multirun,
    read_metrics,
    run_app,
    run_job,
)


def test_two_workers_reach_the_accuracy_bar(tmp_path) -> None:
    result = assert_ok(run_app(tmp_path / "run", "devices=2", "trainer.progress_bar=false"))
    best = load_state(result.run_dir / "checkpoints" / "best.pt")["best"]
    assert best >= 0.97
    for rank in (0, 1):
        assert "done: step 220" in (result.run_dir / "logs" / f"rank{rank}.log").read_text()
    assert result.output.count("done: step 220") == 1  # only rank 0 logs to the console


def test_two_workers_of_batch_b_equal_one_of_batch_2b(tmp_path) -> None:
    same = [*TINY, "trainer.max_epochs=1", "model.dropout=0", "trainer.ckpt_every_n_epochs=null"]
    one = run_job(tmp_path / "one", *same, "devices=1", "data.batch_size=64")
    two = run_job(tmp_path / "two", *same, "devices=2", "data.batch_size=32")
    rows_one, rows_two = read_metrics(one.run_dir), read_metrics(two.run_dir)
    assert [r["step"] for r in rows_one] == [r["step"] for r in rows_two]
    for a, b in zip(rows_one, rows_two, strict=True):
        assert float(a["loss"]) == pytest.approx(float(b["loss"]), rel=1e-4, abs=1e-6)


def test_eval_counts_each_sample_once_with_an_odd_split(trained, tmp_path) -> None:
    ckpt = trained / "checkpoints" / "best.pt"
    records = []
    for devices in (1, 2):
        result = run_job(tmp_path / f"eval{devices}", "trainer=eval", f"ckpt={ckpt}",
                         "model.channels=[8,16]", f"devices={devices}", "data.val_batch_size=50")
        records.append(json.loads((result.run_dir / "eval.json").read_text()))
    assert records[1]["world_size"] == 2
    assert records[0]["num_samples"] == records[1]["num_samples"] == 359  # odd: 180 + 179
    assert records[0]["acc"] == records[1]["acc"]
    assert records[0]["loss"] == pytest.approx(records[1]["loss"], rel=1e-6)  # float32 sums


def test_resume_with_two_workers_is_exact(tmp_path) -> None:
    # 11 steps per epoch per worker; step 15 lies in the middle of epoch 2.
    overrides = [*TINY, "devices=2", "trainer.max_epochs=3", "trainer.ckpt_every_n_steps=5",
                 "trainer.keep_last=100"]
    reference = run_job(tmp_path / "reference", *overrides).run_dir
    source = reference / "checkpoints" / "step-00000015.pt"
    assert len(load_state(source)["rng"]) == 2  # each rank's random state
    resumed = run_job(tmp_path / "resumed", *overrides, f"resume={source}").run_dir
    assert_same_weights(reference / "checkpoints" / "last.pt", resumed / "checkpoints" / "last.pt")
    after = [r for r in read_metrics(reference) if int(r["step"]) > 15]
    assert [r for r in read_metrics(resumed) if int(r["step"]) > 15] == after


def test_multirun_sweep_spawns_and_returns_rank0_metric(tmp_path) -> None:
    proc, jobs = multirun(tmp_path, "devices=2", "optimizer.lr=0.01,0.1", *TINY,
                          "trainer.max_epochs=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [j["overrides"][1] for j in jobs] == ["optimizer.lr=0.01", "optimizer.lr=0.1"]
    for num, job in enumerate(jobs):
        run_dir = tmp_path / "sweep" / str(num)
        best = max(float(r["acc"]) for r in read_metrics(run_dir) if r["split"] == "val")
        assert job["status"] == "COMPLETED" and job["value"] == best
        assert (run_dir / "logs" / "rank1.log").is_file()


def test_torchrun_trains_into_one_run_directory(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "app", *TINY, "trainer.max_epochs=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dirs = [p.parent for p in (tmp_path / "outputs").rglob(".hydra")]
    assert len(run_dirs) == 1, run_dirs
    run_dir = run_dirs[0]
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    assert "rank 1 of 2 from torchrun" in (run_dir / "logs" / "rank1.log").read_text()
    assert (run_dir / "checkpoints" / "last.pt").is_file()
    assert (proc.stdout + proc.stderr).count("done: step 11") == 1


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_other_start_methods(method, tmp_path) -> None:
    result = assert_ok(run_app(tmp_path / "run", "devices=2", "debug=fast",
                               "model.channels=[8,16]", f"distributed.start_method={method}"))
    assert (result.run_dir / "logs" / "rank1.log").is_file()
    assert load_state(result.run_dir / "checkpoints" / "last.pt")["loop"]["step"] == 6
    assert "Warning" not in result.output  # (torch 2.13 deprecated DDP's broadcast_buffers)


def test_submitit_local_jobs_spawn_their_workers_and_a_failure_is_reported(tmp_path) -> None:
    # Two jobs side by side, each spawning two workers; rank 1 of job #0 fails.
    proc, jobs = multirun(tmp_path, "hydra/launcher=submitit_local", "devices=2", *TINY,
                          "trainer.max_epochs=1", "model._target_=faults.FaultyCNN",
                          "+model.fault=raise,none")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]  # a job failed: the sweep's summary says so
    assert "job #0" in output and "rank 1 failed: RuntimeError: injected fault" in output
    run_dir = tmp_path / "sweep" / "1"
    assert (run_dir / "logs" / "rank1.log").is_file()
    best = max(float(r["acc"]) for r in read_metrics(run_dir) if r["split"] == "val")
    assert [j["status"] for j in jobs] == ["COMPLETED", "COMPLETED"]  # (NaN for the failed)
    assert math.isnan(jobs[0]["value"]) and jobs[1]["value"] == best
    rows = check_summary(tmp_path / "sweep", 2, completed_only=True)
    assert [r["status"] for r in rows] == ["completed", "failed"]
