"""Exponential moving average of the model weights (the YOLOX-style `ema`, switchable)."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from app.checkpoint.sharded import load_weights


class ModelEMA:
    """EMA weights with a warm-up ramp: the decay grows from 0 towards `decay`, so that the
    average is not dominated by the random initial weights. Updated every optimizer step."""

    def __init__(self, model: nn.Module, decay: float, warmup_steps: int) -> None:
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay, self.warmup_steps = decay, warmup_steps
        self.updates = 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        d = self.decay * (1 - math.exp(-self.updates / self.warmup_steps))
        ours = self.module.state_dict()
        for name, value in model.state_dict().items():
            if value.dtype.is_floating_point:
                ours[name].lerp_(value.detach(), 1 - d)
            else:
                ours[name].copy_(value)  # integer buffers (batch-norm counters)

    def state_dict(self) -> dict[str, Any]:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_weights(self.module, state["module"])
        self.updates = state["updates"]
