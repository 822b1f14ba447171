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


def test_step_parts_accounts_for_each_part_of_the_loop(tmp_path, monkeypatch) -> None:
    """bench/step_parts.py (the GPU step ratio's breakdown) times what the loop really calls:
    each part as often as the config says, and the parts within the loop's time."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import step_parts

    # (Not Hydra's handlers on this process's root logger: the other tests' log capture.)
    monkeypatch.setattr(step_parts.step_overhead, "_logging_as_hydra", lambda run_dir: None)
    steps, total, parts = step_parts.measure(
        ["trainer.max_steps=30", "trainer.log_every_n_steps=10", "trainer.val_every_n_steps=15",
         "trainer.val_every_n_epochs=null", "trainer.progress_bar=false"], tmp_path)
    assert steps == 30
    calls = {label: n for label, (n, _) in parts.items()}
    assert calls == {"train step": 30, "loss check": 30, "logging step": 3, "validation": 2,
                     "checkpoint save": calls["checkpoint save"]}
    assert calls["checkpoint save"] >= 1  # (the last step's; a new best adds more)
    assert 0 < sum(seconds for _, seconds in parts.values()) <= total
    table = step_parts.table(steps, total, parts)
    assert "| logging step | 3 |" in table and "| **all** | 30 steps |" in table
