"""The profiler callback: a trace of exactly the window's steps, the top operators in the log,
nothing outside the window, a run shorter than it, resume, several ranks, bad values."""

from __future__ import annotations

import json
import shutil

import pytest

import app.callbacks.profiler as profiler_module
from app.callbacks import Callbacks
from app.errors import UserError
from conftest import TINY, assert_ok, make_config, run_app, run_job

# Steps 6-9 traced (wait 4, warm-up step 5), in a run of 12 steps.
WINDOW = [*TINY, "trainer.max_epochs=null", "trainer.max_steps=12", "+callbacks/profiler=default",
          "callbacks.profiler.wait=4", "callbacks.profiler.warmup=1", "callbacks.profiler.active=4"]


def _steps_traced(path) -> list[int]:
    """The steps a trace marks (ProfilerStep#N), checking it is one a viewer opens."""
    events = json.loads(path.read_text())["traceEvents"]
    assert sum(e.get("name", "").startswith("aten::") for e in events) > 100
    return sorted(int(e["name"].partition("#")[2]) for e in events
                  if e.get("name", "").startswith("ProfilerStep#"))


def test_the_trace_holds_the_window_and_the_log_its_top_operators(tmp_path, monkeypatch) -> None:
    stepped = []  # the profiler's step count at each of its step() calls

    class Counted(profiler_module.profile):
        def step(self) -> None:
            stepped.append(self.step_num)
            super().step()

    monkeypatch.setattr(profiler_module, "profile", Counted)
    result = run_job(tmp_path / "run", *WINDOW)
    assert _steps_traced(result.run_dir / "profile" / "rank0.pt.trace.json") == [6, 7, 8, 9]
    # Created after step 4; a step() at the end of steps 5 (warm-up) to 9, none after.
    assert stepped == [5, 6, 7, 8, 9]
    assert "profiler: tracing steps 6-9 on rank 0\n" in result.output
    assert "profiler: steps 6-9 took" in result.output and "ui.perfetto.dev" in result.output
    table = result.output.partition("profiler: top 10 operators of steps 6-9 on rank 0:\n")[2]
    lines = table.splitlines()
    assert lines[0].split() == ["operator", "calls", "self", "CPU", "ms", "%"]
    rows = lines[1:11]  # (an annotation such as Optimizer.step#AdamW.step may lead)
    assert any(row.startswith("aten::") for row in rows)
    assert all(len(row.split()) == 4 and not row.startswith("ProfilerStep") for row in rows)
    assert len(list((result.run_dir / "profile").iterdir())) == 1


def test_a_run_shorter_than_the_window_traces_what_it_has(tmp_path) -> None:
    short = run_job(tmp_path / "short", *WINDOW, "trainer.max_steps=7")
    assert ("profiler: tracing steps 6-7 on rank 0 (the run ends at step 7, inside the "
            "window steps 6-9)") in short.output
    assert _steps_traced(short.run_dir / "profile" / "rank0.pt.trace.json") == [6, 7]
    none = run_job(tmp_path / "none", *WINDOW, "trainer.max_steps=5")
    assert ("profiler: the run has 5 steps, fewer than the window (steps 6-9) needs: "
            "nothing traced") in none.output
    assert not (none.run_dir / "profile").exists()


def test_a_resumed_run_traces_what_is_left_of_the_window(tmp_path) -> None:
    overrides = [*WINDOW, "trainer.ckpt_every_n_steps=4", "trainer.keep_last=10",
                 "callbacks.profiler.top=0"]
    whole = run_job(tmp_path / "whole", *overrides).run_dir
    for step, traced in [(4, [6, 7, 8, 9]), (8, [9])]:  # before the window, inside it
        resumed = tmp_path / f"from{step}"
        (resumed / "checkpoints").mkdir(parents=True)
        shutil.copy(whole / "checkpoints" / f"step-{step:08d}.pt",
                    resumed / "checkpoints" / "last.pt")
        output = run_job(resumed, *overrides).output
        assert f"at step {step}" in output and "top 0 operators" not in output
        assert _steps_traced(resumed / "profile" / "rank0.pt.trace.json") == traced
    again = run_job(whole, *overrides)  # finished: after the window
    assert "profiler: the run resumed at step 12, after the window (steps 6-9)" in again.output


def test_every_rank_writes_its_trace_with_ranks_all(tmp_path) -> None:
    """The CLI, as a user runs it: rank 0's table in train.log, rank 1's in its own log."""
    result = assert_ok(run_app(tmp_path / "run", *WINDOW, "devices=2",
                               "callbacks.profiler.ranks=all", "callbacks.profiler.active=2"))
    for rank in (0, 1):
        assert _steps_traced(result.run_dir / "profile" / f"rank{rank}.pt.trace.json") == [6, 7]
        log = (result.run_dir / "logs" / f"rank{rank}.log").read_text()
        assert f"profiler: top 10 operators of steps 6-7 on rank {rank}:" in log
    train_log = (result.run_dir / "train.log").read_text()
    assert "on rank 0:" in train_log and "on rank 1:" not in train_log


def test_only_rank_0_is_traced_by_default(tmp_path) -> None:
    result = run_job(tmp_path / "run", *WINDOW, "devices=2", "callbacks.profiler.active=1")
    assert [p.name for p in (result.run_dir / "profile").iterdir()] == ["rank0.pt.trace.json"]


@pytest.mark.parametrize(("override", "words"), [
    ("wait=-1", "callbacks.profiler.wait=-1: must be 0 or more"),
    ("active=0", "callbacks.profiler.active=0: must be 1 or more"),
    ("warmup=1.5", "callbacks.profiler.warmup=1.5: expected a whole number"),
    ("ranks=3", "callbacks.profiler.ranks=3: the run has 1 rank(s), 0 to 0; there is no rank 3"),
    ("ranks=some", "callbacks.profiler.ranks=some: expected a rank (0), a list of ranks ([0,1]) "
                   "or all"),
])
def test_bad_values_are_one_line_errors_naming_the_key(override, words) -> None:
    with pytest.raises(UserError) as error:
        Callbacks.build(make_config("+callbacks/profiler=default",
                                    f"callbacks.profiler.{override}"))
    assert words in str(error.value) and "\n" not in str(error.value)


def test_on_a_gpu_the_table_ranks_by_cuda_time() -> None:
    """(No GPU here: the table from events as a CUDA run's profiler averages them.)"""
    class Averages:
        def __init__(self, key, cpu, cuda):
            self.key, self.count = key, 2
            self.self_cpu_time_total, self.self_device_time_total = cpu, cuda

    class Prof:
        def key_averages(self):
            return [Averages("aten::addmm", 100, 3000), Averages("ProfilerStep*", 900, 0),
                    Averages("aten::copy_", 500, 1000)]

    lines = profiler_module.top_table(Prof(), 2, cuda=True).splitlines()
    assert lines[0].split() == ["operator", "calls", "self", "CUDA", "ms", "%", "self", "CPU",
                                "ms", "%"]
    assert lines[1].split() == ["aten::addmm", "2", "3.000", "75.0", "0.100", "16.7"]
    assert lines[2].split() == ["aten::copy_", "2", "1.000", "25.0", "0.500", "83.3"]
    assert len(lines) == 3
