"""Checkpoint files under faults: a crash between their names, a name taken by a directory,
files of the wrong structure in every mode, a checkpoint of another head. In-process
(`run_job`): the logic is the subject, not the process."""

from __future__ import annotations

import os

import pytest
import torch

from app.checkpoint import io, layout
from app.errors import UserError
from app.training.build import build_data, build_model
from conftest import TINY, Job, make_config, run_job

# One checkpoint, the best, at step 3.
SHORT = [*TINY, "trainer.max_epochs=null", "trainer.max_steps=3"]


class Killed(BaseException):
    """Stands for a SIGKILL at a link: nothing after it runs, no handler sees it as an error."""


def _train(run_dir, *overrides: str) -> Job:
    return run_job(run_dir, *SHORT, *overrides)


@pytest.mark.parametrize("crash_at", ["last.pt", "best.pt"])
def test_a_crash_between_the_names_of_the_final_checkpoint_is_repaired_on_rerun(
        tmp_path, monkeypatch, crash_at) -> None:
    # What `strace -e inject=link:signal=KILL:when=N python -m app ...` does to the process:
    # the final checkpoint is on disk, and the link that would give it the name `crash_at`
    # never happens (nor anything after it).
    run_dir, real_link = tmp_path / "run", io.link

    def link_then_die(source, name):
        if name.name == crash_at:
            raise Killed
        real_link(source, name)

    monkeypatch.setattr(io, "link", link_then_die)
    with pytest.raises(Killed):
        _train(run_dir)
    ckpts = run_dir / "checkpoints"
    final = ckpts / "step-00000003.pt"
    assert final.is_file() and not (ckpts / "best.pt").exists()

    monkeypatch.setattr(io, "link", real_link)
    rerun = _train(run_dir)  # nothing left to train
    assert "already finished at step 3" in rerun.output
    for name in ("last.pt", "best.pt"):
        assert os.path.samefile(ckpts / name, final), name
    assert "best.pt now names the checkpoint of step 3" in rerun.output


def test_a_resume_from_a_checkpoint_that_was_not_the_best_leaves_best_pt_alone(tmp_path) -> None:
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    for step in (1, 2):
        torch.save({"model": {}}, ckpts / f"step-{step:08d}.pt")
    io.link(ckpts / "step-00000001.pt", ckpts / "best.pt")
    io.link(ckpts / "step-00000002.pt", ckpts / "last.pt")
    layout.repair_names(ckpts, ckpts / "last.pt", {"is_best": False})
    assert os.path.samefile(ckpts / "best.pt", ckpts / "step-00000001.pt")
    layout.repair_names(ckpts, ckpts / "step-00000002.pt", {"is_best": True})
    assert os.path.samefile(ckpts / "best.pt", ckpts / "step-00000002.pt")


@pytest.mark.parametrize("name", ["last.pt", "best.pt", "step-00000003.pt"])
def test_a_checkpoint_name_taken_by_a_directory_stops_before_training(tmp_path, name) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / name).mkdir(parents=True)
    with pytest.raises(UserError, match=f"{name} is a directory, not a checkpoint.*move it"):
        _train(run_dir)
    assert not (run_dir / "metrics.csv").exists()  # nothing was trained


def test_a_directory_given_as_the_checkpoint_to_evaluate_is_one_line(tmp_path) -> None:
    (tmp_path / "last.pt").mkdir()
    with pytest.raises(UserError, match="last.pt: a directory, not a checkpoint file"):
        _train(tmp_path / "run", "trainer=eval", f"ckpt={tmp_path / 'last.pt'}")
    # A sharded checkpoint's directory that lost its index is named as such.
    (tmp_path / "last.pt" / "__0_0.distcp").write_bytes(b"shard")
    with pytest.raises(UserError, match="last.pt: a sharded checkpoint's directory without "
                                        r"its index \(.metadata\)"):
        _train(tmp_path / "run", "trainer=eval", f"ckpt={tmp_path / 'last.pt'}")


@pytest.mark.parametrize("content,why", [(b"i am text\n", "UnpicklingError"),
                                         (b"PK\x03\x04", ""),
                                         # ("c": pickle's GLOBAL opcode; was "refused: it holds
                                         # Python objects ... could run code")
                                         (b"cut short", "GLOBAL ut shor")])
def test_a_file_that_is_no_checkpoint_says_what_it_may_be(tmp_path, content, why) -> None:
    (tmp_path / "model.pt").write_bytes(content)
    with pytest.raises(UserError, match="not a readable checkpoint file \\(cut short, or not "
                                        f"written by torch.save: .*{why}"):
        _train(tmp_path / "run", "trainer=eval", f"ckpt={tmp_path / 'model.pt'}")


@pytest.fixture(scope="module")
def good_state(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("good") / "run"
    _train(run_dir)
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)


def _damaged(good: dict, damage: str) -> dict:
    state = dict(good)
    if damage == "model-is-a-number":
        return {"model": 5}
    if damage == "no-scheduler":
        del state["scheduler"]
    elif damage == "loop-without-epoch":
        state["loop"] = {k: v for k, v in good["loop"].items() if k != "epoch"}
    elif damage == "string-weights":
        state["model"] = {k: "weights" for k in good["model"]}
    return state


DAMAGE = {  # what the one line must say
    "model-is-a-number": "'model' is int, not a dict of tensors",
    "no-scheduler": "no 'scheduler' entry, which a resume needs",
    "loop-without-epoch": "'loop' has no 'epoch' count",
    "string-weights": "entry 'features.0.weight' is str, not a tensor",
}
WEIGHTS_ONLY_MODES = ["trainer=eval", "trainer=predict", "trainer=export", "trainer=trainval"]


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("how", ["resume=auto", "resume=PATH", *WEIGHTS_ONLY_MODES])
def test_a_checkpoint_of_the_wrong_structure_is_one_line_in_every_mode(
        tmp_path, good_state, damage, how) -> None:
    run_dir = tmp_path / "run"
    path = run_dir / "checkpoints" / "last.pt"
    path.parent.mkdir(parents=True)
    torch.save(_damaged(good_state, damage), path)
    overrides = {"resume=auto": [], "resume=PATH": [f"resume={path}"]}.get(
        how, [how, f"ckpt={path}", "resume=null"])
    if damage == "no-scheduler" and how in WEIGHTS_ONLY_MODES:
        _train(run_dir, *overrides)  # the weights are all these modes read: it works
        return
    with pytest.raises(UserError, match=DAMAGE[damage]) as error:
        _train(run_dir, *overrides)
    assert "last.pt" in str(error.value) and "\n" not in str(error.value)


def test_ckpt_of_a_model_with_another_head_points_to_ckpt_strict_false(tmp_path) -> None:
    ten = make_config(*SHORT, "data=synthetic", "data.num_samples=256")
    model = build_model(ten, build_data(ten))
    path = tmp_path / "ten-classes.pt"
    torch.save({"model": model.state_dict(), "config": {"data": {"num_classes": 10}}}, path)
    with pytest.raises(UserError, match="on data=.*'num_classes': 10}.*add ckpt_strict=false"):
        _train(tmp_path / "four", "data=synthetic", "data.num_classes=4", f"ckpt={path}")
    _train(tmp_path / "four", "data=synthetic", "data.num_classes=4", f"ckpt={path}",
           "ckpt_strict=false", "data.num_samples=256")  # the way the message points to works
