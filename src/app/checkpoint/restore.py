"""A checkpoint's weights against a model: every mismatch named, or the weights that fit
loaded."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from app.checkpoint.layout import TrainedAt, load, shape
from app.errors import UserError

if TYPE_CHECKING:
    from app.data import DataModule

log = logging.getLogger(__name__)


def load_for_inference(model: torch.nn.Module, data: DataModule, path: str | Path
                       ) -> TrainedAt:
    """Give `model` the weights of the checkpoint at `path` that validation used, and `data`
    what it learnt in that training; returns where in its training the checkpoint was written."""
    state = load(path)
    data.load_state_dict(state.get("data") or {})  # first: other classes are named as such
    data.prepare()  # (what a checkpoint without the data's state leaves to learn)
    ema = (state.get("train_step") or {}).get("ema")  # (its weights validated, when kept)
    load_model_weights(model, state, path, weights=ema["module"] if ema else None)
    loop = state.get("loop") or {}  # (a weights-only file has no loop record)
    return TrainedAt(loop.get("step", 0), loop.get("epoch", 0))


def load_model_weights(model: Any, state: dict[str, Any], path: str | Path, strict: bool = True,
                       weights: dict[str, Any] | None = None, fine_tuning: bool = False) -> None:
    """Load a checkpoint's model weights into `model` (a module, or a part such as
    app.checkpoint.sharded.Weights), or name every mismatch (`fitting`)."""
    theirs = state["model"] if weights is None else weights
    model.load_state_dict(fitting(model.state_dict(), theirs, state, path, strict, fine_tuning),
                          strict=strict)


def fitting(ours: dict[str, Any], theirs: dict[str, Any], state: dict[str, Any],
            path: str | Path, strict: bool = True, fine_tuning: bool = False) -> dict[str, Any]:
    """The weights `theirs` of a checkpoint (`state`) that fit a model's, `ours`: all of them,
    or an error naming every mismatch; `strict=False`, those whose names and shapes match.
    `fine_tuning` (`ckpt=` of training): a mismatch points to `ckpt_strict=false`."""
    missing = sorted(set(ours) - set(theirs))
    unexpected = sorted(set(theirs) - set(ours))
    wrong_shape = [
        f"{k} {shape(theirs[k])} vs {shape(ours[k])}"
        for k in sorted(set(ours) & set(theirs))
        if shape(theirs[k]) != shape(ours[k])
    ]
    if not strict:
        fits = {k: v for k, v in theirs.items() if k in ours and shape(v) == shape(ours[k])}
        skipped = missing + unexpected + wrong_shape
        log.info("loaded %d of %d weights from %s%s", len(fits), len(ours), path,
                 f"; skipped: {', '.join(skipped)}" if skipped else "")
        return fits
    if missing or unexpected or wrong_shape:
        config = state.get("config") or {}
        trained = f"model={config.get('model') or {}}"
        # The model's input and head follow the data (its shape and classes): a checkpoint
        # of the same model on other data differs there.
        data = {k: v for k, v in (config.get("data") or {}).items()
                if k in ("_target_", "root", "input_shape", "image_size", "channels",
                         "num_classes")}
        if data:
            trained += f" on data={data}"
        advice = ("to fine-tune it on this model (a new head for another num_classes), add "
                  "ckpt_strict=false: the weights that fit are loaded, the others start fresh"
                  ) if fine_tuning else "use the same model and data settings"
        parts = [
            f"{label}: {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}"
            for label, items in (
                ("missing", missing), ("unexpected", unexpected), ("shape", wrong_shape))
            if items
        ]
        raise UserError(
            f"checkpoint {path} does not match the model ({'; '.join(parts)}). "
            f"It was trained with {trained}; {advice}"
        )
    return theirs

