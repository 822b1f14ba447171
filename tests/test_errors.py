"""Bad input: a short error naming the key or path, exit status 2, no traceback.

A config Hydra cannot compose is Hydra's to report, and the CLI adds a line to some of those
reports and makes the exit status 2 (app.compose_errors): they run `python -m app`. The app's
checks raise UserError, which the entry prints as one line with exit 2: they run in this
process (`run_job`), and two of them also through the CLI, to show that last step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app.errors import UserError
from conftest import REPO, TINY, run_app, run_job

# Refused while Hydra composes the config: Hydra's report names the key (the words); where
# app adds a line after Hydra's report (app.compose_errors), that line ends stderr.
COMPOSING = {
    "unknown key": (["trainer.max_epoch=3"], "max_epoch",
                    "trainer.max_epoch: did you mean trainer.max_epochs?"),
    "misspelt key of a _target_ group": (["model.chanels=8"], "chanels",
                                         "model.chanels: did you mean model.channels?"),
    "unknown group option": (["model=resnet50"], "resnet50",
                             "model=resnet50: did you mean model=resnet?"),
    "wrong type": (["trainer.max_epochs=many"], "trainer.max_epochs=many", None),
    "not an override": (["data.batch_size"], "data.batch_size", None),
    "wrong choice": (["trainer.monitor_mode=up"], "monitor_mode", None),
    "bad monitor": (["trainer.monitor=val/f1"], "trainer.monitor=val/f1", None),
    "unknown accelerator": (["accelerator=tpu"], "accelerator=tpu", None),
}

# Refused by the app's checks (UserError), before anything is written.
CHECKS = {
    "negative learning rate": (["optimizer.lr=-0.1"], "optimizer.lr=-0.1"),
    "no stopping rule": (["trainer.max_epochs=null"], "trainer.max_steps"),
    "zero batch": (["data.batch_size=0"], "data.batch_size=0"),
    "batch larger than data": (["data.batch_size=5000"], "data.batch_size=5000"),
    "eval without checkpoint": (["trainer=eval"], "ckpt=PATH"),
    "missing checkpoint": (["trainer=eval", "ckpt=/nonexistent/best.pt"],
                           "/nonexistent/best.pt: file not found"),
    "missing resume file": (["resume=/nonexistent/last.pt"], "/nonexistent/last.pt"),
    "missing predict input": (["trainer=predict", "ckpt=CKPT", "predict.input=/no/such.npy"],
                              "predict.input=/no/such.npy"),
    "checkpoint of another model": (["trainer=eval", "ckpt=CKPT", "model=mlp"],
                                    "does not match the model"),
    "checkpoint of another width": (["trainer=eval", "ckpt=CKPT"], "shape"),
    "several nodes without an address": (["nodes=2"], "dist_url=tcp://HOST:PORT"),
    "missing accelerator, strict": (["accelerator=xpu", "accelerator_strict=true"],
                                    "accelerator=xpu"),
    "horovod": (["distributed.horovod=true"], "Horovod is not supported"),
    # (The CLI read its overrides resolved: a traceback there, before the check.)
    "bad interpolation": (["seed=${oops}"], "seed: Interpolation key 'oops' not found"),
}


def _overrides(case: str, overrides: list[str], trained: Path | None) -> list[str]:
    if trained is not None:
        ckpt = trained / "checkpoints" / "best.pt"
        overrides = [o.replace("CKPT", str(ckpt)) for o in overrides]
    # Cases that change the model, or need the default width, drop TINY's model settings.
    keep_model = "width" not in case and not any(o.startswith("model=") for o in overrides)
    return [t for t in TINY if keep_model or not t.startswith("model.")] + overrides


def _a_clear_error(result, words: str, run_dir) -> None:
    assert result.returncode != 0
    assert words in result.output, result.output[-3000:]
    assert "Traceback" not in result.output
    # No wall of text (Hydra's list of a group's options, one per indented line, aside).
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("\t")]
    assert len(lines) <= 12, result.stderr
    assert not (run_dir / "checkpoints").exists()


@pytest.mark.parametrize("case", list(COMPOSING))
def test_a_config_hydra_cannot_compose_is_a_clear_error(case, tmp_path) -> None:
    overrides, words, line = COMPOSING[case]
    result = run_app(tmp_path / "run", *_overrides(case, overrides, None))
    _a_clear_error(result, words, tmp_path / "run")
    assert result.returncode == 2  # bad input, as for the app's own checks
    if line is not None:  # Hydra's report first, then app's line
        lines = result.stderr.strip().splitlines()
        assert len(lines) > 1 and lines[-1] == line, result.stderr


@pytest.mark.parametrize("case", list(CHECKS))
def test_bad_input_is_a_user_error_in_one_line(case, trained, tmp_path) -> None:
    overrides, words = CHECKS[case]
    with pytest.raises(UserError) as error:
        run_job(tmp_path / "run", *_overrides(case, overrides, trained))
    assert words in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


# (A UserError of the launch, as "several nodes without an address" is, takes the path of
# "missing checkpoint" through the entry: checked in this process above.)
@pytest.mark.parametrize("case", ["missing checkpoint", "bad interpolation"])
def test_the_cli_prints_a_user_error_in_one_line_and_exits_2(case, trained, tmp_path) -> None:
    overrides, words = CHECKS[case]
    result = run_app(tmp_path / "run", *_overrides(case, overrides, trained))
    _a_clear_error(result, words, tmp_path / "run")
    assert result.returncode == 2


def test_broken_yaml_on_the_search_path_ends_with_apps_line(tmp_path) -> None:
    """Hydra's report (its traceback of the YAML parser included), then app's line naming the
    file, line and column: exit status 2."""
    conf = tmp_path / "myconf"
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "broken.yaml").write_text(
        "_target_: app.models.CNN\nchannels: [8, 16\ndropout: 0.1\n")
    result = run_app(tmp_path / "run", f"hydra.searchpath=[file://{conf}]", "model=broken")
    assert result.returncode == 2, result.output[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) > 1 and lines[-1] == (
        f"{conf}/model/broken.yaml, line 3, column 8: expected ',' or ']', but got ':'"), \
        result.stderr


def test_a_misspelt_swept_key_ends_with_apps_line(tmp_path) -> None:
    """A sweep's jobs are composed after the sweep has begun: still exit 2 and app's line."""
    result = subprocess.run(
        [sys.executable, "-m", "app", "-m", "trainer.max_epoch=1,2",
         f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=REPO, capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == \
        "trainer.max_epoch: did you mean trainer.max_epochs?", result.stderr


def test_a_full_error_is_hydras_alone(tmp_path) -> None:
    """HYDRA_FULL_ERROR=1: Hydra raises instead of reporting; its traceback, and its exit 1."""
    result = run_app(tmp_path / "run", "trainer.max_epoch=3", env={"HYDRA_FULL_ERROR": "1"})
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "did you mean" not in result.stderr, result.stderr
