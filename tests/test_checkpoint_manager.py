"""The checkpoint manager in-process: the layout it writes (with its format version), the check
of a loaded file, and each kind of restore (resume, fine-tune, inference weights), on a tiny
linear model without a training run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from app.callbacks import Callbacks
from app.checkpoint import layout, restore
from app.checkpoint.layout import FORMAT_VERSION, TrainedAt
from app.checkpoint.manager import CheckpointManager
from app.checkpoint.rng import RandomStates
from app.checkpoint.sharded import OptimizerState, Weights
from app.data import DataModule
from app.errors import UserError
from app.training.ema import ModelEMA
from app.training.state import LoopState
from app.training.step import TrainStep
from conftest import make_config

LAYOUT = ["format", "model", "optimizer", "scheduler", "train_step", "loop", "callbacks", "data",
          "best", "is_best", "metrics", "rng", "config", "trackers", "param_names"]


class _Data(DataModule):
    """What a data set learnt from its training set (an image folder's normalisation, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.learnt = {"mean": [0.5]}

    def state_dict(self) -> dict:
        return dict(self.learnt)

    def load_state_dict(self, state: dict) -> None:
        self.learnt = dict(state)


def _parts(run_dir, cfg, ema: bool = False, seed: int = 0
           ) -> tuple[CheckpointManager, TrainStep, LoopState]:
    """The parts the training loop gives the manager, by the names of their entries."""
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    step = TrainStep(model, model, optimizer, scheduler, torch.device("cpu"), "32", None,
                     ModelEMA(model, 0.9, 1) if ema else None)
    loop = LoopState()
    parts = {"model": Weights(model), "optimizer": OptimizerState(model, optimizer),
             "scheduler": scheduler, "train_step": step, "loop": loop,
             "callbacks": Callbacks({}), "data": _Data(), "rng": RandomStates()}
    return CheckpointManager(run_dir / "checkpoints", cfg, parts), step, loop


def _config(*overrides: str):
    return make_config("trainer.async_checkpoint=false", *overrides)


def _train_a_step(step: TrainStep) -> None:
    step([(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))])


def _saved(tmp_path, ema: bool = False) -> tuple[dict, TrainStep]:
    checkpoints, step, loop = _parts(tmp_path, _config(), ema=ema)
    _train_a_step(step)
    loop.step, loop.epoch, loop.batch_in_epoch, loop.best = 7, 2, 1, 0.25
    checkpoints.save({"loss": 1.0, "acc": 0.25}, is_best=True, last=True)
    return torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True), step


def test_a_save_writes_the_layout_with_its_format_version(tmp_path) -> None:
    state, _ = _saved(tmp_path)
    assert sorted(state) == sorted(LAYOUT)
    assert state["format"] == FORMAT_VERSION
    assert state["loop"] == {"step": 7, "epoch": 2, "batch": 1, "stopped_early": None,
                             "global_batch": None, "steps_per_epoch": None}
    assert (state["best"], state["is_best"]) == (0.25, True)
    assert (tmp_path / "checkpoints" / "best.pt").is_file()
    assert (tmp_path / "checkpoints" / "step-00000007.pt").is_file()


def test_a_resume_restores_the_loop_and_every_part(tmp_path) -> None:
    state, trained = _saved(tmp_path)
    checkpoints, step, loop = _parts(tmp_path, _config("resume=auto"), seed=1)
    checkpoints.states["data"].learnt = {}
    checkpoints.restore()
    assert checkpoints.resumed_from == tmp_path / "checkpoints" / "last.pt"
    assert checkpoints.states["data"].learnt == {"mean": [0.5]}
    assert (loop.step, loop.epoch, loop.batch_in_epoch, loop.best) == (7, 2, 1, 0.25)
    assert torch.equal(step.model.weight, trained.model.weight)
    assert step.optimizer.state_dict()["state"].keys() == state["optimizer"]["state"].keys()
    assert step.scheduler.state_dict() == trained.scheduler.state_dict()


@pytest.mark.parametrize("key", ["optimizer", "loop", "rng"])
def test_a_file_missing_a_key_fails_in_one_line_naming_it(tmp_path, key) -> None:
    state, _ = _saved(tmp_path)
    del state[key]
    path = tmp_path / "damaged.pt"
    torch.save(state, path)
    with pytest.raises(UserError, match=f"no '{key}' entry") as err:
        layout.load(path, resume=True)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_a_file_without_a_format_version_has_the_current_layout(tmp_path) -> None:
    state, trained = _saved(tmp_path)
    del state["format"]  # as every checkpoint written before the version was stored
    path = tmp_path / "old.pt"
    torch.save(state, path)
    layout.load(path, resume=True)
    checkpoints, step, loop = _parts(tmp_path, _config(f"resume={path}"), seed=1)
    checkpoints.restore()
    assert loop.step == 7 and torch.equal(step.model.weight, trained.model.weight)


def test_the_optimizer_is_saved_numbered_as_every_earlier_version_saved_it(tmp_path) -> None:
    """The parts give their states by name (the optimizer's through torch's
    get_optimizer_state_dict); a file keeps the layout of format 1: `Optimizer.state_dict()`'s
    numbered state and the names in its order, so the files of earlier versions still load."""
    state, trained = _saved(tmp_path)
    numbered = trained.optimizer.state_dict()
    assert state["optimizer"]["param_groups"] == numbered["param_groups"]
    assert state["optimizer"]["state"].keys() == numbered["state"].keys() == {0, 1}
    assert torch.equal(state["optimizer"]["state"][0]["momentum_buffer"],
                       numbered["state"][0]["momentum_buffer"])
    assert state["param_names"] == ["weight", "bias"]


def test_a_file_of_the_oldest_layout_resumes(tmp_path) -> None:
    """A file written before checkpoints carried a format, the data's and the train step's
    states, the callbacks', the trackers and the parameters' names: every part resumes."""
    state, trained = _saved(tmp_path)
    for key in ("format", "data", "train_step", "callbacks", "trackers", "param_names"):
        del state[key]
    path = tmp_path / "oldest.pt"
    torch.save(state, path)
    checkpoints, step, loop = _parts(tmp_path, _config(f"resume={path}"), ema=True, seed=1)
    checkpoints.restore()
    assert (loop.step, loop.epoch, loop.batch_in_epoch, loop.best) == (7, 2, 1, 0.25)
    assert torch.equal(step.model.weight, trained.model.weight)
    assert torch.equal(step.ema.module.weight, trained.model.weight)  # (it had no EMA)
    momentum = step.optimizer.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(momentum, state["optimizer"]["state"][0]["momentum_buffer"])
    assert step.scheduler.state_dict() == trained.scheduler.state_dict()


def test_a_part_whose_state_does_not_fit_is_one_line_naming_it(tmp_path) -> None:
    state, _ = _saved(tmp_path)
    groups = state["optimizer"]["param_groups"]
    groups.append({**groups[0], "params": []})  # (another parameter group)
    path = tmp_path / "other.pt"
    torch.save(state, path)
    checkpoints, _, _ = _parts(tmp_path, _config(f"resume={path}"))
    with pytest.raises(UserError, match="its optimizer state does not fit this run .*"
                                        "parameter groups.*ckpt=") as err:
        checkpoints.restore()
    assert "\n" not in str(err.value)


def test_a_newer_format_is_refused_naming_it(tmp_path) -> None:
    state, _ = _saved(tmp_path)
    state["format"] = FORMAT_VERSION + 1
    path = tmp_path / "newer.pt"
    torch.save(state, path)
    with pytest.raises(UserError, match=f"format {FORMAT_VERSION + 1}, which this app cannot"):
        layout.load(path)


def test_inference_weights_are_the_emas_when_the_run_kept_one(tmp_path) -> None:
    _, trained = _saved(tmp_path, ema=True)
    assert not torch.equal(trained.ema.module.weight, trained.model.weight)
    model, data = nn.Linear(3, 2), _Data()
    data.learnt = {}
    at = restore.load_for_inference(model, data, tmp_path / "checkpoints" / "last.pt")
    assert at == TrainedAt(7, 2)
    assert torch.equal(model.weight, trained.ema.module.weight)
    assert data.learnt == {"mean": [0.5]}  # the data's state comes with the weights


def test_a_weights_only_file_loads_for_inference_at_step_zero(tmp_path) -> None:
    path = tmp_path / "weights.pt"
    weights = nn.Linear(3, 2).state_dict()
    torch.save({"model": weights}, path)
    model = nn.Linear(3, 2)
    assert restore.load_for_inference(model, _Data(), path) == TrainedAt(0, 0)
    assert torch.equal(model.weight, weights["weight"])


def test_fine_tuning_loads_the_weights_only_and_starts_the_ema_from_them(tmp_path) -> None:
    _, trained = _saved(tmp_path)
    path = tmp_path / "checkpoints" / "last.pt"
    cfg = _config(f"ckpt={path}", "resume=null")
    checkpoints, step, loop = _parts(tmp_path / "new", cfg, ema=True, seed=1)
    checkpoints.restore()
    assert checkpoints.resumed_from is None and loop == LoopState()
    assert torch.equal(step.model.weight, trained.model.weight)
    assert torch.equal(step.ema.module.weight, trained.model.weight)
    assert not step.optimizer.state_dict()["state"]  # a new schedule: no optimizer state


def test_the_checkpoint_package_knows_the_parts_by_name_only() -> None:
    """The manager holds the run's parts by name (the loop builds the mapping): nothing in
    app.checkpoint imports app.training, not even for annotations."""
    package = Path(__file__).resolve().parents[1] / "src" / "app" / "checkpoint"
    imported = {(path.name, node.module) for path in package.glob("*.py")
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and node.module}
    assert [(f, m) for f, m in imported if m.startswith(("app.training", "app.callbacks"))] == []
