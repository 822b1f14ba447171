"""Callbacks from config: early stopping, evaluation visuals, a user's own callback; device_id."""

from __future__ import annotations

import json
import shutil
import textwrap

import pytest
import torch
from PIL import Image

from app.callbacks import Callbacks
from app.errors import AppError, UserError
from app.launch import plan
from conftest import TINY, load_state, make_config, read_metrics, run_job

# Validation every 4 steps; the learning rate so small that val/acc cannot move: a plateau.
PLATEAU = [*TINY, "trainer.val_every_n_steps=4", "trainer.val_every_n_epochs=null",
           "optimizer.lr=1e-12", "+callbacks/early_stopping=default",
           "callbacks.early_stopping.patience=2"]


def _val_steps(run_dir) -> list[int]:
    return [int(r["step"]) for r in read_metrics(run_dir) if r["split"] == "val"]


@pytest.mark.parametrize("devices", [1, 2])
def test_early_stopping_stops_where_the_metric_plateaued_on_every_rank(tmp_path, devices) -> None:
    result = run_job(tmp_path / "run", *PLATEAU, f"devices={devices}")
    # Validations at 4 (the best), 8 and 12 (no improvement: patience 2 used up).
    assert _val_steps(result.run_dir) == [4, 8, 12]
    assert load_state(result.run_dir / "checkpoints" / "last.pt")["loop"]["step"] == 12
    rank0 = result.output if devices == 1 else (result.run_dir / "logs" / "rank0.log").read_text()
    assert "step 12: early stopping: val/acc did not improve" in rank0
    if devices == 2:  # the other rank stopped at the same step, by the same decision
        rank1 = (result.run_dir / "logs" / "rank1.log").read_text()
        assert "step 12: early stopping" in rank1 and "done: step 12" in rank1


def test_resume_from_a_checkpoint_before_early_stopping_stops_at_the_same_step(tmp_path) -> None:
    # min_delta=1 on val/acc: after the first validation nothing counts as an improvement,
    # while the weights still change (normal learning rate), so the comparison means something.
    overrides = [*TINY, "trainer.val_every_n_steps=4", "trainer.val_every_n_epochs=null",
                 "trainer.ckpt_every_n_steps=4", "trainer.keep_last=10",
                 "+callbacks/early_stopping=default", "callbacks.early_stopping.patience=2",
                 "callbacks.early_stopping.min_delta=1.0"]
    whole = run_job(tmp_path / "whole", *overrides).run_dir
    assert _val_steps(whole) == [4, 8, 12]
    # A run that was interrupted after step 8: one validation of patience already spent.
    # Without the callback's state in the checkpoint it would count afresh and stop at 20.
    ckpts = tmp_path / "resumed" / "checkpoints"
    ckpts.mkdir(parents=True)
    shutil.copy(whole / "checkpoints" / "step-00000008.pt", ckpts / "last.pt")
    resumed = run_job(tmp_path / "resumed", *overrides)
    assert "resumed from" in resumed.output and "at step 8" in resumed.output
    last = load_state(ckpts / "last.pt")
    assert last["loop"]["step"] == 12
    assert last["callbacks"]["early_stopping"] == {"best": pytest.approx(last["best"]),
                                                   "wait": 2}
    whole_weights = load_state(whole / "checkpoints" / "last.pt")["model"]
    for key, value in last["model"].items():
        assert torch.equal(value, whole_weights[key]), key
    again = run_job(whole, *overrides)  # a finished run run again trains nothing
    assert "already finished at step 12 (early stopping" in again.output


def test_eval_visuals_draw_the_predictions_of_the_validating_weights(tmp_path) -> None:
    result = run_job(
        tmp_path / "run", *TINY, "trainer.max_epochs=null", "trainer.max_steps=20",
        "trainer.val_every_n_steps=5", "+callbacks/eval_visuals=default",
        "callbacks.eval_visuals.every_n_validations=2", "callbacks.eval_visuals.num_show=12")
    pictures = sorted((result.run_dir / "eval_visuals").iterdir())
    assert [p.name for p in pictures] == ["step-00000010.png", "step-00000020.png"]
    with Image.open(pictures[-1]) as image:
        image.load()
        assert image.size[0] > 400 and image.size[1] > 200
        title, cells = image.text["Title"], image.text["Description"].split("; ")
    # The labels drawn are the first 12 validation samples', with the final weights' predictions.
    cfg = make_config(*TINY)
    from app.training.build import build_data, build_model

    data = build_data(cfg)
    x, y = data.val.tensors
    model = build_model(cfg, data)
    model.load_state_dict(load_state(result.run_dir / "checkpoints" / "last.pt")["model"])
    with torch.no_grad():
        preds = model.eval()(x[:12]).argmax(1)
    assert cells == [f"pred {p} / true {t}" for p, t in zip(preds.tolist(), y[:12].tolist(),
                                                          strict=True)]
    right = int((preds == y[:12]).sum())
    assert title.startswith(f"step 20: {right}/12 right")


SPY = '''
import json
from app import dist
from app.callbacks import Callback

class Spy(Callback):
    """Writes each hook it receives, with the step, to a JSON-lines file."""
    every_rank = ("on_validation_end",)

    def __init__(self, path):
        self.path, self.calls = path, 0

    def _record(self, hook, run, **extra):
        self.calls += 1
        self._write({"hook": hook, "step": run.step, **extra})

    def _write(self, record):
        with open(self.path.format(rank=dist.rank()), "a") as f:
            f.write(json.dumps(record) + "\\n")

    def on_train_start(self, run):
        self._record("on_train_start", run)

    def on_step_end(self, run, step, loss):
        self._record("on_step_end", run)

    def on_log(self, run, step, metrics):
        metrics["spy_calls"] = self.calls
        self._record("on_log", run)

    def on_validation_end(self, run, step, metrics):
        self._record("on_validation_end", run, acc=metrics["val/acc"])

    def on_train_end(self, run, error):
        self._record("on_train_end", run, error=type(error).__name__ if error else None)

    def state_dict(self):
        self._write({"hook": "state_dict"})
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]
        self._write({"hook": "load_state_dict", "calls": state["calls"]})
'''


def _hooks(path) -> list[str]:
    return [(r["hook"], r.get("step")) for r in map(json.loads, path.read_text().splitlines())]


def test_a_users_callback_from_outside_the_repo_gets_every_hook_in_order(tmp_path) -> None:
    code, config = tmp_path / "user_code", tmp_path / "user_conf" / "callbacks" / "spy"
    code.mkdir()
    config.mkdir(parents=True)
    (code / "my_callbacks.py").write_text(textwrap.dedent(SPY))
    (config / "default.yaml").write_text("_target_: my_callbacks.Spy\npath: null\n")
    record = tmp_path / "rank{rank}.jsonl"
    overrides = [*TINY, "trainer.max_epochs=null", "trainer.max_steps=6",
                 "trainer.log_every_n_steps=2", "trainer.val_every_n_steps=3",
                 "trainer.ckpt_every_n_steps=3", f"hydra.searchpath=[file://{tmp_path}/user_conf]",
                 "+callbacks/spy=default", f"callbacks.spy.path='{record}'"]
    result = run_job(tmp_path / "run", *overrides, user_code=code)
    assert "callbacks: model_summary, spy" in result.output
    rank0 = tmp_path / "rank0.jsonl"
    assert _hooks(rank0) == [
        ("on_train_start", 0),
        ("on_step_end", 1), ("on_step_end", 2), ("on_log", 2),
        ("on_step_end", 3), ("on_validation_end", 3), ("state_dict", None),
        ("on_step_end", 4), ("on_log", 4), ("on_step_end", 5),
        ("on_step_end", 6), ("on_log", 6), ("on_validation_end", 6), ("state_dict", None),
        ("on_train_end", 6)]
    logged = [r for r in read_metrics(result.run_dir) if r["split"] == "train"]
    assert [r["spy_calls"] for r in logged] == ["3", "7", "10"]  # on_log's additions are logged
    # Resumed: the state comes back before training starts; more steps, on two ranks (two
    # worker processes, spawned from this one as the CLI spawns them).
    rank0.unlink()
    run_job(tmp_path / "run", *overrides, "trainer.max_steps=8", "devices=2", user_code=code)
    assert "resumed from" in (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert _hooks(rank0)[:2] == [("load_state_dict", None), ("on_train_start", 6)]
    assert json.loads(rank0.read_text().splitlines()[0])["calls"] == 12
    assert _hooks(rank0)[-1] == ("on_train_end", 8)
    # Rank 1 runs only the hook the class declared for every rank (and loads its state).
    assert _hooks(tmp_path / "rank1.jsonl") == [("load_state_dict", None),
                                                ("on_validation_end", 8)]
    # A run that fails still ends with on_train_end, which is told the error.
    rank0.unlink()
    with pytest.raises(AppError):
        run_job(tmp_path / "failed", *overrides, "optimizer.lr=1e30", user_code=code)
    last = json.loads(rank0.read_text().splitlines()[-1])
    assert last["hook"] == "on_train_end" and last["error"] is not None


def test_callback_mistakes_are_one_line_errors_naming_the_key(tmp_path) -> None:
    """A UserError of one line (the CLI prints it so, with exit 2: tests/test_error_types.py),
    raised before the run writes anything."""
    with pytest.raises(UserError) as error:
        run_job(tmp_path / "run", *TINY, "+callbacks/early_stopping=default",
                "callbacks.early_stopping.patience=0")
    assert "callbacks.early_stopping.patience=0: must be 1 or more" in str(error.value)
    assert "\n" not in str(error.value) and not (tmp_path / "run" / "checkpoints").exists()
    for override, words in [
        (["+callbacks/early_stopping=default", "callbacks.early_stopping.monitor=val/f1"],
         "callbacks.early_stopping.monitor=val/f1: expected one of val/acc, val/loss"),
        (["+callbacks.mine._target_=collections.OrderedDict"],
         "callbacks.mine._target_=collections.OrderedDict does not build an app.callbacks"),
        (["+callbacks.mine._target_=nowhere.Nothing"], "callbacks.mine (nowhere.Nothing)"),
    ]:
        with pytest.raises(UserError) as error:
            Callbacks.build(make_config(*override))
        assert words in str(error.value)


def test_device_id_picks_one_device_or_says_which_exist(tmp_path, monkeypatch) -> None:
    with pytest.raises(UserError, match="device_id=3: the run is on the cpu, which is one "
                                        "device"):  # (CLI: exit 2)
        run_job(tmp_path / "run", *TINY, "device_id=3")
    # The GPU path, with two visible devices out of a machine's several.
    monkeypatch.setattr(plan, "device_count", lambda kind: 2)
    with pytest.raises(UserError, match=r"device_id=3: 2 cuda device\(s\) are visible; indices "
                                        r"count among the visible devices"):
        plan.check_device_id("cuda", 3)
    plan.check_device_id("cuda", 1)
    plan.check_device_id("cpu", 0)  # (the one device: as if it were not given)
