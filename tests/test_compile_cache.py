"""compile=true keeps torch.compile's caches under the run directory, or a sweep's under the
sweep directory: a resumed (requeued) run and the second job of a sweep compile from them.

Each compile here builds C++ on the CPU (some 20 s cold for the tiny MLP, a few seconds
warm), so the runs are the smallest that compile: 2 steps of an MLP [8], as processes (a
process's first compile is what a requeued job pays).
"""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest

from app.training import compile_cache as cc
from app.training.compile_cache import FOLDER
from conftest import assert_ok, make_config, multirun, run_app, run_job

TINY_COMPILED = ["compile=true", "model=mlp", "model.hidden=[8]", "trainer.max_steps=2",
                 "trainer.progress_bar=false"]
COMPILE_LINE = re.compile(r"compile: [\d.]+ s, cache hits (\d+), misses (\d+)")


def hits_misses(log: str) -> tuple[int, int]:
    """The counts of the run's one "compile:" line."""
    lines = COMPILE_LINE.findall(log)
    assert len(lines) == 1, log[-3000:]
    return int(lines[0][0]), int(lines[0][1])


def test_the_second_job_of_a_sweep_compiles_from_the_sweep_s_cache(tmp_path) -> None:
    """Job 1 runs as a process of its own in the sweep directory, as a Slurm array's job does
    (Hydra's basic launcher runs the jobs in one process, where job 0's compiled code
    serves the next jobs, and nothing is compiled again)."""
    proc, _ = multirun(tmp_path, *TINY_COMPILED, "seed=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = tmp_path / "sweep"
    hits, misses = hits_misses((sweep / "0" / "train.log").read_text())
    assert hits == 0 and misses > 0  # a cold cache: compiled from scratch
    second = assert_ok(run_app(sweep / "1", *TINY_COMPILED, "seed=1")).output
    hits, misses = hits_misses(second)
    assert hits > 0 and misses == 0, second[-3000:]
    cache = sweep / FOLDER
    assert f"compile cache: {cache / 'inductor'}" in second
    assert any((cache / "inductor").iterdir())
    assert sorted(p.name for p in (cache / "artifacts").iterdir()) == ["0.bin", "1.bin"]
    assert not (sweep / "0" / FOLDER).exists() and not (sweep / "1" / FOLDER).exists()


def test_a_resumed_run_compiles_from_its_run_directory_s_cache(tmp_path) -> None:
    run_dir = tmp_path / "run"
    first = assert_ok(run_app(run_dir, *TINY_COMPILED)).output
    hits, misses = hits_misses(first)
    assert hits == 0 and misses > 0, first[-3000:]
    assert (run_dir / FOLDER / "artifacts" / "run.bin").is_file()
    # As Slurm's requeue reruns it: the same run directory, resumed from its checkpoint.
    second = assert_ok(run_app(run_dir, *TINY_COMPILED, "trainer.max_steps=4")).output
    assert "resumed from" in second
    assert re.search(r"compile cache: .*\((\d+) entries loaded from .*artifacts\)", second)
    hits, misses = hits_misses(second)
    assert hits > 0 and misses == 0, second[-3000:]


def test_a_user_s_inductor_folder_wins_over_the_run_s_and_inductor_s_own_does_not(
        tmp_path, monkeypatch) -> None:
    """(The set-up alone, in this process.) Inductor writes its default folder into the
    variable itself (import torch._dynamo), as in every worker a worker server forks: that
    value is not the user's."""
    from app import _private
    from app.config import Mode
    from app.training.compile_cache import VAR, compile_cache

    cfg = SimpleNamespace(compile=True, trainer=SimpleNamespace(mode=Mode.trainval))
    monkeypatch.setenv(VAR, _private.inductor_default_cache_dir())
    with compile_cache(cfg, tmp_path / "run"):
        assert os.environ[VAR] == str(tmp_path / "run" / FOLDER / "inductor")
    assert os.environ[VAR] == _private.inductor_default_cache_dir()  # (as it was)
    monkeypatch.setenv(VAR, str(tmp_path / "mine"))
    with compile_cache(cfg, tmp_path / "run"):
        assert os.environ[VAR] == str(tmp_path / "mine")


def test_without_compile_nothing_is_created(tmp_path) -> None:
    job = run_job(tmp_path / "run", "model=mlp", "model.hidden=[8]", "trainer.max_steps=2",
                  "trainer.progress_bar=false")
    assert not (tmp_path / "run" / FOLDER).exists()
    assert "compile cache" not in job.output and "compile:" not in job.output


def test_the_cache_never_hides_the_run_s_error_and_puts_its_variables_back(
        tmp_path, monkeypatch, caplog) -> None:
    """A failure to save the cache is a warning after the run's own error, which stands (a
    NaN stop must reach its replay); inductor's and Triton's folders are put back, so the
    next run in this process does not write into this one's cache."""
    def broken(*args) -> None:
        raise RuntimeError("disk gone")

    monkeypatch.setattr(cc, "_report_and_save", broken)
    monkeypatch.delenv(cc.TRITON, raising=False)
    monkeypatch.setenv(cc.VAR, str(tmp_path / "mine"))
    with pytest.raises(ValueError, match="the run's own"):
        with cc.compile_cache(make_config(*TINY_COMPILED), tmp_path / "run"):
            os.environ[cc.TRITON] = str(tmp_path / "run" / FOLDER / "triton")  # (as inductor)
            raise ValueError("the run's own")
    assert "compile cache: not saved (RuntimeError: disk gone)" in caplog.text
    assert cc.TRITON not in os.environ and os.environ[cc.VAR] == str(tmp_path / "mine")
