"""NaN forensics by replay (`python -m app.replay RUN_DIR`, `trainer.replay_nonfinite=true`):
a run stopped by a non-finite loss is trained again from its newest checkpoint before the bad
step, exactly, and logs/nonfinite.json names the module and the samples. The faults are
injected by user components (tests/helpers/poisoned.py): a data set with an inf at a known
sample, a model whose backward alone goes NaN at a marked value."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from app.errors import AppError, UserError
from conftest import HELPERS, REPO, TINY, read_metrics, run_app, run_job

POISONED = 100  # the training sample carrying the fault, from the second epoch on
# (ckpt_every_n_epochs=1: the first epoch, 22 steps, ends with the checkpoint to replay from)
RUN = [*TINY, "trainer.max_epochs=2", "data._target_=poisoned.PoisonedDigits",
       f"+data.poison_index={POISONED}"]


def _stopped(run_dir, *overrides: str) -> int:
    """Run to the non-finite loss (in this process); the step its error names."""
    with pytest.raises(AppError) as raised:
        run_job(run_dir, *RUN, *overrides, user_code=HELPERS)
    message = str(raised.value)
    assert "python -m app.replay RUN_DIR" in message, message
    step = int(re.search(r"the training loss was nan at step (\d+)", message)[1])
    assert step >= 22 + 2  # (a replayed step before the bad one, to compare with the run's)
    return step


def _report(run_dir) -> dict:
    return json.loads((run_dir / "logs" / "nonfinite.json").read_text())


def test_the_replay_names_the_first_layer_and_the_poisoned_sample(tmp_path) -> None:
    """The command a user types, on the run directory `python -m app` made."""
    run_dir = tmp_path / "run"
    user_code = {"PYTHONPATH": str(HELPERS)}
    stopped = run_app(run_dir, *RUN, env=user_code)
    assert stopped.returncode == 1, stopped.output[-3000:]
    assert "python -m app.replay RUN_DIR" in stopped.output
    step = int(re.search(r"the training loss was nan at step (\d+)", stopped.output)[1])
    assert step >= 22 + 2  # (a replayed step before the bad one, to compare with the run's)
    replayed = subprocess.run(
        [sys.executable, "-m", "app.replay", str(run_dir)], cwd=REPO, capture_output=True,
        text=True, timeout=120, env={**os.environ, **user_code})
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    line = replayed.stdout.strip()
    assert line == (f"step {step}: the first non-finite output was features.0 (Conv2d), at "
                    f"sample {POISONED} of the data set; details in "
                    f"{run_dir / 'logs' / 'nonfinite.json'}"), line
    report = _report(run_dir)
    assert (report["step"], report["stopped_at"], report["rank"]) == (step, step, 0)
    assert (report["found_in"], report["module"], report["type"]) == \
        ("output", "features.0", "Conv2d")
    assert report["module_samples"] == report["samples_with_nonfinite_loss"] == [POISONED]
    assert POISONED in report["samples"] and len(report["samples"]) == 64
    (rank,) = report["ranks"]
    assert rank["replayed_from"].endswith("step-00000022.pt")
    # Exact: every step replayed before the bad one lost what the run logged, to the bit.
    logged = {int(row["step"]): float(row["loss"]) for row in read_metrics(run_dir)
              if row["split"] == "train" and 22 < int(row["step"]) < step}
    assert logged and {int(k): v for k, v in rank["losses_before"].items()} == logged
    assert report["losses_match_run"] is True


def test_replay_nonfinite_names_a_gradient_that_went_nan_under_a_finite_loss(
        tmp_path, caplog) -> None:
    """The backward alone goes NaN at the marked sample: its step's loss is finite, the update
    makes the weights NaN, the next step's loss is NaN. The replay watches the step that made
    them, and anomaly mode names the op; the run's own error stays the one reported."""
    run_dir = tmp_path / "run"
    step = _stopped(run_dir, "model._target_=poisoned.FragileCNN", "+data.poison_value=-3.25",
                    "trainer.replay_nonfinite=true")
    report = _report(run_dir)
    assert (report["step"], report["stopped_at"]) == (step - 1, step)
    assert (report["found_in"], report["module"], report["type"]) == \
        ("gradient", "fragile", "Fragile")
    assert "SqrtBackward0" in report["backward_op"] and report["parameters"] == ["fragile.scale"]
    assert POISONED in report["samples"] and report["losses_match_run"] is True
    assert f"step {step - 1}, whose update made the weights non-finite" in caplog.text
    assert f"details in {run_dir / 'logs' / 'nonfinite.json'}" in caplog.text


def test_with_two_ranks_the_rank_that_had_the_sample_is_named(tmp_path) -> None:
    """Every rank replays its own batch (DDP averages the gradients as in the run); the rank
    whose batch held the poisoned sample names it, the other's loss stays finite."""
    run_dir = tmp_path / "run"
    with pytest.raises(AppError, match="on one rank at least"):
        run_job(run_dir, *RUN, "devices=2", "trainer.replay_nonfinite=true", user_code=HELPERS)
    report = _report(run_dir)
    ranks = {r["rank"]: r for r in report["ranks"]}
    (holder,) = [rank for rank, r in ranks.items() if POISONED in r["samples"]]
    assert (report["rank"], report["module"], report["module_samples"]) == \
        (holder, "features.0", [POISONED])
    assert ranks[holder]["loss"] == "nan" and isinstance(ranks[1 - holder]["loss"], float)
    assert ranks[0]["replayed_from"].endswith("step-00000011.pt")  # (11 steps an epoch)


def test_a_run_that_did_not_stop_at_a_nonfinite_loss_is_refused(tmp_path, capsys) -> None:
    from app.replay import main

    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("{}\n")
    (tmp_path / "result.json").write_text('{"status": "completed"}\n')
    assert main([str(tmp_path)]) == 2
    assert "did not stop at a non-finite loss" in capsys.readouterr().err


def test_a_step_the_run_never_trains_is_refused_not_replayed_forever(tmp_path) -> None:
    """--step past the run's last step (or at a step before the checkpoint) is one line."""
    from app import replay as cli

    run = tmp_path / "run"
    assert run_app(run, *TINY, "trainer.max_epochs=1").returncode == 0
    with pytest.raises(UserError, match=r"step 500 is not one the run trains after .*: it "
                                        r"ends at step 22"):
        cli.replay(run, step=500)


def test_a_checkpoint_with_non_finite_weights_is_passed_for_an_earlier_one(tmp_path) -> None:
    """A step whose loss was finite can save the weights an infinite gradient made: the
    replay starts from the newest checkpoint before the bad step whose weights are finite."""
    import torch

    run_dir = tmp_path / "run"
    user_code = {"PYTHONPATH": str(HELPERS)}
    assert run_app(run_dir, *RUN, env=user_code).returncode == 1
    state = torch.load(run_dir / "checkpoints" / "step-00000022.pt", weights_only=True)
    first = next(iter(state["model"]))
    state["model"][first] = torch.full_like(state["model"][first], float("nan"))
    torch.save(state, run_dir / "checkpoints" / "step-00000023.pt")
    replayed = subprocess.run(
        [sys.executable, "-m", "app.replay", str(run_dir)], cwd=REPO, capture_output=True,
        text=True, timeout=120, env={**os.environ, **user_code})
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    (rank,) = _report(run_dir)["ranks"]
    assert rank["replayed_from"].endswith("step-00000022.pt"), rank
    assert _report(run_dir)["module"] == "features.0"
