"""The global random generators' state (Python, NumPy, torch, CUDA) that a checkpoint carries
for each rank, so that a resumed run draws what the uninterrupted one would have."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from app import dist

log = logging.getLogger(__name__)


class RandomStates:
    """The part of a checkpoint (torch's Stateful) that holds every rank's generators, by
    rank: `state_dict` gathers them (every rank calls it), a load sets this rank's."""

    def state_dict(self) -> list[dict[str, Any]]:
        return dist.all_gather_object(rng_state())

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        if len(states) == dist.world_size():
            set_rng_state(states[dist.rank()])
        else:
            log.warning("checkpoint has random states of %d ranks, this run has %d: the run "
                        "continues, but not bit-identically", len(states), dist.world_size())


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
