"""`trainer=predict` on a user's inputs: a folder of class folders is labelled and scored,
inputs drawn inverted against the validation data are warned of, and the picture shows the
mistakes first. In-process (`run_predict`, `load_inputs`), on the session's `trained` digits
checkpoint; the image folders are written by the tests (8x8 grey PNGs of validation digits)."""

from __future__ import annotations

import csv
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from app.data import DataModule, ImageFolder
from app.errors import UserError
from app.modes.predict import _warn_if_inverted, load_inputs, run_predict
from app.reporting.grids import CELL, GREEN, LABEL_H, RED, TITLE_H
from app.training.build import build_data
from conftest import make_config

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


@pytest.fixture(scope="module")
def val() -> tuple[np.ndarray, np.ndarray]:
    """The digits' validation images as 8-bit pixels (N, 8, 8), and their labels."""
    x, y = build_data(make_config()).val.tensors
    return (x[:, 0].numpy() * 255).round().astype(np.uint8), y.numpy()


def _write(folder: Path, pixels: np.ndarray, labels: np.ndarray | None = None,
           names: list[str] | None = None) -> list[Path]:
    """PNGs of `pixels` in `folder`, or in its class folders (`labels`, named by `names` or
    by the label)."""
    paths = []
    for i, image in enumerate(pixels):
        where = folder if labels is None else folder / (
            names[labels[i]] if names else str(labels[i]))
        where.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(where / f"{i:03d}.png")
        paths.append(where / f"{i:03d}.png")
    return paths


def _predict(trained: Path, run_dir: Path, *overrides: str) -> tuple[float | None, list[dict]]:
    cfg = make_config("trainer=predict", f"ckpt={trained / 'checkpoints' / 'best.pt'}",
                      "model.channels=[8,16]", *overrides)
    run_dir.mkdir()
    accuracy = run_predict(cfg, run_dir, torch.device("cpu"))
    with open(run_dir / "predictions.csv", newline="") as f:
        return accuracy, list(csv.DictReader(f))


def _picture(run_dir: Path) -> tuple[str, list[str], Image.Image]:
    """predictions.png's title, its cells' labels, and the picture."""
    image = Image.open(run_dir / "predictions.png")
    image.load()
    return image.text["Title"], image.text["Description"].split("; "), image


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


class _Digits(DataModule):
    input_shape, num_classes = (1, 8, 8), 10  # no class names: folders named 0 to 9
    val = torch.utils.data.TensorDataset(torch.rand(4, 1, 8, 8), torch.zeros(4))  # (0 to 1)


class _Named(_Digits):
    classes = NAMES


def test_a_folder_of_class_folders_is_labelled_and_scored(trained, val, tmp_path,
                                                          caplog) -> None:
    pixels, labels = val[0][:60], val[1][:60]
    files = _write(tmp_path / "by_class", pixels, labels)
    caplog.set_level(logging.INFO)
    accuracy, rows = _predict(trained, tmp_path / "run", f"predict.input={tmp_path / 'by_class'}")
    by_input = {r["input"]: r["label"] for r in rows}
    assert by_input == {str(f): str(label) for f, label in zip(files, labels, strict=True)}
    right = sum(r["pred"] == r["label"] for r in rows)
    assert 0 < right < len(rows) and accuracy == right / len(rows)
    assert f"predicted 60 inputs -> {tmp_path / 'run'}" in caplog.text
    assert f"; accuracy {accuracy:.4f}" in caplog.text
    title, cells, _ = _picture(tmp_path / "run")
    assert title == f"best.pt: 32 of 60 inputs, the mistakes first: all {60 - right} wrong " \
                    f"(red), {32 - (60 - right)} of {right} right (green); accuracy {accuracy:.2%}"
    name, number = cells[0].split(": #")  # each cell names its file
    assert name == Path(rows[int(number.split(" ")[0])]["input"]).name
    assert not _warnings(caplog)


def test_class_folders_are_named_by_the_datas_classes_or_by_index(tmp_path) -> None:
    pixels, labels = np.zeros((4, 8, 8), np.uint8), np.array([3, 3, 0, 9])
    for data, names in ((_Named(), NAMES), (_Digits(), None)):
        root = tmp_path / type(data).__name__
        files = _write(root, pixels, labels, names)
        (root / "notes").mkdir()  # a sub-folder without images: no class, left alone
        (root / "notes" / "a.txt").write_text("x")
        _write(root / ".thumbs", pixels[:1])  # hidden: left out
        _write(root / (names[9] if names else "9") / "more", pixels[:1])  # a class's, below
        inputs = load_inputs(str(root), data)
        found = torch.cat([y for _, y in inputs.batches(3)]).tolist()
        assert dict(zip(inputs.names, found, strict=True)) == {
            **{str(f): int(c) for f, c in zip(files, labels, strict=True)},
            str(root / (names[9] if names else "9") / "more" / "000.png"): 9}


@pytest.mark.parametrize("data, folders, words", [
    (_Digits(), ["3", "10", "cats"], "the sub-folder(s) 10, cats name no class of the data "
                                     "(the class indices 0 to 9); name each folder of images "
                                     "by their class"),
    (_Named(), ["one", "zebra"], "the sub-folder(s) zebra name no class of the data (zero, "
                                 "one, two, three, four, five, six, seven, eight, nine); name "
                                 "each folder of images by their class"),
])
def test_a_sub_folder_that_names_no_class_is_refused_naming_it(tmp_path, data, folders,
                                                              words) -> None:
    for name in folders:
        _write(tmp_path / "in" / name, np.zeros((1, 8, 8), np.uint8))
    with pytest.raises(UserError) as error:
        load_inputs(str(tmp_path / "in"), data)
    assert str(error.value) == f"predict.input={tmp_path / 'in'}: {words}"


class _Counted(torch.utils.data.Dataset):
    """Four validation inputs that count their reads."""

    reads = 0

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.reads += 1
        return torch.full((1, 8, 8), i / 4), 0


def test_the_checks_of_inputs_read_the_validation_data_once(tmp_path) -> None:
    """The range and inversion checks compare inputs with one sample of the validation data
    (an image folder's decoded from disk): each check read it again."""
    data = _Digits()
    data.val = _Counted()
    np.save(tmp_path / "x.npy", np.zeros((2, 8, 8)))
    load_inputs(str(tmp_path / "x.npy"), data)  # (the range check)
    _warn_if_inverted(0.0, data, str(tmp_path / "x.npy"))
    assert data.val.reads == 4


def test_images_beside_class_folders_are_predicted_alone_unlabelled(tmp_path, caplog) -> None:
    """A folder of images is predicted as before, whatever its sub-folders: its own images,
    unlabelled; class folders beside them are left out, with a warning that says how to
    have them scored. Other sub-folders (of thumbnails, say) are left out silently."""
    pixels = np.zeros((2, 8, 8), np.uint8)
    root = tmp_path / "mixed"
    own = _write(root, pixels)
    _write(root / "thumbnails", pixels)
    for data in (_Digits(), _Named()):
        caplog.clear()
        inputs = load_inputs(str(root), data)
        assert inputs.names == list(map(str, own))
        assert [y for _, y in inputs.batches(8)] == [None]
        assert not _warnings(caplog)
    _write(root, pixels[:1], np.array([7]))  # a class folder "7" beside the images
    inputs = load_inputs(str(root), _Digits())
    assert inputs.names == list(map(str, own))
    assert _warnings(caplog) == [
        f"predict.input={root}: its own images are predicted, unlabelled; its class folders "
        f"(7) are left out: to have those predicted and scored, move the images beside them "
        f"out, or give a folder of class folders only"]
    empty = tmp_path / "empty"
    (empty / "notes").mkdir(parents=True)
    with pytest.raises(UserError, match=re.escape(
            f"predict.input={empty}: no images (.bmp, .gif, .jpeg, .jpg, .png, .tif, .tiff, "
            f".webp), in it or in sub-folders named by class")):
        load_inputs(str(empty), _Digits())


def test_inputs_inverted_against_the_validation_data_are_warned_of_once(trained, val, tmp_path,
                                                                        caplog) -> None:
    pixels, labels = val
    np.save(tmp_path / "val.npy", pixels / 255.0)
    np.save(tmp_path / "inverted.npy", 1 - pixels / 255.0)
    np.save(tmp_path / "raw.npy", pixels / 255.0 * 16)  # unscaled: not taken for inverted
    _write(tmp_path / "flat", pixels[:40])
    _write(tmp_path / "drawn", 255 - pixels[:40], labels[:40])  # dark strokes on light
    warned = {}
    for name in ("val.npy", "inverted.npy", "raw.npy", "flat", "drawn", None):
        caplog.clear()
        _predict(trained, tmp_path / f"run-{name}",
                 *([f"predict.input={tmp_path / name}"] if name else []))
        warned[name] = _warnings(caplog)
    assert warned["val.npy"] == warned["flat"] == warned[None] == []
    assert len(warned["raw.npy"]) == 1 and "far outside the validation" in warned["raw.npy"][0]
    inverted = "predict.input={}: the inputs look inverted against the validation data (mean " \
               "{}, where the validation data's is 0.307 on a range of 0 to 1): dark on light, " \
               "where the model saw light on dark; their labels may mean nothing: invert them " \
               "({}) and predict again"
    mean = f"{1 - pixels.mean() / 255:.3g}"
    assert warned["inverted.npy"] == [inverted.format(tmp_path / "inverted.npy", mean,
                                                      "1 - x for each value")]
    mean = f"{1 - pixels[:40].mean() / 255:.3g}"
    assert warned["drawn"] == [inverted.format(tmp_path / "drawn", mean,
                                               "255 - each pixel of 8-bit images")]


def test_no_warning_for_normalised_image_folder_data_unless_inverted(val, tmp_path,
                                                                     caplog) -> None:
    """data=image_folder normalises its images (a mean near 0): its own validation images
    are not taken for inverted ones; the same images inverted are."""
    pixels, labels = val
    _write(tmp_path / "root", pixels[:120], labels[:120], NAMES)
    data = ImageFolder(root=str(tmp_path / "root"), image_size=8, channels=1)
    data.prepare()
    for name, images in (("own", [Image.open(f) for f in data.val.files]),
                         ("inverted", [Image.eval(Image.open(f), lambda v: 255 - v)
                                       for f in data.val.files])):
        folder = tmp_path / name
        folder.mkdir()
        for i, image in enumerate(images):
            image.save(folder / f"{i:03d}.png")
        x = torch.cat([x for x, _ in load_inputs(str(folder), data).batches(16)])
        assert name == "inverted" or abs(float(x.mean())) < 0.2  # (normalised)
        caplog.clear()
        _warn_if_inverted(float(x.double().mean()), data, str(folder))
        assert len(_warnings(caplog)) == (name == "inverted"), _warnings(caplog)


def _colours(image: Image.Image, cells: int) -> list[tuple[int, int, int]]:
    """Each cell's label colour, RED or GREEN (8 cells a row)."""
    found = []
    for i in range(cells):
        left, top = (i % 8) * CELL[0], TITLE_H + (i // 8) * CELL[1]
        band = np.asarray(image.convert("RGB").crop((left, top, left + CELL[0], top + LABEL_H)))
        found += [c for c in (RED, GREEN) if (band == c).all(-1).any()]
    return found


def test_the_picture_shows_the_mistakes_first(trained, tmp_path) -> None:
    """The validation split: its first mistakes, then its first right ones, each numbered as
    in predictions.csv; the title says how many of the split it shows, and which. Unlabelled
    inputs: in order."""
    accuracy, rows = _predict(trained, tmp_path / "val", "predict.num_show=20")
    wrong = [int(r["index"]) for r in rows if r["pred"] != r["label"]]
    right = [int(r["index"]) for r in rows if r["pred"] == r["label"]]
    shown = wrong[:20] + right[:max(0, 20 - len(wrong))]
    assert shown != list(range(20))  # (else the first 20 inputs, as before, would do)
    title, cells, image = _picture(tmp_path / "val")
    assert [int(c.split(" ")[0][1:]) for c in cells] == shown
    first = rows[wrong[0]]
    assert cells[0] == f"#{wrong[0]} pred {first['pred']} / true {first['label']}"
    assert _colours(image, 20) == [RED] * min(20, len(wrong)) + [GREEN] * max(0, 20 - len(wrong))
    assert len(wrong) > 20  # (the trained model's: all shown are mistakes)
    assert title == f"best.pt: 20 of {len(rows)} inputs, the mistakes first: 20 of " \
                    f"{len(wrong)} wrong (red); accuracy {accuracy:.2%}"


def test_unlabelled_inputs_are_shown_in_order(trained, val, tmp_path) -> None:
    _write(tmp_path / "flat", val[0][:10])
    _, rows = _predict(trained, tmp_path / "run", f"predict.input={tmp_path / 'flat'}",
                       "predict.num_show=6")
    title, cells, _ = _picture(tmp_path / "run")
    assert title == "best.pt: the first 6 of 10 inputs"
    assert cells == [f"{Path(r['input']).name}: pred {r['pred']}" for r in rows[:6]]


class Normalised(DataModule):
    """A data set of your own that normalises its inputs to [-1, 1], without a decode_file
    (files are then read as 0-1 pixels)."""

    def __init__(self) -> None:
        super().__init__()
        x = torch.linspace(-1, 1, 4 * 64).reshape(4, 1, 8, 8)
        self.train = self.val = torch.utils.data.TensorDataset(x, torch.zeros(4, dtype=torch.long))
        self.input_shape, self.num_classes = (1, 8, 8), 2


class Unresized(Normalised):
    def decode_file(self, path: Path) -> torch.Tensor:  # forgets to resize to (8, 8)
        return torch.zeros(1, 4, 4)


def test_files_read_unlike_a_data_set_s_own_inputs_are_warned_of(tmp_path, val, caplog) -> None:
    """A newcomer's normalised data set without decode_file: predict scored 0.40 where its
    evaluation said 0.92, without a word. And a decode_file of the wrong shape was a matmul
    traceback."""
    _write(tmp_path / "new", val[0][:3])
    with caplog.at_level(logging.WARNING):
        load_inputs(str(tmp_path / "new"), Normalised())
    assert "Normalised has no decode_file of its own, so the images are read as pixels from 0 " \
           "to 1, but its validation inputs range from -1 to 1" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_inputs(str(tmp_path / "new"), build_data(make_config()))  # digits: 0 to 1
    assert "decode_file" not in caplog.text
    with pytest.raises(UserError, match=r"Unresized.decode_file gave 000.png the shape "
                                        r"\[1, 4, 4\]; the model takes \[1, 8, 8\]"):
        next(load_inputs(str(tmp_path / "new"), Unresized()).batches(2))
