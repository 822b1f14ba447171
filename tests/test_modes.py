"""The modes: trainval, eval, predict, export, and the help screens. Each mode once through
the real CLI (the session's `trained` run, eval, predict, export); the rest in-process."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from app.data import DataModule
from app.errors import UserError
from conftest import REPO, TINY, assert_ok, load_state, make_config, read_metrics, run_app, run_job


def test_trainval_writes_the_run_files(trained) -> None:
    assert (trained / ".hydra" / "config.yaml").is_file()
    assert "val loss" in (trained / "train.log").read_text()
    ckpts = trained / "checkpoints"
    assert (ckpts / "last.pt").is_file() and (ckpts / "best.pt").is_file()
    assert len(list(ckpts.glob("step-*.pt"))) <= 3  # keep_last=3
    rows = read_metrics(trained)
    assert list(rows[0])[:3] == ["step", "epoch", "split"]
    train_rows = [r for r in rows if r["split"] == "train"]
    val_rows = [r for r in rows if r["split"] == "val"]
    assert [int(r["step"]) for r in train_rows] == list(range(1, 89))  # 22 steps x 4 epochs
    assert [int(r["epoch"]) for r in val_rows] == [1, 2, 3, 4]
    last = load_state(ckpts / "last.pt")
    assert last["loop"] == {"step": 88, "epoch": 4, "batch": 0, "stopped_early": None,
                            "global_batch": 64, "steps_per_epoch": 22}
    assert set(last) >= {"model", "optimizer", "scheduler", "rng", "best", "config"}
    assert last["config"]["model"]["channels"] == [8, 16]
    best = load_state(ckpts / "best.pt")
    assert best["best"] == max(float(r["acc"]) for r in val_rows)
    assert float(train_rows[-1]["loss"]) < float(train_rows[0]["loss"])


def test_eval_reproduces_the_recorded_accuracy(trained, tmp_path) -> None:
    ckpt = trained / "checkpoints" / "best.pt"
    result = assert_ok(run_app(tmp_path / "eval", "trainer=eval", f"ckpt={ckpt}",
                               "model.channels=[8,16]"))
    record = json.loads((result.run_dir / "eval.json").read_text())
    recorded = load_state(ckpt)["metrics"]
    assert record["acc"] == recorded["acc"]
    assert record["loss"] == pytest.approx(recorded["loss"], rel=1e-9)
    assert record["num_samples"] == 359
    assert f"acc {record['acc']:.4f}" in result.output


def test_predict_on_validation_split(trained, tmp_path) -> None:
    ckpt = trained / "checkpoints" / "best.pt"
    result = assert_ok(run_app(tmp_path / "pred", "trainer=predict", f"ckpt={ckpt}",
                               "model.channels=[8,16]", "predict.num_show=16"))
    with open(result.run_dir / "predictions.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 359
    accuracy = sum(r["pred"] == r["label"] for r in rows) / len(rows)
    assert accuracy == load_state(ckpt)["metrics"]["acc"]
    png = (result.run_dir / "predictions.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def _predict(run_dir, ckpt, *overrides) -> list[dict[str, str]]:
    result = run_job(run_dir, "trainer=predict", f"ckpt={ckpt}", "model.channels=[8,16]",
                     *overrides)
    with open(result.run_dir / "predictions.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_predict_on_npy_and_image_folder(trained, tmp_path) -> None:
    from PIL import Image

    from app.training.build import build_data

    val_images = build_data(make_config()).val.tensors[0][:10].numpy()
    np.save(tmp_path / "inputs.npy", val_images[:, 0])  # (N, H, W)
    folder = tmp_path / "pngs"
    folder.mkdir()
    for i in range(10):
        Image.fromarray((val_images[i, 0] * 255).round().astype(np.uint8)).save(
            folder / f"{i:02d}.png")
    ckpt = trained / "checkpoints" / "best.pt"
    reference = [r["pred"] for r in _predict(tmp_path / "val", ckpt)[:10]]
    from_npy = _predict(tmp_path / "npy", ckpt, f"predict.input={tmp_path / 'inputs.npy'}")
    assert [r["pred"] for r in from_npy] == reference
    assert all(r["label"] == "" for r in from_npy)
    from_pngs = _predict(tmp_path / "png", ckpt, f"predict.input={folder}")
    assert [r["input"] for r in from_pngs] == [str(folder / f"{i:02d}.png") for i in range(10)]
    # 8-bit PNGs round the pixels; a prediction may flip, not more than one.
    assert sum(r["pred"] != p for r, p in zip(from_pngs, reference, strict=True)) <= 1


def test_a_predict_input_that_is_not_there_is_named_so(tmp_path) -> None:
    from app.modes.predict import load_inputs

    with pytest.raises(UserError, match=r"predict.input=\S+missing.npy: no such file or folder"):
        load_inputs(str(tmp_path / "missing.npy"), None)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UserError, match="expected a folder of images, an image or a .npy file"):
        load_inputs(str(tmp_path / "notes.txt"), None)


def test_predict_warns_about_an_array_far_outside_the_datas_range(tmp_path, caplog) -> None:
    """Digits as sklearn ships them (0 to 16), where the model saw 0 to 1: a warning that
    names both ranges; the validation images themselves: none."""
    from app.modes.predict import load_inputs
    from app.training.build import build_data

    data = build_data(make_config())
    images = data.val.tensors[0][:10].numpy()
    for name, array, warned in (("scaled", images, False), ("raw", images * 16, True)):
        np.save(tmp_path / f"{name}.npy", array)
        caplog.clear()
        load_inputs(str(tmp_path / f"{name}.npy"), data)
        lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert bool(lines) == warned, lines
    assert "values from 0 to 16, far outside the validation data's (0 to 1)" in lines[0]


def test_export_round_trip(trained, tmp_path) -> None:
    ckpt = trained / "checkpoints" / "best.pt"
    result = assert_ok(run_app(tmp_path / "export", "trainer=export", f"ckpt={ckpt}",
                               "model.channels=[8,16]"))
    out = result.run_dir / "export"
    check = json.loads((out / "check.json").read_text())
    assert all(d <= 1e-5 for d in check["max_abs_diff"].values())
    # (torch.export warned twice about the temporary file's name, which did not end in .pt2)
    assert "archive file" not in result.output and "Unable to load package" not in result.output
    # The files load and run in a fresh process that knows nothing of app.
    code = (
        "import torch, sys; x = torch.rand(5, 1, 8, 8); d = sys.argv[1];"
        "a = torch.jit.load(d + '/model.ts')(x); b = torch.export.load(d + '/model.pt2')"
        ".module()(x); assert a.shape == (5, 10) and (a - b).abs().max() < 1e-5; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True)
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_export_fails_when_outputs_differ(trained, tmp_path, monkeypatch) -> None:
    import torch

    from app.errors import AppError
    from app.modes.export import run_export

    real_load = torch.jit.load
    def off_by_a_little(path):
        loaded = real_load(path)
        return lambda x: loaded(x) + 1e-3

    monkeypatch.setattr(torch.jit, "load", off_by_a_little)
    cfg = make_config("trainer=export", f"ckpt={trained}/checkpoints/best.pt",
                      "model.channels=[8,16]")
    with pytest.raises(AppError, match="torchscript"):
        run_export(cfg, tmp_path, torch.device("cpu"))


def test_an_export_cut_short_leaves_no_part_of_a_file_under_its_name(trained, tmp_path,
                                                                     monkeypatch) -> None:
    # (torch's savers wrote in place: a kill mid-export left a truncated model.pt2 there.)
    import torch

    from app.modes.export import run_export

    cfg = make_config("trainer=export", f"ckpt={trained}/checkpoints/best.pt",
                      "model.channels=[8,16]")
    out = tmp_path / "export"
    out.mkdir()
    (out / "model.pt2").write_bytes(b"the previous export")

    def cut_short(program, path) -> None:
        Path(path).write_bytes(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt  # (as a Ctrl-C mid-write)

    monkeypatch.setattr(torch.export, "save", cut_short)
    with pytest.raises(KeyboardInterrupt):
        run_export(cfg, tmp_path, torch.device("cpu"))
    assert (out / "model.pt2").read_bytes() == b"the previous export"
    assert torch.jit.load(str(out / "model.ts")) is not None  # (written whole before it)
    assert sorted(p.name for p in out.iterdir()) == ["model.pt2", "model.ts"]  # no temp left


def test_seeded_runs_repeat_and_seeds_differ(tmp_path) -> None:
    fast = [*TINY, "trainer.max_epochs=1", "trainer.ckpt_every_n_epochs=null"]
    a = run_job(tmp_path / "a", *fast, "seed=0")
    b = run_job(tmp_path / "b", *fast, "seed=0")
    c = run_job(tmp_path / "c", *fast, "seed=1")
    loss = [[r["loss"] for r in read_metrics(x.run_dir)] for x in (a, b, c)]
    assert loss[0] == loss[1]
    assert loss[0] != loss[2]


def test_synthetic_data_and_mlp(tmp_path) -> None:
    result = run_job(
        tmp_path / "syn", "data=synthetic", "model=mlp", "data.num_samples=512",
        "data.input_shape=[16]", "data.num_classes=4", "trainer.max_epochs=2",
        "logger=tensorboard", "trainer.progress_bar=false")
    assert len(read_metrics(result.run_dir)) > 0
    assert list((result.run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_help_lists_groups_and_cfg_prints_config() -> None:
    help_text = subprocess.run([sys.executable, "-m", "app", "--help"], cwd=REPO,
                               capture_output=True, text=True).stdout
    for group in ("trainer:", "model:", "data:", "optimizer:", "scheduler:", "distributed:",
                  "logger:"):
        assert group in help_text
    assert "eval, export, predict, trainval" in help_text
    job = subprocess.run([sys.executable, "-m", "app", "--cfg", "job", "model=mlp"], cwd=REPO,
                         capture_output=True, text=True).stdout
    assert "_target_: app.models.MLP" in job and "max_epochs: 20" in job


def test_unavailable_accelerator_falls_back_to_cpu(tmp_path) -> None:
    result = run_job(tmp_path / "run", "accelerator=xpu", "debug=fast", "model.channels=[8,16]")
    assert "accelerator=xpu is not available here: running on the CPU" in result.output
    assert "on cpu x 1" in result.output


class _Digits(DataModule):
    input_shape = (1, 8, 8)  # what load_inputs asks of a data object, with DataModule's decoding
    val = torch.utils.data.TensorDataset(torch.rand(4, 1, 8, 8), torch.zeros(4))  # (0 to 1)


def _corrupt_inputs(tmp_path) -> dict[str, tuple[Path, str]]:
    """Bad predict inputs, each with the words its error must hold."""
    from PIL import Image

    good = tmp_path / "good.png"
    noise = np.random.default_rng(0).integers(0, 255, (64, 64), dtype=np.uint8)
    Image.fromarray(noise).save(good)
    png = good.read_bytes()
    cases = {}
    for name, content in {"truncated": png[:len(png) // 2], "garbage": b"not an image",
                          "empty": b""}.items():
        folder = tmp_path / f"{name}_pngs"
        folder.mkdir()
        (folder / "a.png").write_bytes(png)
        (folder / "b.png").write_bytes(content)
        cases[f"{name} png"] = (folder, "b.png is not a readable image")
    arrays = {"empty file": (b"", "not a readable .npy"),
              "no samples": (np.zeros((0, 8, 8), np.float32), "holds no samples"),
              "strings": (np.full((2, 8, 8), "0.5"), "an array of strings"),
              "complex": (np.zeros((2, 8, 8), complex), "complex numbers"),
              "truncated": (np.zeros((4, 8, 8), np.float32), "not a readable .npy"),
              "not finite": (np.array([np.zeros((8, 8)), np.full((8, 8), np.nan),
                                       np.full((8, 8), np.inf)]),
                             "2 of 3 samples hold NaN or infinite values (the first: sample 1)"),
              "beyond float32": (np.array([np.zeros((8, 8)), np.full((8, 8), 1e39)]),
                                 "1 of 2 samples hold values beyond float32's range")}
    for name, (content, words) in arrays.items():
        path = tmp_path / f"{name.replace(' ', '_')}.npy"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            np.save(path, content)
            if name == "truncated":
                path.write_bytes(path.read_bytes()[:200])
        cases[f"{name} npy"] = (path, words)
    return cases


def test_predict_inputs_that_cannot_be_read_name_the_file(tmp_path) -> None:
    from app.modes.predict import load_inputs

    for case, (path, words) in _corrupt_inputs(tmp_path).items():
        with pytest.raises(UserError) as err:  # (images are decoded batch by batch)
            list(load_inputs(str(path), _Digits()).batches(8))
        message = str(err.value)
        assert words in message and f"predict.input={path}" in message, (case, message)
        assert "\n" not in message, (case, message)
