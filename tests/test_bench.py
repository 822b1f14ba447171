"""The benchmark's baseline is a fair one: bench/plain_loop.py trains to the very same losses
as the app's loop, so that the step-time ratio compares equal work. Both run in this process,
on the same thread count and MKL mode (tests/conftest.py: what `python -m app` sets)."""

from __future__ import annotations

import importlib.util

from conftest import REPO, read_metrics, run_job


def _plain_loop():
    spec = importlib.util.spec_from_file_location("plain_loop", REPO / "bench" / "plain_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plain_loop_and_app_give_identical_losses(tmp_path) -> None:
    steps = 25
    plain_loop = _plain_loop()
    plain = plain_loop.train(plain_loop.parser().parse_args(["--steps", str(steps)]))
    run = run_job(tmp_path / "app", f"trainer.max_steps={steps}", "trainer.log_every_n_steps=1",
                  "trainer.progress_bar=false")
    app = [float(r["loss"]) for r in read_metrics(run.run_dir) if r["split"] == "train"]
    assert len(app) == len(plain) == steps
    assert app == plain  # bit for bit, every step
