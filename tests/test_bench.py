"""The benchmark's baseline is a fair one: bench/plain_loop.py trains to the very same losses
as the app's loop, so that the step-time ratio compares equal work."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, assert_ok, read_metrics, run_app


def test_plain_loop_and_app_give_identical_losses(tmp_path) -> None:
    steps = 25
    losses = tmp_path / "plain.json"
    subprocess.run([sys.executable, str(REPO / "bench" / "plain_loop.py"), "--steps", str(steps),
                    "--losses", str(losses)], cwd=REPO, check=True, timeout=300)
    run = assert_ok(run_app(tmp_path / "app", f"trainer.max_steps={steps}",
                            "trainer.log_every_n_steps=1", "trainer.progress_bar=false"))
    app = [float(r["loss"]) for r in read_metrics(run.run_dir) if r["split"] == "train"]
    plain = json.loads(losses.read_text())
    assert len(app) == len(plain) == steps
    assert app == plain  # bit for bit, every step
