"""The model's size at the start of training."""

from __future__ import annotations

import logging

from app.checks import whole
from app.training.hooks import Callback, Run

log = logging.getLogger(__name__)


class ModelSummary(Callback):
    """Logs the parameter counts and the weights' size; depth=1 adds a row per top-level
    module."""

    def __init__(self, depth: int = 0) -> None:
        self.depth = whole("depth", depth, 0)

    def on_train_start(self, run: Run) -> None:
        model = run.model
        total = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        log.info("model %s: %s parameters (%s trainable), %.2f MB of weights",
                 run.cfg.model["_target_"], f"{total:,}", f"{trainable:,}", size / 2**20)
        if self.depth >= 1:
            from app.training.build import model_summary

            log.info("model summary:\n%s", model_summary(model))
