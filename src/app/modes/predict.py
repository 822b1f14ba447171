"""`trainer=predict` (the older systems' demo): labels for validation samples or your own files.

Inputs: the validation split (default), a `.npy` array of shape (N, H, W) or (N, C, H, W) of
inputs as the model takes them (0 to 1 for digits; normalised for an image folder), an image,
or a folder of images, each seen as the data set sees its validation images (`decode_file`:
the same decoding, view and normalisation). A folder laid out as for training, one sub-folder
per class and no images of its own, gives labelled images (scored, as the validation split
is). The pictures show inputs as they are (`show`), the mistakes first.
"""

from __future__ import annotations

import csv
import functools
import io
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from app.config import AppConfig
from app.data import DataModule
from app.data.base import IMAGE_SUFFIXES, is_image_name
from app.data.transforms import DECODE_ERRORS
from app.errors import BadImage, UserError, first_line
from app.files import write_text_atomically
from app.reporting.grids import save_grid
from app.training.build import build_data, build_trained_model

log = logging.getLogger(__name__)


def _from_npy(path: Path, shape: tuple[int, ...]) -> torch.Tensor:
    try:
        array = np.load(path, allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:  # a pickle, an empty or truncated file
        reason = first_line(e)
        raise UserError(f"predict.input={path}: not a readable .npy array ({reason})") from None
    if array.dtype.kind not in "biuf":
        kind = {"U": "strings", "S": "byte strings", "c": "complex numbers"}.get(
            array.dtype.kind, f"{array.dtype} values")
        raise UserError(f"predict.input={path}: an array of {kind}; the model takes real "
                        f"numbers (save a float array)")
    if array.ndim > 0 and array.shape[0] == 0:
        raise UserError(f"predict.input={path}: the array holds no samples (shape "
                        f"{list(array.shape)})")
    if array.ndim == len(shape) and len(shape) == 3 and shape[0] == 1:
        array = array[:, None]  # (N, H, W) for one-channel images
    if tuple(array.shape[1:]) != shape:
        raise UserError(
            f"predict.input={path}: arrays of shape {list(array.shape)}, the model takes "
            f"(N, {', '.join(map(str, shape))})"
        )
    _refuse_unless_finite(array, path, "hold NaN or infinite values")
    with np.errstate(over="ignore"):  # (said below, by sample)
        x = torch.from_numpy(array.astype(np.float32, copy=False))
    if array.dtype.kind == "f" and array.dtype.itemsize > 4:  # (only a wider float overflows)
        _refuse_unless_finite(x.numpy(), path, "hold values beyond float32's range, the "
                              "model's input type")
    return x


def _refuse_unless_finite(array: np.ndarray, path: Path, what: str) -> None:
    """Samples with a value that is not finite, counted a block at a time (a copy of a large
    array's flags would double its memory)."""
    if array.dtype.kind not in "fc":
        return
    bad, block = [], 65536
    for start in range(0, len(array), block):
        flags = ~np.isfinite(array[start:start + block].reshape(
            min(block, len(array) - start), -1)).all(1)
        bad += (np.flatnonzero(flags) + start).tolist()
    if bad:
        raise UserError(f"predict.input={path}: {len(bad)} of {len(array)} samples {what} (the "
                        f"first: sample {bad[0]}); the model's labels for them would mean nothing")


def _warn_unless_in_range(x: torch.Tensor, data: DataModule, path: Path) -> None:
    """An array is taken as the model takes its inputs, unscaled: a warning when its values
    lie far outside the validation data's (pixels of 0 to 255, or 0 to 16, where the model saw
    0 to 1): labels that mean nothing, but no error (the values may be right)."""
    low, high, _ = _validation_range(data)
    span = high - low or 1.0
    if float(x.min()) < low - span or float(x.max()) > high + span:
        log.warning("predict.input=%s: values from %.4g to %.4g, far outside the validation "
                    "data's (%.4g to %.4g): the array is taken as the model's input as it is "
                    "(not scaled), so its labels may mean nothing", path, float(x.min()),
                    float(x.max()), low, high)


INVERTED = 0.75  # how far from the validation mean towards its inverse an input mean warns


def _warn_if_inverted(mean: float, data: DataModule, source: str) -> None:
    """Inputs whose mean lies near the validation data's inverted one (low + high - mean of
    its range), or beyond it within the range: digits drawn dark on light where the model saw
    light strokes on dark, labelled wrong at a high confidence. Not for data whose mean lies
    near the middle of its range (inverting it hardly moves the mean: normalised photos), nor
    for inputs out of the range (values unscaled: _warn_unless_in_range)."""
    low, high, usual = _validation_range(data)
    gap = low + high - 2 * usual  # from the usual mean to the inverted one
    if abs(gap) > 0.25 * (high - low) and (mean - usual) / gap > INVERTED \
            and low <= mean <= high:
        usual_look = "light on dark" if gap > 0 else "dark on light"  # (mostly dark: gap > 0)
        look = "dark on light" if gap > 0 else "light on dark"
        fix = f"{low + high:.4g} - x for each value" if source.endswith(".npy") else \
            "255 - each pixel of 8-bit images"
        log.warning("predict.input=%s: the inputs look inverted against the validation data "
                    "(mean %.3g, where the validation data's is %.3g on a range of %.3g to "
                    "%.3g): %s, where the model saw %s; their labels may mean nothing: invert "
                    "them (%s) and predict again", source, mean, usual, low, high, look,
                    usual_look, fix)


@functools.lru_cache(maxsize=1)  # read once per run (an image folder's from disk), for 3 checks
def _validation_range(data: DataModule) -> tuple[float, float, float]:
    """Lowest, highest, mean of 64 validation inputs spread out (the first may be one class)."""
    at = np.unique(np.linspace(0, len(data.val) - 1, 64).round().astype(int)).tolist()
    x = next(iter(DataLoader(Subset(data.val, at), batch_size=64)))[0].double()
    return float(x.min()), float(x.max()), float(x.mean())


Batches = Iterator[tuple[torch.Tensor, torch.Tensor | None]]  # inputs, labels or None


@dataclass
class Inputs:
    """What to predict: a name for each input, and its batches (decoded as they are needed:
    a folder of many photos never sits in memory at once)."""

    names: list[str]
    batches: Callable[[int], Batches]
    files: bool = False  # whether the names are files' (the picture then names them)


def _warn_unless_decoded_as_trained(data: DataModule, source: Path) -> None:
    """A data set of your own without a decode_file: files are read as pixels from 0 to 1,
    which a model trained on normalised inputs misreads without a word (accuracy 0.40 where
    its evaluation said 0.92)."""
    if type(data).decode_file is not DataModule.decode_file:
        return
    low, high, _ = _validation_range(data)
    if low < -0.05 or high > 1.05:
        log.warning("predict.input=%s: %s has no decode_file of its own, so the images are read "
                    "as pixels from 0 to 1, but its validation inputs range from %.3g to %.3g: "
                    "give it a decode_file(path) that prepares an image as the data set does "
                    "(docs/quickstart.md)", source, type(data).__name__, low, high)


def _files(files: list[Path], data: DataModule, source: Path,
           labels: list[int] | None = None) -> Inputs:
    _warn_unless_decoded_as_trained(data, source)
    def batches(size: int) -> Batches:
        for start in range(0, len(files), size):
            x = torch.stack([_decoded(f, data, source) for f in files[start:start + size]])
            yield x, None if labels is None else torch.tensor(labels[start:start + size])

    return Inputs([str(f) for f in files], batches, files=True)


def _images_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if is_image_name(p.name) and p.is_file())


def _images_under(folder: Path) -> list[Path]:
    """The images of a class folder, in its sub-folders too (as data=image_folder takes them;
    hidden ones left out; links to folders not followed: one could lead back up, into the
    other classes)."""
    found = []
    for parent, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [Path(parent, n) for n in names if is_image_name(n)]
    return sorted(found)


def _class_of(name: str, data: DataModule) -> int | None:
    """A class folder's label: its name among the data's classes, or, where the classes have
    no names (digits), a class index."""
    if data.classes is not None:
        return data.classes.index(name) if name in data.classes else None
    return int(name) if name.isascii() and name.isdigit() and int(name) < data.num_classes \
        else None


def _listed(names: list[str], most: int = 12) -> str:
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "")


def _warn_of_class_folders(path: Path, data: DataModule) -> None:
    """A folder with images of its own is predicted as before, its sub-folders left out: said
    when some are class folders of images (taking them too would mix labelled and unlabelled
    inputs, and a sub-folder of other photos, named by no class, would stop the run)."""
    left_out = [d.name for d in sorted(path.iterdir()) if d.is_dir()
                and not d.name.startswith(".") and _class_of(d.name, data) is not None
                and _images_under(d)]
    if left_out:
        log.warning("predict.input=%s: its own images are predicted, unlabelled; its class "
                    "folders (%s) are left out: to have those predicted and scored, move the "
                    "images beside them out, or give a folder of class folders only", path,
                    _listed(left_out))


def _by_class(path: Path, data: DataModule) -> Inputs | None:
    """The images of a folder of class folders, each labelled by its folder (None: no
    sub-folder holds an image)."""
    found = {d.name: _images_under(d) for d in sorted(path.iterdir())
             if d.is_dir() and not d.name.startswith(".")}
    found = {name: files for name, files in found.items() if files}
    if not found:
        return None
    strays = [name for name in found if _class_of(name, data) is None]
    if strays:
        classes = _listed(data.classes) if data.classes is not None else \
            f"the class indices 0 to {data.num_classes - 1}"
        raise UserError(f"predict.input={path}: the sub-folder(s) {_listed(strays)} name no "
                        f"class of the data ({classes}); name each folder of images by their "
                        f"class")
    files = [f for name in found for f in found[name]]
    labels = [_class_of(name, data) for name in found for _ in found[name]]
    return _files(files, data, path, labels)


def _decoded(file: Path, data: DataModule, source: Path) -> torch.Tensor:
    """The image seen as the data set sees its validation images."""
    try:
        x = data.decode_file(file)
    except BadImage as e:
        raise UserError(f"predict.input={source}: {e}; remove or replace it") from None
    except DECODE_ERRORS as e:  # (a data set's own decode_file)
        raise UserError(f"predict.input={source}: {file.name} is not a readable image "
                        f"({first_line(e)}); remove or replace it") from None
    if tuple(x.shape) != tuple(data.input_shape):  # (a data set's own: a matmul error below)
        raise UserError(f"predict.input={source}: {type(data).__name__}.decode_file gave "
                        f"{file.name} the shape {list(x.shape)}; the model takes "
                        f"{list(data.input_shape)} (resize it there, as the data set does)")
    return x


def load_inputs(source: str | None, data: DataModule) -> Inputs:
    """The validation split (through a loader: any map-style data set), a folder of images,
    one image, or a .npy array."""
    if source is None:
        files = getattr(data.val, "files", None)  # (an image folder's: name the file)
        names = [str(f) for f in files] if files else [f"val[{i}]" for i in range(len(data.val))]
        return Inputs(names, lambda size: iter(DataLoader(data.val, batch_size=size)),
                      files=bool(files))
    path = Path(source)
    if path.is_dir():
        files = _images_in(path)
        if files:
            _warn_of_class_folders(path, data)
            return _files(files, data, path)
        labelled = _by_class(path, data)
        if labelled is None:
            raise UserError(f"predict.input={path}: no images "
                            f"({', '.join(sorted(IMAGE_SUFFIXES))}), in it or in sub-folders "
                            f"named by class")
        return labelled
    if path.is_file() and is_image_name(path.name):
        return _files([path], data, path)
    if path.is_file() and path.suffix == ".npy":
        x = _from_npy(path, data.input_shape)
        _warn_unless_in_range(x, data, path)
        return Inputs([f"{path.name}[{i}]" for i in range(len(x))],
                      lambda size: ((batch, None) for batch in x.split(size)))
    if not path.exists():
        raise UserError(f"predict.input={source}: no such file or folder (relative paths are "
                        f"from the folder the command started in)")
    raise UserError(f"predict.input={source}: expected a folder of images, an image or a .npy "
                    f"file")


def _title(name: str, num_shown: int, preds: torch.Tensor, y: torch.Tensor | None) -> str:
    """The picture's title: what it shows of the inputs, where it has no room for them all
    ("best.pt: 32 of 120 inputs, the mistakes first: all 7 wrong (red), 25 of 113 right
    (green); accuracy 94.17%")."""
    total, partly = len(preds), num_shown < len(preds)
    if y is None:
        return f"{name}: the first {num_shown} of {total} inputs" if partly else \
            f"{name}: {total} inputs"
    wrong = int((preds != y).sum())
    counts = []
    for shown, among, what in [(min(wrong, num_shown), wrong, "wrong (red)"),
                               (num_shown - min(wrong, num_shown), total - wrong, "right (green)")]:
        if shown:
            counts.append(f"{shown} of {among} {what}" if shown < among
                          else f"{'all ' if partly else ''}{among} {what}")
    return f"{name}: {f'{num_shown} of ' if partly else ''}{total} inputs" \
        f"{', the mistakes first' if wrong else ''}: {', '.join(counts)}; accuracy " \
        f"{(preds == y).double().mean():.2%}"


@torch.no_grad()
def run_predict(cfg: AppConfig, run_dir: Path, device: torch.device) -> float | None:
    data = build_data(cfg)
    model, _ = build_trained_model(cfg, data)
    model.to(device)
    inputs = load_inputs(cfg.predict.input, data)
    names, probs, targets = inputs.names, [], []
    seen, total, count = 0, 0.0, 0  # inputs so far; the sum and number of their values
    num_show = cfg.predict.num_show
    # The picture's inputs: the first num_show mistakes, then the first right ones (all "right"
    # where no labels say otherwise): at most 2 x num_show kept, however many inputs there are.
    shown = {True: ([], []), False: ([], [])}  # wrong, right: (indices, inputs)
    for x, y in inputs.batches(data.val_batch_size):
        probs.append(model(x.to(device)).softmax(1).cpu())
        targets += [] if y is None else [torch.as_tensor(y)]
        wrong = torch.zeros(len(x), dtype=torch.bool) if y is None \
            else probs[-1].max(1).indices != targets[-1]
        for kind, (indices, kept) in shown.items():
            at = torch.nonzero(wrong == kind).flatten()[:num_show - sum(map(len, indices))]
            indices.append(at + seen)
            kept.append(x[at])
        seen += len(x)
        total, count = total + float(x.double().sum()), count + x.numel()
    if cfg.predict.input is not None:
        _warn_if_inverted(total / count, data, cfg.predict.input)
    confidence, preds = torch.cat(probs).max(1)
    y = torch.cat(targets) if targets else None
    order = torch.cat(shown[True][0] + shown[False][0])[:num_show]
    x = torch.cat(shown[True][1] + shown[False][1])[:num_show]
    table = io.StringIO(newline="")
    writer = csv.writer(table)
    classes = data.classes
    writer.writerow(["index", "input", "pred", "confidence", "label"]
                    + (["pred_class", "label_class"] if classes else []))
    for i, name in enumerate(names):
        label = "" if y is None else int(y[i])
        row = [i, name, int(preds[i]), f"{confidence[i]:.6f}", label]
        if classes:
            row += [classes[int(preds[i])], "" if y is None else classes[label]]
        writer.writerow(row)
    write_text_atomically(run_dir / "predictions.csv", table.getvalue())
    accuracy = None if y is None else (preds == y).double().mean().item()
    save_grid(data.show(x), preds[order].tolist(), None if y is None else y[order].tolist(),
              _title(Path(str(cfg.ckpt)).name, len(order), preds, y),
              run_dir / "predictions.png", classes=classes,
              indices=None if y is None else order.tolist(),
              names=[Path(names[i]).name for i in order] if inputs.files else None)
    log.info("predicted %d inputs -> %s, %s%s", len(names), run_dir / "predictions.csv",
             run_dir / "predictions.png",
             "" if accuracy is None else f"; accuracy {accuracy:.4f}")
    return accuracy
