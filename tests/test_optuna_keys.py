"""An Optuna search of a key the model has not got (`hparams_search=digits_optuna`, written for
app's CNN, run on a model of the user's own) stops before the study and before any job: Hydra's
report, then app's line naming the fix, exit status 2, no study file left in the sweep
directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import multirun

pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")  # (an extra; make install has it)

HYDRAS = "Could not override 'model.channels'."


def _own_model(tmp_path: Path) -> str:
    """A model config of the user's own, on a search path: an MLP's keys, not `channels`."""
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "mine.yaml").write_text(
        "_target_: app.models.MLP\nhidden: [16]\ndropout: 0.0\n")
    return f"hydra.searchpath=[file://{tmp_path / 'conf'}]"


@pytest.mark.parametrize("overrides, line, report", [
    (["model=mine"], "hparams_search=digits_optuna searches model.channels, which model=mine "
     "has not got (it has hidden, dropout): search its keys in an hparams_search file of your "
     "own (docs/sweeps.md#search-your-own-model)", HYDRAS),
    # A searched group: the option whose trial would fail.
    (["model=choice(mlp,cnn)"], "hparams_search=digits_optuna searches model.channels, which "
     "model=mlp has not got (it has hidden, dropout): search its keys", HYDRAS),
    # A search of the command line's: named as typed.
    (["model.width=interval(8,64)"], "`model.width=interval(8,64)` searches model.width, "
     "which model=cnn has not got (it has channels, dropout, batch_norm)",
     "Could not override 'model.width'."),
], ids=["own-model", "searched-group", "command-line"])
def test_a_searched_key_the_model_has_not_got_stops_before_any_trial(
        tmp_path: Path, overrides: list[str], line: str, report: str) -> None:
    proc, jobs = multirun(tmp_path, "hparams_search=digits_optuna", _own_model(tmp_path),
                          *overrides, "hydra.sweeper.n_trials=2", "trainer.max_epochs=1")
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, said[-3000:]
    assert report in proc.stderr, said[-3000:]  # Hydra's words, as they were
    after = proc.stderr[proc.stderr.index(report):].splitlines()
    assert any(shown.startswith(line) for shown in after), said[-3000:]
    assert jobs == [] and "Launching" not in said  # no trial ran
    sweep = tmp_path / "sweep"
    assert not (sweep / "optuna_study.pkl").exists()
    assert not (sweep / "0").exists()
