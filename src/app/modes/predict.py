"""`trainer=predict` (the older systems' demo): labels for validation samples or your own files.

Inputs: the validation split (default), a `.npy` array of shape (N, H, W) or (N, C, H, W) of
inputs as the model takes them (0 to 1 for digits; normalised for an image folder), or a
folder of images, each seen as the data set sees its validation images (`decode_file`: the
same decoding, view and normalisation). The pictures show inputs as they are (`show`).
"""

from __future__ import annotations

import csv
import io
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

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
    seen = next(iter(DataLoader(data.val, batch_size=64)))[0]
    low, high = float(seen.min()), float(seen.max())
    span = high - low or 1.0
    if float(x.min()) < low - span or float(x.max()) > high + span:
        log.warning("predict.input=%s: values from %.4g to %.4g, far outside the validation "
                    "data's (%.4g to %.4g): the array is taken as the model's input as it is "
                    "(not scaled), so its labels may mean nothing", path, float(x.min()),
                    float(x.max()), low, high)


Batches = Iterator[tuple[torch.Tensor, torch.Tensor | None]]  # inputs, labels or None


@dataclass
class Inputs:
    """What to predict: a name for each input, and its batches (decoded as they are needed:
    a folder of many photos never sits in memory at once)."""

    names: list[str]
    batches: Callable[[int], Batches]


def _files(files: list[Path], data: DataModule, source: Path) -> Inputs:
    def batches(size: int) -> Batches:
        for start in range(0, len(files), size):
            yield torch.stack([_decoded(f, data, source) for f in files[start:start + size]]), None

    return Inputs([str(f) for f in files], batches)


def _decoded(file: Path, data: DataModule, source: Path) -> torch.Tensor:
    """The image seen as the data set sees its validation images."""
    try:
        return data.decode_file(file)
    except BadImage as e:
        raise UserError(f"predict.input={source}: {e}; remove or replace it") from None
    except DECODE_ERRORS as e:  # (a data set's own decode_file)
        raise UserError(f"predict.input={source}: {file.name} is not a readable image "
                        f"({first_line(e)}); remove or replace it") from None


def load_inputs(source: str | None, data: DataModule) -> Inputs:
    """The validation split (through a loader: any map-style data set), a folder of images,
    one image, or a .npy array."""
    if source is None:
        files = getattr(data.val, "files", None)  # (an image folder's: name the file)
        names = [str(f) for f in files] if files else [f"val[{i}]" for i in range(len(data.val))]
        return Inputs(names, lambda size: iter(DataLoader(data.val, batch_size=size)))
    path = Path(source)
    if path.is_dir() or path.is_file() and is_image_name(path.name):
        files = sorted(p for p in path.iterdir() if is_image_name(p.name) and p.is_file()) \
            if path.is_dir() else [path]
        if not files:
            raise UserError(f"predict.input={path}: no images "
                            f"({', '.join(sorted(IMAGE_SUFFIXES))})")
        return _files(files, data, path)
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


@torch.no_grad()
def run_predict(cfg: AppConfig, run_dir: Path, device: torch.device) -> float | None:
    data = build_data(cfg)
    model, _ = build_trained_model(cfg, data)
    model.to(device)
    inputs = load_inputs(cfg.predict.input, data)
    names, probs, targets, drawn = inputs.names, [], [], []
    for x, y in inputs.batches(data.val_batch_size):
        probs.append(model(x.to(device)).softmax(1).cpu())
        targets += [] if y is None else [torch.as_tensor(y)]
        drawn.append(x[:max(0, cfg.predict.num_show - sum(map(len, drawn)))])
    confidence, preds = torch.cat(probs).max(1)
    y = torch.cat(targets) if targets else None
    x = torch.cat(drawn)  # (the first predict.num_show inputs: the picture's)
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
    labels = None if y is None else y[:len(x)].tolist()
    accuracy = None if y is None else (preds == y).double().mean().item()
    title = f"{Path(str(cfg.ckpt)).name}: {len(names)} inputs" + (
        "" if accuracy is None else f", accuracy {accuracy:.2%} (green right, red wrong)")
    save_grid(data.show(x), preds[:len(x)].tolist(), labels, title,
              run_dir / "predictions.png", classes=data.classes)
    log.info("predicted %d inputs -> %s, %s%s", len(names), run_dir / "predictions.csv",
             run_dir / "predictions.png",
             "" if accuracy is None else f"; accuracy {accuracy:.4f}")
    return accuracy
