"""`trainer=predict` (the older systems' demo): labels for validation samples or your own files.

Inputs: the validation split (default), a `.npy` array of shape (N, H, W) or (N, C, H, W) with
values scaled like the data set (0 to 1 for digits), or a folder of images, which are turned
grey (or RGB for 3-channel models), resized to the model's input and scaled to 0 to 1.
"""

from __future__ import annotations

import csv
import io
import logging
from pathlib import Path

import numpy as np
import torch

from app.config import AppConfig
from app.data import DataModule
from app.errors import UserError
from app.files import write_text_atomically
from app.reporting.grids import save_grid
from app.training.build import build_data, build_trained_model

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff"}


def _from_npy(path: Path, shape: tuple[int, ...]) -> torch.Tensor:
    try:
        array = np.load(path, allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:  # a pickle, an empty or truncated file
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
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
    return torch.from_numpy(array.astype(np.float32))


def _from_folder(path: Path, shape: tuple[int, ...]) -> tuple[torch.Tensor, list[str]]:
    from PIL import Image

    if len(shape) != 3 or shape[0] not in (1, 3):
        raise UserError(f"predict.input={path}: image folders need a 1- or 3-channel image model")
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise UserError(f"predict.input={path}: no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    channels, height, width = shape
    arrays = []
    for file in files:
        try:
            with Image.open(file) as image:  # decodes on convert: a truncated file fails there
                image = image.convert("L" if channels == 1 else "RGB").resize((width, height))
                array = np.asarray(image, dtype=np.float32) / 255.0
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"predict.input={path}: {file.name} is not a readable image "
                            f"({reason}); remove or replace it") from None
        arrays.append(array[None] if channels == 1 else array.transpose(2, 0, 1))
    return torch.from_numpy(np.stack(arrays)), [str(f) for f in files]


def load_inputs(
    source: str | None, data: DataModule
) -> tuple[torch.Tensor, torch.Tensor | None, list[str]]:
    """(inputs, labels or None, a name for each input)."""
    if source is None:
        x, y = data.val.tensors
        return x, y, [f"val[{i}]" for i in range(len(y))]
    path = Path(source)
    if path.is_dir():
        x, names = _from_folder(path, data.input_shape)
        return x, None, names
    if path.is_file() and path.suffix == ".npy":
        x = _from_npy(path, data.input_shape)
        return x, None, [f"{path.name}[{i}]" for i in range(len(x))]
    raise UserError(f"predict.input={source}: expected a folder of images or a .npy file")


@torch.no_grad()
def run_predict(cfg: AppConfig, run_dir: Path, device: torch.device) -> float | None:
    data = build_data(cfg)
    model, _ = build_trained_model(cfg, data)
    model.to(device)
    x, y, names = load_inputs(cfg.predict.input, data)
    probs = torch.cat([
        model(batch.to(device)).softmax(1).cpu() for batch in x.split(data.val_batch_size)])
    confidence, preds = probs.max(1)
    table = io.StringIO(newline="")
    writer = csv.writer(table)
    writer.writerow(["index", "input", "pred", "confidence", "label"])
    for i, name in enumerate(names):
        label = "" if y is None else int(y[i])
        writer.writerow([i, name, int(preds[i]), f"{confidence[i]:.6f}", label])
    write_text_atomically(run_dir / "predictions.csv", table.getvalue())
    shown = min(cfg.predict.num_show, len(x))
    labels = None if y is None else y[:shown].tolist()
    accuracy = None if y is None else (preds == y).double().mean().item()
    title = f"{Path(str(cfg.ckpt)).name}: {len(x)} inputs" + (
        "" if accuracy is None else f", accuracy {accuracy:.2%} (green right, red wrong)")
    save_grid(x[:shown], preds[:shown].tolist(), labels, title, run_dir / "predictions.png")
    log.info("predicted %d inputs -> %s, %s%s", len(x), run_dir / "predictions.csv",
             run_dir / "predictions.png",
             "" if accuracy is None else f"; accuracy {accuracy:.4f}")
    return accuracy
