"""Composition errors Hydra says badly, told in one line (app.compose_errors), in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import OmegaConf

from app.compose_errors import explain
from app.errors import UserError
from app.training.build import build_data, build_model
from conftest import TINY, assert_ok, make_config, run_app

MISSPELT = [
    (["trainer.max_epoch=3"], "trainer.max_epoch: no such key; did you mean trainer.max_epochs?"),
    (["distributed.bakend=gloo"], "did you mean distributed.backend?"),
    (["model.chanels=8"], "model.chanels: no such key; did you mean model.channels?"),
    (["modle.channels=8"], "modle.channels: no such key; did you mean model.channels?"),
    (["data.val_fractoin=0.1"], "did you mean data.val_fraction?"),
    (["callbacks.model_sumary.depth=2"], "did you mean callbacks.model_summary.depth?"),
    # An argument of the target that the config file leaves out: it takes a `+`.
    (["optimizer=adamw", "optimizer.maximise=true"], "did you mean +optimizer.maximize=true?"),
    (["optimizer=adamw", "optimizer.amsgrd=true"], "did you mean +optimizer.amsgrad=true?"),
    # Nothing near: a typed section points to its keys, a `_target_` node to the `+` form.
    (["trainer.zzz=1"], "`python -m app --cfg job --package trainer` prints its keys"),
    (["model.newkey=1"], "to pass a new argument to app.models.CNN, write +model.newkey=1"),
    # A mapping of the user's own keys: a new one takes a `+`.
    (["hydra.sweeper.params.seed='1,2'"], "hydra.sweeper.params.seed: hydra.sweeper.params has "
     "no key seed yet; a new key takes a +: +hydra.sweeper.params.seed='1,2'"),
    (["hydra.sweeper.params={seed:'1,2'}"], "a new key takes a +: "
     "+hydra.sweeper.params={seed:'1,2'}"),
]


def _composition_error(*overrides: str) -> ConfigCompositionException:
    with pytest.raises(ConfigCompositionException) as err:
        make_config(*overrides)
    return err.value


@pytest.mark.parametrize("overrides,words", MISSPELT)
def test_a_misspelt_key_gets_the_nearest_real_key(overrides: list[str], words: str) -> None:
    line = explain(_composition_error(*overrides))
    assert line is not None and words in line, line
    assert "\n" not in line and "To append" not in line


@pytest.mark.parametrize("override,line", [
    ("trainer.max_epochs=many", "trainer.max_epochs=many: expected a whole number"),
    ("trainer.log_every_n_steps=1.5", "trainer.log_every_n_steps=1.5: expected a whole number"),
    ("trainer.ema=maybe", "trainer.ema=maybe: expected true or false"),
    ("seed=null", "seed=null: seed cannot be null; give it a value"),
    ("hydra.job.chdir=maybe", "hydra.job.chdir=maybe: expected true or false"),
])
def test_a_value_of_the_wrong_type_is_one_line(override: str, line: str) -> None:
    assert explain(_composition_error(override)) == line


@pytest.mark.parametrize("override,line", [
    ("model=resnet50", "model=resnet50: no such option; did you mean model=resnet? "
                       "(options: cnn, mlp, resnet, timm, torchvision)"),
    ("trainer=trainvl", "trainer=trainvl: no such option; did you mean trainer=trainval? "
                        "(options: eval, export, predict, trainval)"),
    ("hydra/launcher=submitit_slrm", "hydra/launcher=submitit_slrm: no such option; did you "
     "mean hydra/launcher=submitit_slurm? (options: basic, submitit_local, submitit_slurm)"),
    ("+experiment=nope", "+experiment=nope: no such option (options: digits_long, "
                         "digits_mlp)"),
])
def test_an_unknown_group_option_gets_the_nearest_and_the_list(monkeypatch, override: str,
                                                               line: str) -> None:
    monkeypatch.setattr("sys.argv", ["app", override])  # (the override as typed)
    with pytest.raises(MissingConfigException) as err:
        make_config(override)
    assert explain(err.value) == line


def test_a_file_that_names_an_unknown_option_is_named(tmp_path, monkeypatch) -> None:
    """Hydra says "In 'config'" (the primary config) for an experiment file's override: the
    file the command chose is named, not another one that says the same."""
    (tmp_path / "experiment").mkdir()
    for name in ("old", "other"):
        (tmp_path / "experiment" / f"{name}.yaml").write_text(
            "# @package _global_\ndefaults:\n  - override /model: resnt\n")
    overrides = [f"hydra.searchpath=[file://{tmp_path}]", "+experiment=old"]
    monkeypatch.setattr("sys.argv", ["app", *overrides])
    with pytest.raises(MissingConfigException) as err:
        make_config(*overrides)
    assert explain(err.value) == (
        "experiment/old: model=resnt: no such option; did you mean model=resnet? "
        "(options: cnn, mlp, resnet, timm, torchvision)")


@pytest.mark.parametrize("argv,named,why", [
    (["foo"], "foo: ", "missing EQUAL"),
    (["seed=1", "optimizer.lr=[1"], "optimizer.lr=[1: ", "no viable alternative at input"),
    (["--multirun", "a=b=c"], "a=b=c: ", "mismatched input '='"),
    (["optimizer.lr=ünï"], "optimizer.lr=ünï: ", "'ü' at character 14: a character an "
                                                "unquoted value cannot hold (quote the value"),
    (["optimizer.lr=\"0.1"], "optimizer.lr=\"0.1: ", "'\"' at character 14: an unclosed quote"),
    (["mödel=cnn"], "mödel=cnn: ", "'ö' at character 2: a character a key cannot hold"),
])
def test_an_override_hydra_cannot_parse_is_named(monkeypatch, argv: list[str], named: str,
                                                 why: str) -> None:
    # (Hydra names the override for some errors only: the others are found in the command.)
    monkeypatch.setattr("sys.argv", ["app", *argv])
    with pytest.raises(OverrideParseException) as err:
        make_config(*[a for a in argv if not a.startswith("-")])
    line = explain(err.value)
    assert line.startswith(named) and why in line and "KEY=VALUE" in line, line
    assert "\n" not in line


def test_a_new_argument_with_plus_still_reaches_the_target() -> None:
    cfg = make_config("+model.newkey=1")
    assert cfg.model["newkey"] == 1
    with pytest.raises(UserError, match="newkey"):  # CNN takes no such argument
        build_model(cfg, build_data(cfg))
    assert make_config("optimizer=adamw", "+optimizer.amsgrad=true").optimizer["amsgrad"]


@pytest.mark.parametrize("text,where,words", [
    ("_target_: app.models.CNN\nchannels: [8, 16\ndropout: 0.1\n", "line 3, column 8",
     "expected ',' or ']'"),
    ("a: 1\na: 2\n", "line 2, column 1", "found duplicate key"),
    ("a:\n\tb: 1\n", "line 2, column 1", "'\\t' that cannot start any token"),
])
def test_invalid_yaml_names_file_line_and_column(tmp_path, text: str, where: str,
                                                 words: str) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(yaml.YAMLError) as err, open(path) as f:
        OmegaConf.load(f)  # as Hydra reads a config file
    line = explain(err.value)
    assert line is not None and line.startswith(f"{path}, {where}: ") and words in line, line


def test_the_wrapped_hydra_handler_prints_one_line_unless_full_errors_are_asked_for(
        monkeypatch, capsys) -> None:
    from hydra._internal import utils

    import app.__main__  # noqa: F401 (installs the wrapper, as `python -m app` does)

    def compose() -> None:
        yaml.safe_load("a: [1, 2\nb: 3\n")

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as end:
        utils.run_and_report(compose)
    assert end.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert utils.run_and_report(lambda: 5) == 5  # a job's return value passes through
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # Hydra's own report: the whole traceback
    with pytest.raises(yaml.YAMLError):
        utils.run_and_report(compose)


def test_a_yaml_error_inside_the_job_is_the_jobs_not_a_config_files() -> None:
    # A job's own code that parses YAML (a user's data module, say) fails as the job fails,
    # not as "fix the YAML there" about a config file. The frame of the entry's task
    # function is what tells the two apart: compiled here under its file and name.
    import app

    entry = str(Path(app.__file__).with_name("__main__.py"))
    namespace = {"yaml": yaml}
    exec(compile("def main():\n    yaml.safe_load('a: [1')\n", entry, "exec"), namespace)
    with pytest.raises(yaml.YAMLError) as raised:
        namespace["main"]()
    assert explain(raised.value) is None
    with pytest.raises(yaml.YAMLError) as raised:
        yaml.safe_load("a: [1")
    assert explain(raised.value) is not None  # the same error from composition is explained


@pytest.mark.parametrize("override,line", [
    ("ema=true", "ema was renamed to trainer.ema: write trainer.ema=true"),
    # (A sweep's job is composed with the value as Hydra's sweeper writes it back: True.)
    ("ema=True", "ema was renamed to trainer.ema: write trainer.ema=true"),
    ("trainer.input=x.npy", "trainer.input was renamed to predict.input: write "
                            "predict.input=x.npy"),
    ("trainer.num_show=4", "trainer.num_show was renamed to predict.num_show"),
    ("trainer.export_tolerance=0.1", "trainer.export_tolerance was renamed to export.tolerance"),
])
def test_a_renamed_key_names_its_new_name(override: str, line: str) -> None:
    assert explain(_composition_error(override)).startswith(line)


@pytest.mark.parametrize("override,line", [
    ("precision=16", "precision=16: expected one of 32, bf16-mixed, 16-mixed, bf16-true"),
    ("accelerator=tpu", "accelerator=tpu: expected one of auto, cuda, cpu, mps, npu, xpu, hpu"),
    ("trainer.monitor=val/f1", "trainer.monitor=val/f1: expected one of val/acc, val/loss"),
    ("trainer.monitor_mode=up", "trainer.monitor_mode=up: expected one of max, min"),
    ("distributed.start_method=thread",
     "distributed.start_method=thread: expected one of spawn, forkserver, fork"),
    ("distributed.backend=foo",
     "distributed.backend=foo: expected one of auto, nccl, gloo, mpi, ucc, hccl, xccl"),
])
def test_a_value_outside_a_closed_set_fails_at_compose_in_one_line(override: str,
                                                                   line: str) -> None:
    assert explain(_composition_error(override)) == line


@pytest.mark.parametrize("text,line", [
    ("# @package _global_\nema: true\n", "experiment/old: ema was renamed to trainer.ema"),
    ("# @package _global_\nprecision: fp16\n",
     "experiment/old: precision=fp16: expected one of 32, bf16-mixed, 16-mixed, bf16-true"),
])
def test_a_config_file_with_a_renamed_key_or_a_wrong_choice_is_named(tmp_path, text: str,
                                                                      line: str) -> None:
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "old.yaml").write_text(text)
    error = _composition_error(f"hydra.searchpath=[file://{tmp_path}]", "+experiment=old")
    assert explain(error) == line


def test_hydras_own_job_logging_options_replace_the_apps(tmp_path) -> None:
    """The app's console and train.log are a hydra/job_logging option of their own (conf/hydra/),
    so `hydra/job_logging=disabled` replaces them whole (it was a 30-line ValueError traceback
    about a handler without a class, and exit 0)."""
    result = assert_ok(run_app(tmp_path / "run", "hydra/job_logging=disabled", *TINY,
                               "trainer.max_steps=2"))
    assert "Traceback" not in result.output and "done: step 2" not in result.output, result.output
    assert not (tmp_path / "run" / "train.log").exists()
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("argv,line", [
    (["model=null"], "model=null: model is a config group: give the name of one of its "
                     "options (model=NAME)"),
    (["seed=1", "=3"], "=3: no key before '='; write KEY=VALUE"),
    (["model="], "model=: no option given (options: cnn, mlp, resnet, timm, torchvision)"),
    (["model=cnn,mlp"], "model=cnn,mlp: a comma makes a sweep, which needs --multirun (-m); "
                        "a list is KEY=[A,B], a string with a comma is quoted: KEY='A,B'"),
    (["~trainer.ema"], "~trainer.ema: the keys of trainer cannot be removed (a typed "
                       "section); set it instead: trainer.ema=VALUE"),
    (["~trainer.max_steps"], "~trainer.max_steps: no such key, or its value is null already "
                             "(Hydra removes only keys that hold a value); to change it, write "
                             "trainer.max_steps=VALUE"),
    (["~"], "~: give the key or group to remove (~KEY)"),
])
def test_an_override_hydra_cannot_apply_is_one_line(monkeypatch, argv: list[str],
                                                    line: str) -> None:
    monkeypatch.setattr("sys.argv", ["app", *argv])  # (where the override is found)
    with pytest.raises(Exception) as err:
        make_config(*argv)
    assert explain(err.value) == line


def test_a_misspelt_key_in_a_config_file_names_the_file_and_the_nearest_key(tmp_path) -> None:
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ntrainer:\n  max_stepz: 3\n")
    error = _composition_error(f"hydra.searchpath=[file://{tmp_path}]", "+experiment=mine")
    assert explain(error) == ("experiment/mine: trainer.max_stepz: no such key; did you mean "
                              "trainer.max_steps?")


def test_a_sweep_of_hydras_own_settings_says_to_quote_the_commas() -> None:
    # (Hydra's message, raised as Hydra raises it in --multirun, with the advice added.)
    error = ConfigCompositionException("Sweeping over Hydra's configuration is not supported : "
                                       "'+hydra.sweeper.params.seed=1,2'")
    assert explain(error) == (
        "+hydra.sweeper.params.seed=1,2: Hydra's own settings cannot be swept; if the commas "
        "belong to the value, quote it: +hydra.sweeper.params.seed='1,2'")


@pytest.mark.parametrize("swept, line", [
    ("hydra/launcher=basic,submitit_local", "hydra/launcher=basic,submitit_local: Hydra's own "
     "settings cannot be swept"),  # (a group's choice: quoting it names no option)
    ("hydra.run.dir='a',b", "hydra.run.dir='a',b: Hydra's own settings cannot be swept")])
def test_no_quoting_advice_where_quotes_cannot_help(swept: str, line: str) -> None:
    error = ConfigCompositionException(
        f"Sweeping over Hydra's configuration is not supported : '{swept}'")
    assert explain(error) == line


def test_a_hydra_setting_points_to_the_hydra_configs_keys() -> None:
    line = explain(_composition_error("hydra.launcher.nope=1"))
    assert line is not None and line.endswith(
        "`python -m app --cfg hydra --package hydra.launcher` prints its keys"), line
