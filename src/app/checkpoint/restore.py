"""Loading a checkpoint's state into live objects: a model (sharded by FSDP or not), an
optimizer, and the weights and data state that inference uses. What a checkpoint holds and
its checks are app.checkpoint.layout's."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from app.checkpoint import sharded
from app.checkpoint.layout import TrainedAt, inference_weights, load, shape, trained_at
from app.errors import UserError

if TYPE_CHECKING:
    from app.data import DataModule

log = logging.getLogger(__name__)

def load_for_inference(model: torch.nn.Module, data: DataModule, path: str | Path
                       ) -> TrainedAt:
    """Give `model` the weights of the checkpoint at `path` that validation used (the EMA's
    when the run kept one), and `data` what it learnt in that training (so inputs are seen as
    training saw them); returns where in its training the checkpoint was written."""
    state = load(path)
    data.load_state_dict(state.get("data") or {})  # first: other classes are named as such
    data.prepare()  # (what a checkpoint without the data's state leaves to learn)
    load_model_weights(model, state, path, weights=inference_weights(state))
    return trained_at(state)


def load_model_weights(model: torch.nn.Module, state: dict[str, Any], path: str | Path,
                       strict: bool = True, weights: dict[str, Any] | None = None,
                       fine_tuning: bool = False) -> None:
    """Load a checkpoint's model weights, naming every mismatch if they do not fit.

    `strict=False` (fine-tuning a changed model): load the weights whose names and shapes
    match and report the others. `fine_tuning`: the load is `ckpt=` of training, where
    `ckpt_strict=false` is the way to a changed model, so a mismatch points to it.
    """
    ours = model.state_dict()
    theirs = state["model"] if weights is None else weights
    missing = sorted(set(ours) - set(theirs))
    unexpected = sorted(set(theirs) - set(ours))
    wrong_shape = [
        f"{k} {shape(theirs[k])} vs {shape(ours[k])}"
        for k in sorted(set(ours) & set(theirs))
        if shape(theirs[k]) != shape(ours[k])
    ]
    if not strict:
        fitting = {k: v for k, v in theirs.items() if k in ours and shape(v) == shape(ours[k])}
        loaded = len(fitting)  # (a sharded model's load fills the dict in)
        sharded.load_full_weights(model, fitting, strict=False)
        skipped = missing + unexpected + wrong_shape
        log.info("loaded %d of %d weights from %s%s", loaded, len(ours), path,
                 f"; skipped: {', '.join(skipped)}" if skipped else "")
        return
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
    sharded.load_full_weights(model, theirs)


def check_same_optimizer(state: dict[str, Any], path: str | Path, current: dict[str, Any]
                         ) -> None:
    """A checkpoint of another optimizer class is an error naming both."""
    trained = ((state.get("config") or {}).get("optimizer") or {}).get("_target_")
    if trained not in (None, current.get("_target_")):
        raise UserError(
            f"checkpoint {path} was trained with optimizer {trained}, this run has "
            f"{current.get('_target_')}: resume with the same optimizer, or start a new "
            f"schedule from its weights with ckpt={path} resume=null")


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         state: dict[str, Any], path: str | Path, current: dict[str, Any]
                         ) -> None:
    """Resume the optimizer; a checkpoint of another optimizer is an error naming both."""
    check_same_optimizer(state, path, current)
    trained = (state.get("config") or {}).get("optimizer") or {}
    try:
        sharded.load_full_optimizer(model, optimizer, state["optimizer"])
    except (ValueError, KeyError, RuntimeError) as e:
        raise UserError(
            f"checkpoint {path}: its optimizer state does not fit this run's optimizer ({e}). "
            f"It was trained with optimizer={trained}, this run has optimizer={dict(current)}; "
            f"resume with the same settings, or start a new schedule from its weights with "
            f"ckpt={path} resume=null") from e
