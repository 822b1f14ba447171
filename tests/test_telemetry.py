"""`trainer.telemetry=true`: each rank's step broken into its parts, throughput and FLOPs,
peak memory, and the slowest rank named by its time before the gradients' all-reduce; none
of it changes what is trained."""

from __future__ import annotations

import csv
import json
import logging
import re
import socket

import pytest
import torch
from torch import nn

from app.sweeps.summary import job_summary, markdown, said_slowest
from app.training import telemetry
from conftest import HELPERS, TINY, assert_same_weights, read_metrics, run_job

SECTIONS = ["time/data_s", "time/compute_s", "time/wait_s", "time/optimizer_s",
            "time/checkpoint_s"]


def test_telemetry_changes_nothing_of_the_training(tmp_path) -> None:
    """Weights and losses bit for bit as without it (the FLOP count runs on meta tensors)."""
    on = run_job(tmp_path / "on", *TINY, "trainer.max_epochs=2", "trainer.telemetry=true")
    off = run_job(tmp_path / "off", *TINY, "trainer.max_epochs=2")
    assert_same_weights(on.run_dir / "checkpoints" / "last.pt",
                        off.run_dir / "checkpoints" / "last.pt")
    losses = {name: [r["loss"] for r in read_metrics(job.run_dir)]
              for name, job in (("on", on), ("off", off))}
    assert losses["on"] == losses["off"]
    assert not (off.run_dir / "logs" / "telemetry.json").exists()
    assert "time/step_s" not in read_metrics(off.run_dir)[0]  # (off: no column)


def test_each_logged_step_has_its_parts_speed_and_memory(tmp_path) -> None:
    job = run_job(tmp_path / "run", *TINY, "trainer.max_epochs=2", "trainer.telemetry=true",
                  "trainer.log_every_n_steps=5", "trainer.peak_flops=1e12")
    rows = [r for r in read_metrics(job.run_dir) if r["split"] == "train"]
    assert rows and all(r["time/step_s"] for r in rows)
    for row in rows:
        parts = [float(row[name]) for name in SECTIONS]
        assert all(p >= 0 for p in parts) and float(row["time/compute_s"]) > 0
        assert sum(parts) == pytest.approx(float(row["time/step_s"]))
        assert float(row["samples_per_s"]) > 0 and float(row["mem/peak_rss_mb"]) > 50
        # MFU: FLOP/s per device over the peak given
        assert float(row["mfu"]) == pytest.approx(float(row["tflops_per_device"]) * 1e12 / 1e12)
    _flops_agree(job.run_dir, rows, global_batch=64)
    assert "ms/step (data " in job.output and "samples/s" in job.output and "MFU " in job.output
    summary = json.loads((job.run_dir / "logs" / "telemetry.json").read_text())
    assert summary["world_size"] == 1 and summary["flops_per_step"] > 0
    assert "straggler" not in summary  # (one rank)
    with open(job.run_dir / "logs" / "steps.csv") as f:
        logged = list(csv.DictReader(f))
    assert [int(r["step"]) for r in logged] == [int(r["step"]) for r in rows]
    assert {r["rank"] for r in logged} == {"0"}


def test_the_flops_of_a_step_are_counted_as_pytorch_counts_them() -> None:
    """An MLP 64 -> 8 -> 10 on a batch of 4: forward 2 matmuls; backward the second's two
    (input and weight) and the first's weight gradient."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.random.get_rng_state()
    b, i, h, c = 4, 64, 8, 10
    expected = 2 * b * i * h + 2 * b * h * c + 2 * (2 * b * h * c) + 2 * b * i * h
    assert telemetry.flops_per_batch(model, (i,), b, c) == expected
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert torch.equal(state, torch.random.get_rng_state())  # (no random draw)


def test_a_model_that_cannot_be_counted_trains_without_mfu(caplog) -> None:
    class Host(nn.Module):  # reads its input's values: not on meta tensors
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * float(x.sum())

    with caplog.at_level(logging.WARNING):
        assert telemetry.flops_per_batch(Host(), (4,), 2, 2) is None
    assert "the FLOPs of a step were not counted" in caplog.text and "no MFU" in caplog.text


def test_peak_flops_of_a_known_gpu_and_of_the_command_line() -> None:
    assert telemetry.peak_flops(torch.device("cpu"), None) is None
    assert telemetry.peak_flops(torch.device("cpu"), 2e12) == 2e12


def test_the_slow_rank_is_named_by_its_time_before_the_all_reduce(tmp_path) -> None:
    """Rank 1 sleeps 50 ms in each forward: both ranks' steps take as long (rank 0 waits in
    the all-reduce), but rank 1 is the one busy before it."""
    job = run_job(tmp_path / "run", *TINY, "devices=2", "trainer.max_epochs=2",
                  "trainer.telemetry=true", "trainer.log_every_n_steps=5",
                  "model._target_=faults.FaultyCNN", "+model.fault=slow", "+model.fault_rank=1",
                  user_code=HELPERS)
    with open(job.run_dir / "logs" / "steps.csv") as f:
        logged = list(csv.DictReader(f))
    waits = {rank: sum(float(r["wait_s"]) for r in logged if r["rank"] == rank)
             for rank in ("0", "1")}
    assert waits["0"] > waits["1"] + 0.02, waits  # rank 0 waited for rank 1
    summary = json.loads((job.run_dir / "logs" / "telemetry.json").read_text())
    assert summary["straggler"]["rank"] == 1 and summary["straggler"]["excess"] > 0.2, summary
    assert (job.run_dir / "plots" / "steps.png").stat().st_size > 10_000  # (a bar per rank)
    rows = [r for r in read_metrics(job.run_dir) if r["split"] == "train"]
    assert all(r["straggler/rank"] == "1" for r in rows[1:]), rows
    _flops_agree(job.run_dir, rows, global_batch=128)  # (each rank's FLOPs, per device)
    # The sweep summary's column (app.report, app.status read the same)
    found = job_summary(job.run_dir)["slowest_rank"]
    assert found["rank"] == 1 and found["host"] == socket.gethostname(), found
    assert re.fullmatch(rf"rank 1 on {re.escape(socket.gethostname())} \+\d+%",
                        said_slowest(found))
    table = markdown([{**job_summary(job.run_dir), "job": "0", "overrides": "", "run_dir": ""}])
    assert table.splitlines()[0].endswith("| error | slowest_rank |")
    assert "slowest_rank" not in markdown([{**job_summary(tmp_path), "job": "0",
                                            "overrides": "", "run_dir": ""}])


def test_on_a_gpu_a_step_is_read_once_its_events_are_done(tmp_path, monkeypatch) -> None:
    """CUDA events stand in for the GPU's (fakes here; the GPU lane runs the real ones): a step
    whose events the device has not reached yet is read at a later logging step, and no read
    waits for it (no synchronize, no elapsed_time of an event not done)."""
    class Event:
        clock = 0.0

        def __init__(self, enable_timing: bool) -> None:
            self.at, self.reached = None, True

        def record(self) -> None:
            Event.clock += 0.004  # 4 ms between marks
            self.at = Event.clock

        def query(self) -> bool:
            return self.reached

        def elapsed_time(self, end: Event) -> float:
            assert self.reached and end.reached, "read before the device got there"
            return (end.at - self.at) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    for name in ("max_memory_allocated", "max_memory_reserved", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda device: 0)
    t = telemetry.Telemetry(tmp_path, torch.device("cpu"), 64, None, None)
    t.cuda = True
    for step in (1, 2):
        t.step_marks = telemetry._Marks(cuda=True)
        for name in ("start", "data", "grads", "backward", "optimizer"):
            t.mark(name)
        if step == 2:  # the device is still on step 2
            t.step_marks.points["optimizer"].reached = False
        t.step_done()
    first = t.read(2)
    assert first["time/compute_s"] == pytest.approx(0.004) and len(t.pending) == 1
    t.pending[0].points["optimizer"].reached = True
    t.read(3)
    assert not t.pending


def test_the_progress_bar_shows_the_step_time_and_the_wait(tmp_path, capfd) -> None:
    run_job(tmp_path / "run", *TINY, "trainer.max_epochs=1", "trainer.telemetry=true",
            "trainer.progress_bar=true")
    assert re.search(r"ms/step=[\d.]+, wait=\d+%", capfd.readouterr().err)


def _flops_agree(run_dir, rows, global_batch: int) -> None:
    """FLOP/s per device = one rank's FLOPs a step x steps a second."""
    flops = json.loads((run_dir / "logs" / "telemetry.json").read_text())["flops_per_step"]
    for row in rows:
        steps_per_s = float(row["samples_per_s"]) / global_batch
        assert float(row["tflops_per_device"]) * 1e12 == pytest.approx(flops * steps_per_s)


@pytest.mark.parametrize(("name", "peak"), [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA L4", 121e12), ("NVIDIA L40S", 362e12), ("NVIDIA L40", None),
    ("NVIDIA A10G", None), ("NVIDIA A100-SXM4-80GB", 312e12), ("Tesla T4", 65e12)])
def test_a_gpu_s_peak_is_found_by_the_whole_words_of_its_name(name, peak) -> None:
    assert telemetry.peak_of(name) == peak


def test_a_resumed_run_adds_to_its_step_records(tmp_path) -> None:
    first = run_job(tmp_path / "run", *TINY, "trainer.max_epochs=1", "trainer.telemetry=true",
                    "trainer.log_every_n_steps=5")
    run_job(tmp_path / "run", *TINY, "trainer.max_epochs=2", "trainer.telemetry=true",
            "trainer.log_every_n_steps=5")
    with open(first.run_dir / "logs" / "steps.csv") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    assert steps == [5, 10, 15, 20, 22, 25, 30, 35, 40, 44], steps  # (both attempts, a header)
