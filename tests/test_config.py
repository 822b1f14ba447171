"""Compose the real conf/ tree: every option of every group, and the errors of a bad config."""

from __future__ import annotations

import copy
import dataclasses
import math
import operator

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from app.config import AppConfig, LoaderConfig, Mode, validate
from app.data import DataModule, first_samples
from app.errors import UserError
from app.training.build import build_data, build_model, build_optimizer, build_scheduler
from conftest import CONF_DIR, HELPERS, make_config

GROUPS = {
    group: sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    for group in ("trainer", "model", "data", "optimizer", "scheduler", "distributed",
                  "logger", "debug", "launcher", "hparams_search")
}


def test_every_group_has_options() -> None:
    assert GROUPS["trainer"] == ["eval", "export", "predict", "trainval"]
    assert {"cnn", "mlp"} <= set(GROUPS["model"])
    assert {"digits", "synthetic"} <= set(GROUPS["data"])
    assert {"sgd", "adamw"} <= set(GROUPS["optimizer"])
    assert {"constant", "step", "cosine"} <= set(GROUPS["scheduler"])
    assert {"csv", "tensorboard"} <= set(GROUPS["logger"])


def _inputs(group: str, option: str, tmp_path) -> list[str]:
    """What an option needs besides itself: a folder of images, a data set on disk."""
    if (group, option) not in (("data", "image_folder"), ("data", "hf")):
        return []
    import sys

    sys.path.insert(0, str(HELPERS))
    from images import make_image_folder

    make_image_folder(tmp_path / "images", per_class=3)
    if option == "image_folder":
        return [f"data.root={tmp_path / 'images'}", "model=resnet"]
    return [f"data.path={tmp_path / 'images'}", "data.builder=imagefolder", "model=resnet"]


def _library_missing(group: str, option: str) -> str | None:
    """torchvision and timm are optional (they import only with a CUDA build of torch here)."""
    if group != "model" or option not in ("torchvision", "timm"):
        return None
    try:
        __import__(option)
    except (ImportError, RuntimeError):
        return option
    return None


@pytest.mark.parametrize(
    "group,option", [(g, o) for g, options in GROUPS.items() for o in options])
def test_every_option_composes_and_builds(group: str, option: str, tmp_path) -> None:
    cfg = make_config(f"{group}={option}", "ckpt=some.pt", *_inputs(group, option, tmp_path))
    validate(cfg)
    assert isinstance(cfg, AppConfig)
    data = build_data(cfg)
    missing = _library_missing(group, option)
    if missing:  # the model's config still fails in one line that says why
        with pytest.raises(UserError, match=f"model={missing} needs {missing}"):
            build_model(cfg, data)
        return
    model = build_model(cfg, data)
    x, y = first_samples(data.train, 4)
    assert model(x).shape == (4, data.num_classes)
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer, total_steps=100)
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr()[0] > 0


def test_trainer_modes() -> None:
    assert make_config().trainer.mode == Mode.trainval
    for mode in ("eval", "predict", "export"):
        cfg = make_config(f"trainer={mode}", "ckpt=x.pt")
        assert cfg.trainer.mode == Mode(mode)


def test_digits_split_is_fixed_and_disjoint() -> None:
    a, b = build_data(make_config()), build_data(make_config("seed=7"))
    assert len(a.train) + len(a.val) == 1797
    assert torch.equal(a.val.tensors[0], b.val.tensors[0])  # the run seed leaves it alone
    train_rows = {tuple(r.flatten().tolist()) for r in a.train.tensors[0]}
    overlap = sum(tuple(r.flatten().tolist()) in train_rows for r in a.val.tensors[0])
    assert overlap < 5  # the data set has a few duplicate images, no shared rows otherwise
    c = build_data(make_config("data.split_seed=1"))
    assert not torch.equal(a.val.tensors[1], c.val.tensors[1])


def test_misspelt_key_fails_at_compose() -> None:
    with pytest.raises(ConfigCompositionException) as err:
        make_config("trainer.max_epoch=3")
    assert "max_epoch" in str(err.value.__cause__ or err.value)


def test_wrong_type_fails_at_compose() -> None:
    with pytest.raises((ConfigCompositionException, ValidationError)):
        make_config("trainer.max_epochs=many")


@pytest.mark.parametrize("override", ["trainer.monitor_mode=up", "logger.wandb_mode=bogus"])
def test_wrong_enum_fails_at_compose(override: str) -> None:
    with pytest.raises((ConfigCompositionException, ValidationError, ConfigKeyError)):
        make_config(override)


@pytest.mark.parametrize("overrides,words", [
    (["trainer.max_epochs=null"], "max_steps"),
    (["trainer.max_steps=-5"], "trainer.max_steps=-5: expected null or a whole number >= 1"),
    (["trainer.ema_decay=1"], "trainer.ema_decay=1.0: expected a number > 0 and < 1"),
    (["occupy=1.5"], "occupy=1.5: expected a number >= 0 and < 1"),
    (["optimizer.lr=-0.1"], "optimizer.lr=-0.1"),
    (["optimizer.lr=0"], "optimizer.lr=0"),
    (["devices=0"], "devices=0"),
    (["trainer=eval"], "ckpt=PATH"),
    (["trainer.keep_last=-1"], "trainer.keep_last=-1: expected a whole number >= 0"),
    (["devices=many"], "devices=many"),
    (["nodes=2", "machine_rank=2", "dist_url=tcp://h:1"], "machine_rank=2"),
    (["dist_url=localhost"], "dist_url=localhost"),
    (["seed=9223372036854775807"], "seed=9223372036854775807: a seed is a whole number from 0 "
                                   "to 4294967295"),
    (["seed=4294967296"], "seed=4294967296"),
    (["seed=-1"], "seed=-1"),
    # (an OverflowError in a rank, exit 1: timedelta and gloo count seconds in 64 bits)
    (["distributed.timeout_s=1e300"], "distributed.timeout_s=1e+300: expected a finite number "
                                      "> 0 and <= 1000000000"),
])
def test_validate_names_the_key(overrides: list[str], words: str) -> None:
    with pytest.raises(UserError) as err:
        validate(make_config(*overrides))
    assert words in str(err.value)


def _bounded_fields(node, schema, path=""):
    """(key, field) of every field of `node` that declares a bound (`_bound`)."""
    for f in dataclasses.fields(schema):
        value = node.get(f.name) if isinstance(node, dict) else getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _bounded_fields(value, type(value), f"{path}{f.name}.")
        elif "bounds" in f.metadata:
            yield path + f.name, f


def _edges(whole: bool, bounds: dict[str, float]) -> tuple[list, list]:
    """Values just outside each bound (and nan, or a plain value of another type), and just
    inside it: the next whole number or float."""
    def step(n, direction):
        return n + direction if whole else math.nextafter(n, direction * math.inf)

    outside, inside = ([1.5, True] if whole else [math.nan]), []
    for op, n in bounds.items():
        outside.append({"ge": step(n, -1), "le": step(n, 1)}.get(op, n))
        inside.append({"ge": n, "gt": step(n, 1), "lt": step(n, -1), "le": n}[op])
    # (just inside one bound, within the others: `< inf` and `<= 1e9` together)
    within = {"ge": operator.ge, "gt": operator.gt, "lt": operator.lt, "le": operator.le}
    return outside, [v for v in inside if all(within[op](v, n) for op, n in bounds.items())]


def _with(cfg: AppConfig, key: str, value) -> AppConfig:
    cfg = node = copy.deepcopy(cfg)
    *path, name = key.split(".")
    for part in path:
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    if isinstance(node, dict):
        node[name] = value
    else:
        setattr(node, name, value)
    return cfg


def test_every_declared_bound_is_enforced_just_outside_and_not_just_inside() -> None:
    base = make_config()
    fields = [*_bounded_fields(base, AppConfig), *_bounded_fields(base.data, LoaderConfig, "data.")]
    keys = {key for key, _ in fields}
    assert {"trainer.max_steps", "trainer.ema_decay", "distributed.timeout_s", "occupy",
            "data.batch_size", "data.num_workers", "export.tolerance"} <= keys, keys
    for key, f in fields:
        whole = f.type.startswith("int")
        outside, inside = _edges(whole, f.metadata["bounds"])
        if whole and not key.startswith("data."):  # (OmegaConf types the typed sections)
            outside = [v for v in outside if type(v) is int]
        for value in inside:
            validate(_with(base, key, value))
        for value in outside:
            with pytest.raises(UserError) as err:
                validate(_with(base, key, value))
            assert str(err.value).startswith(f"{key}={value}: expected "), (key, value)


@pytest.mark.parametrize("overrides,words", [
    (["data.val_fraction=1.5"], "data.val_fraction=1.5"),
    (["data.batch_size=0"], "data.batch_size=0"),
    (["model.dropout=1.5"], "model.dropout=1.5"),
    (["model.channels=[8,8,8,8]"], "model.channels"),
    (["data.val_fraction=0.0001"], "data.val_fraction=0.0001 of 1797 samples leaves no sample "
                                   "for validation; the minimum is 0.00056"),
    (["data.val_fraction=0.9999"], "no sample for training"),
    (["data=synthetic", "data.num_samples=4", "data.val_fraction=0.1"], "the minimum is 0.25"),
    (["data._target_=nosuch_pkg.mod.Data"], "data (nosuch_pkg.mod.Data): no module named "
                                            "'nosuch_pkg': Python finds your own module in"),
])
def test_bad_object_settings_name_the_key(overrides: list[str], words: str) -> None:
    cfg = make_config(*overrides)
    with pytest.raises(UserError) as err:
        build_model(cfg, build_data(cfg))
    assert words in str(err.value)


class NoSuper(DataModule):
    def __init__(self, **loader) -> None:  # forgets super().__init__(**loader)
        self.train = self.val = [(torch.zeros(1), 0)]
        self.input_shape, self.num_classes = (1,), 2


class NoShape(DataModule):
    def __init__(self, val_fraction=0.2, split_seed=0, shift=0, **loader) -> None:  # (digits')
        super().__init__(**loader)
        self.train = self.val = [(torch.zeros(1), 0)]


def test_a_data_module_of_your_own_missing_a_part_is_named() -> None:
    """Before: AttributeError tracebacks ('NoSuper' object has no attribute 'cache')."""
    with pytest.raises(UserError, match=r"data \(test_config.NoSuper\): its __init__ must call "
                                        r"super\(\).__init__\(\*\*loader\)"):
        build_data(make_config("data._target_=test_config.NoSuper"))
    with pytest.raises(UserError, match=r"data \(test_config.NoShape\): sets no input_shape, "
                                        r"num_classes \(a DataModule sets"):
        build_data(make_config("data._target_=test_config.NoShape"))


def test_an_empty_validation_split_of_any_data_module_fails_at_build(monkeypatch) -> None:
    from app.data import digits

    # A data module whose own split gives no validation samples (here: a split made empty).
    monkeypatch.setattr(digits, "split", lambda num, fraction, seed: (
        torch.arange(num), torch.arange(0)))
    with pytest.raises(UserError, match="validation split is empty"):
        build_data(make_config())


@pytest.mark.parametrize("overrides", [["data.split_seed=18446744073709551616"],
                                       ["data=synthetic", "data.data_seed=-1"]])
def test_data_seeds_are_bounded_like_the_run_seed(overrides: list[str]) -> None:
    with pytest.raises(UserError, match="a seed is a whole number from 0 to 4294967295"):
        build_data(make_config(*overrides))


def test_the_largest_seed_trains(tmp_path) -> None:
    """Every seed the check lets through survives the arithmetic the loop and the data sets
    do with it (per-epoch and per-sample seeds)."""
    from app.training.loop import train

    cfg = make_config("seed=4294967295", "data.shift=1", "model.channels=[4]",
                      "trainer.max_epochs=null", "trainer.max_steps=2",
                      "trainer.val_every_n_epochs=null", "trainer.ckpt_every_n_epochs=null",
                      "trainer.progress_bar=false", "trainer.async_checkpoint=false",
                      "callbacks=none")
    validate(cfg)
    train(cfg, tmp_path, torch.device("cpu"))
    assert (tmp_path / "checkpoints" / "last.pt").is_file()


def test_mode_only_keys_sit_in_their_modes_nodes_and_ema_under_trainer() -> None:
    cfg = make_config("trainer=predict", "ckpt=x.pt", "predict.input=a.npy",
                      "predict.num_show=4", "export.tolerance=0.5", "trainer.ema=true")
    assert (cfg.predict.input, cfg.predict.num_show, cfg.export.tolerance) == ("a.npy", 4, 0.5)
    assert cfg.trainer.ema and not hasattr(cfg.trainer, "input") and not hasattr(cfg, "ema")
    with pytest.raises(UserError, match="predict.num_show=0"):
        validate(make_config("predict.num_show=0"))


@pytest.mark.parametrize("override,line", [
    ("+trainer.input=a.npy", "trainer.input was renamed to predict.input"),
    ("+ema=true", "ema was renamed to trainer.ema"),
])
def test_a_renamed_key_added_with_plus_names_its_new_name(override: str, line: str) -> None:
    from hydra import compose, initialize_config_dir

    from app.config import register_schemas, to_app_config

    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose("config", overrides=[override])
    with pytest.raises(UserError) as err:
        to_app_config(composed)
    assert str(err.value) == line


def test_closed_sets_take_their_strings_and_compare_as_strings() -> None:
    cfg = make_config("precision=32", "accelerator=cpu", "trainer.monitor=val/loss",
                      "distributed.start_method=spawn")
    assert cfg.precision == "32" and f"{cfg.precision}" == "32"  # the int 32 of the override
    assert (cfg.accelerator, cfg.trainer.monitor) == ("cpu", "val/loss")
    assert {"spawn": 1}[cfg.distributed.start_method] == 1  # hashes as its string
    assert make_config("precision=bf16-mixed").precision == "bf16-mixed"


@pytest.mark.parametrize("overrides", [["hydra/launcher=submitit_slurm"],
                                       ["hydra/launcher=submitit_local"], ["launcher=slurm"]])
def test_launcher_options_compose_without_a_warning_and_run_apps_launcher(
        overrides: list[str]) -> None:
    import warnings

    from hydra import compose, initialize_config_dir

    from app.config import register_schemas
    from app.resolvers import register_resolvers

    register_schemas()
    register_resolvers()
    with warnings.catch_warnings(record=True) as seen, initialize_config_dir(
            config_dir=str(CONF_DIR), version_base="1.3"):
        warnings.simplefilter("always")  # whatever filters the process has set
        cfg = compose("config", overrides=[*overrides, "devices=2", "nodes=1"],
                      return_hydra_config=True)
    assert [str(w.message) for w in seen] == []
    launcher = cfg.hydra.launcher
    assert launcher._target_.startswith("hydra_plugins.app_submitit.launcher.App")
    assert launcher.tasks_per_node == (2 if "local" not in overrides[0] else 1)
    assert launcher.gpus_per_node is None  # accelerator=auto: no GPUs asked for
    with pytest.raises(ConfigCompositionException), initialize_config_dir(
            config_dir=str(CONF_DIR), version_base="1.3"):
        compose("config", overrides=[*overrides, "hydra.launcher.timeout_mn=5"],
                return_hydra_config=True)  # a misspelt launcher key fails (typed node)


def test_a_missing_optional_logger_fails_before_any_worker_starts(monkeypatch) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else find_spec(name, *a))
    validate(make_config("logger=csv"))
    with pytest.raises(UserError, match="logger.mlflow=true needs MLflow: pip install"):
        validate(make_config("logger=mlflow"))


def test_apps_launcher_wins_whatever_order_hydra_scans_the_plugins_in() -> None:
    """Hydra's plugin scan executes the stock plugin's module (which stores its nodes) after
    ours or before, depending on the install; ours are stored after the scan."""
    import importlib

    from hydra import compose, initialize_config_dir
    from hydra_plugins.hydra_submitit_launcher import config as stock

    from app.config import register_schemas

    register_schemas()
    importlib.reload(stock)  # the stock nodes stored last, as a scan in that order leaves them
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=submitit_local"],
                      return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("AppLocalLauncher")
