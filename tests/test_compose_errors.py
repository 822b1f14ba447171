"""What app adds to Hydra's report of a config it cannot compose (app.compose_errors), in
this process: the exception as Hydra's compose API raises it, and the line added to it. The
command line's side (Hydra's report, the line after it, exit status 2): test_errors.py."""

from __future__ import annotations

import json

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException

from app.compose_errors import addition, after_hydras_report, compose_error
from app.errors import UserError
from app.training.build import build_data, build_model
from conftest import TINY, assert_ok, make_config, run_app


def _added(*overrides: str) -> str | None:
    error = compose_error(list(overrides))
    assert error is not None, f"{overrides} composes"
    return addition(error, list(overrides))


@pytest.mark.parametrize("overrides,line", [
    (["trainer.max_epoch=3"], "trainer.max_epoch: did you mean trainer.max_epochs?"),
    (["distributed.bakend=gloo"], "distributed.bakend: did you mean distributed.backend?"),
    (["model.chanels=8"], "model.chanels: did you mean model.channels?"),
    (["modle.channels=8"], "modle.channels: did you mean model.channels?"),
    (["data.val_fractoin=0.1"], "data.val_fractoin: did you mean data.val_fraction?"),
    (["callbacks.model_sumary.depth=2"], "callbacks.model_sumary.depth: did you mean "
                                         "callbacks.model_summary.depth?"),
    (["hydra.job.chdirr=true"], "hydra.job.chdirr: did you mean hydra.job.chdir?"),
    # An argument of the target that the config file leaves out: it takes a `+`.
    (["optimizer=adamw", "optimizer.maximise=true"], "optimizer.maximise: did you mean "
     "+optimizer.maximize=true? (torch.optim.AdamW takes maximize; the config does not set "
     "it, so it takes a +)"),
    (["optimizer=adamw", "optimizer.amsgrd=true"], "optimizer.amsgrd: did you mean "
     "+optimizer.amsgrad=true? (torch.optim.AdamW takes amsgrad; the config does not set it, "
     "so it takes a +)"),
])
def test_a_misspelt_key_gets_the_nearest_real_key(overrides: list[str], line: str) -> None:
    assert _added(*overrides) == line


@pytest.mark.parametrize("override,line", [
    ("ema=true", "ema was renamed to trainer.ema: write trainer.ema=true"),
    # (A sweep's job is composed with the value as Hydra's sweeper writes it back: True.)
    ("ema=True", "ema was renamed to trainer.ema: write trainer.ema=true"),
    ("trainer.input=x.npy", "trainer.input was renamed to predict.input: write "
                            "predict.input=x.npy"),
    ("trainer.export_tolerance=0.1", "trainer.export_tolerance was renamed to export.tolerance: "
                                     "write export.tolerance=0.1"),
])
def test_a_renamed_key_gets_its_new_name(override: str, line: str) -> None:
    assert _added(override) == line


@pytest.mark.parametrize("overrides,line", [
    (["model=resnet50"], "model=resnet50: did you mean model=resnet?"),
    (["trainer=trainvl"], "trainer=trainvl: did you mean trainer=trainval?"),
    (["hydra/launcher=submitit_slrm"], "hydra/launcher=submitit_slrm: did you mean "
                                       "hydra/launcher=submitit_slurm?"),
    (["+experiment=digits_mlpp"], "+experiment=digits_mlpp: did you mean "
                                  "+experiment=digits_mlp?"),
])
def test_an_unknown_group_option_gets_the_nearest(overrides: list[str], line: str) -> None:
    error = compose_error(overrides)
    assert isinstance(error, MissingConfigException)
    assert addition(error, overrides) == line


@pytest.mark.parametrize("overrides", [
    ["trainer.zzz=1"],  # nothing near: Hydra's report says how to add a key
    ["data.newkey=1"],  # (a data set takes the loader's keys as **kwargs: it may take it)
    ["+experiment=nope", "hydra.searchpath=[file:///]"],  # Hydra lists where it looked
    ["trainer.max_epochs=many"],  # a wrong type, a value outside a closed set: Hydra says it
    ["precision=16"],
    ["trainer.monitor_mode=up"],
    ["model=cnn,mlp"],  # a sweep without --multirun
    ["~trainer.ema"],
    ["data.batch_size"],  # not an override
    ["hydra.sweeper.params.seed='1,2'"],
])
def test_where_hydras_report_says_it_all_nothing_is_added(overrides: list[str]) -> None:
    assert _added(*overrides) is None


def test_an_option_of_your_own_an_unknown_argument_and_a_tilde_say_what_to_write() -> None:
    """A new user's first `data=mydata` (no hydra.searchpath), `data.root=~/photos` (bash
    expands a ~ only at a word's start): Hydra's report alone did not say what to do."""
    assert _added("data=mydata") == (
        "data=mydata: an option of your own is a file data/mydata.yaml in a folder of yours, "
        "given as hydra.searchpath=[file://FOLDER] (docs/quickstart.md)")
    # A key no constructor argument is near: Hydra's report says to add it with a +, which the
    # constructor would then refuse.
    line = _added("optimizer.learning_rate=0.01")  # (AdamW's arguments: by torch version)
    assert line.startswith("optimizer.learning_rate: torch.optim.AdamW takes no learning_rate "
                           "(it takes amsgrad, betas, ")
    assert ", lr, " in line and line.endswith(", weight_decay)")
    assert _added("data=image_folder", "data.root=~/photos") == \
        "data.root=~/photos: the shell leaves a ~ after = as it is; write data.root=$HOME/photos"


def test_a_config_files_misspelt_key_renamed_key_and_unknown_option(tmp_path) -> None:
    (tmp_path / "experiment").mkdir()
    for name, text in [("key", "trainer:\n  max_stepz: 3\n"), ("moved", "ema: true\n"),
                       ("option", "defaults:\n  - override /model: resnt\n")]:
        (tmp_path / "experiment" / f"{name}.yaml").write_text(f"# @package _global_\n{text}")
    path = f"hydra.searchpath=[file://{tmp_path}]"
    assert _added(path, "+experiment=key") == "trainer.max_stepz: did you mean trainer.max_steps?"
    assert _added(path, "+experiment=moved") == "ema was renamed to trainer.ema"
    assert _added(path, "+experiment=option") == "model=resnt: did you mean model=resnet?"


@pytest.mark.parametrize("searchpath,line", [
    # Hydra's override grammar refuses a ~ (a parse error, naming no fix).
    ("[~/x]", 'Hydra does not expand ~; write "hydra.searchpath=[file://$HOME/x]"'),
    ("[file://~/x]", 'Hydra does not expand ~; write "hydra.searchpath=[file://$HOME/x]"'),
    ("~/x", 'Hydra does not expand ~; write "hydra.searchpath=[file://$HOME/x]"'),
    # Quoted, Hydra takes ~ as the name of a folder, which is not there: "Could not find".
    ('["~/x"]', 'Hydra does not expand ~; write "hydra.searchpath=[file://$HOME/x]"'),
    # "hydra.searchpath must be a list of strings. Got: file://conf"
    ("file://conf", 'Hydra takes a list, in brackets; write "hydra.searchpath=[file://conf]"'),
    ("/abs/conf", 'Hydra takes a list, in brackets; write "hydra.searchpath=[file:///abs/conf]"'),
    ("[file:///nowhere]", "the folder /nowhere does not exist"),
    ("[/nowhere,pkg://app]", "the folder /nowhere does not exist"),
    # In '...', the shell leaves $HOME as it is: a folder of that name, not there.
    ("[file://$HOME/x]", "the folder $HOME/x does not exist (the shell leaves a $ in '...' as "
                         'it is: quote with "...")'),
])
def test_a_searchpath_hydra_refuses_or_finds_nothing_in_says_what_to_write(
        searchpath: str, line: str) -> None:
    typed = f"hydra.searchpath={searchpath}"
    assert _added(typed, "model=mine") == f"{typed}: {line}"


def test_a_searchpath_relative_absent_or_one_level_off_names_the_folder(tmp_path,
                                                                        monkeypatch) -> None:
    (tmp_path / "proj" / "conf" / "model").mkdir(parents=True)
    (tmp_path / "proj" / "conf" / "model" / "mine.yaml").write_text("_target_: app.models.MLP\n")
    monkeypatch.chdir(tmp_path)
    # Hydra 1.3 reads a folder without file://, relative to the folder the command runs in.
    for folder in ("proj/conf", "file://proj/conf", str(tmp_path / "proj" / "conf")):
        assert compose_error([f"hydra.searchpath=[{folder}]", "model=mine"]) is None
    assert _added("hydra.searchpath=[file://conf]", "model=mine") == (
        f"hydra.searchpath=[file://conf]: the folder conf does not exist in {tmp_path}, the "
        f"folder the command runs in")
    for folder in ("file://proj", "proj/conf/model"):
        assert _added(f"hydra.searchpath=[{folder}]", "model=mine") == (
            f"hydra.searchpath=[{folder}]: model/mine.yaml is not in {folder.split('//')[-1]} "
            f'but in proj/conf; write "hydra.searchpath=[file://proj/conf]"')
    # A misspelt option of app's own, the folder being right: the nearest option.
    assert _added("hydra.searchpath=[file://proj/conf]", "model=resnt") == \
        "model=resnt: did you mean model=resnet?"


@pytest.mark.parametrize("text,where,words", [
    ("_target_: app.models.CNN\nchannels: [8, 16\ndropout: 0.1\n", "line 3, column 8",
     "expected ',' or ']', but got ':'"),
    ("a: 1\na: 2\n", "line 2, column 1", "found duplicate key a"),
    ("a:\n\tb: 1\n", "line 2, column 1", "found character '\\t' that cannot start any token"),
])
def test_invalid_yaml_names_file_line_and_column(tmp_path, text: str, where: str,
                                                 words: str) -> None:
    (tmp_path / "model").mkdir()
    path = tmp_path / "model" / "broken.yaml"
    path.write_text(text)
    assert _added(f"hydra.searchpath=[file://{tmp_path}]", "model=broken") == \
        f"{path}, {where}: {words}"


def test_a_group_option_that_is_a_list_names_its_file(tmp_path) -> None:
    """A user's option file whose top level is a list: with a key set under it, Hydra printed
    OmegaConf's 27-line traceback (exit 1), naming neither the file nor the key. Now the typed
    node refuses it in composition: Hydra's short report, then app's line naming the file."""
    (tmp_path / "model").mkdir()
    path = tmp_path / "model" / "bad.yaml"
    path.write_text("- 1\n- 2\n")
    search = f"hydra.searchpath=[file://{tmp_path}]"
    line = (f"{path}: model=bad is a list at its top level; a config group option must be a "
            "mapping (`key: value` lines)")
    for keys in ([], ["model.x=1"], ["+model.x=1"], ["model.x.y=1"], ["~model.x"]):
        assert _added(search, "model=bad", *keys) == line
    proc = run_app(tmp_path / "run", search, "model=bad", "model.x=1")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.endswith(line + "\n"), proc.stderr
    assert len(proc.stderr.splitlines()) <= 8, proc.stderr


def test_a_sweep_is_composed_one_value_at_a_time() -> None:
    assert compose_error(["optimizer.lr=0.1,0.2", "model=cnn,mlp"], multirun=True) is None
    error = compose_error(["optimizer.lr=0.1,0.2", "model=cnn,resnt"], multirun=True)
    assert isinstance(error, MissingConfigException)
    assert addition(error, ["model=cnn,resnt"]) == "model=resnt: did you mean model=resnet?"
    # Not a sweep without --multirun; and Hydra refuses a sweep of its own settings in one.
    assert isinstance(compose_error(["model=cnn,mlp"]), ConfigCompositionException)
    assert compose_error(["+hydra.sweeper.params.seed=1,2"], multirun=True) is not None


@pytest.mark.parametrize("argv,status,err", [
    (["--cfg", "job", "-p", "trainer", "trainer.max_epoch=3"], 2,
     "trainer.max_epoch: did you mean trainer.max_epochs?\n"),
    (["-m", "optimizer.lr=0.1,0.2", "model=cnn,resnt"], 2,
     "model=resnt: did you mean model=resnet?\n"),
    (["--multirun", "trainer.max_epoch=3,4"], 2,
     "trainer.max_epoch: did you mean trainer.max_epochs?\n"),
    (["trainer.monitor_mode=up"], 2, ""),  # bad input, and Hydra's report says it all
    (["hydra.searchpath=[~/x]", "model=mine"], 2,
     'hydra.searchpath=[~/x]: Hydra does not expand ~; write "hydra.searchpath=[file://$HOME/x]"'
     '\n'),
    (["-cn", "nope"], 1, ""),  # another primary config: Hydra's report alone
    (["trainer.max_epochs=3"], 1, ""),  # it composes: what failed was not the config
    (["-sc", "query=bash"], 1, ""),  # tab completion's arguments, not overrides
])
def test_after_hydras_report_the_line_and_the_exit_status(capsys, argv: list[str], status: int,
                                                          err: str) -> None:
    assert after_hydras_report(argv) == status
    assert capsys.readouterr().err == err


def test_a_new_argument_with_plus_still_reaches_the_target() -> None:
    cfg = make_config("+model.newkey=1")
    assert cfg.model["newkey"] == 1
    with pytest.raises(UserError, match="newkey"):  # CNN takes no such argument
        build_model(cfg, build_data(cfg))
    assert make_config("optimizer=adamw", "+optimizer.amsgrad=true").optimizer["amsgrad"]


def test_hydras_own_job_logging_options_replace_the_apps(tmp_path) -> None:
    """The app's console and train.log are a hydra/job_logging option of their own (conf/hydra/),
    so `hydra/job_logging=disabled` replaces them whole (it was a 30-line ValueError traceback
    about a handler without a class, and exit 0)."""
    result = assert_ok(run_app(tmp_path / "run", "hydra/job_logging=disabled", *TINY,
                               "trainer.max_steps=2"))
    assert "Traceback" not in result.output and "done: step 2" not in result.output, result.output
    assert not (tmp_path / "run" / "train.log").exists()
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "completed"
