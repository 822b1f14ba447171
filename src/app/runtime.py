"""Device choice, seeding and the random-number state that checkpoints carry."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from app.config import UserError

log = logging.getLogger(__name__)


def select_device(accelerator: str) -> torch.device:
    if accelerator == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if accelerator == "cpu":
        return torch.device("cpu")
    if accelerator == "cuda":
        if not torch.cuda.is_available():
            raise UserError("accelerator=cuda: no CUDA device is visible; use accelerator=cpu")
        return torch.device("cuda")
    raise UserError(f"accelerator={accelerator}: expected auto, cpu or cuda")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """The global generators' states as tensors and plain types (for weights_only loading)."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state({
        "bit_generator": "MT19937",
        "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
        "has_gauss": n["has_gauss"],
        "gauss": n["gauss"],
    })
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
