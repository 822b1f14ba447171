"""Callbacks: extensions of the training loop chosen by config (`conf/callbacks/`).

The contract is `base.Callback`; `base.Callbacks` calls them from the loop. The built-in ones
are importable from here, so a config names them `app.callbacks.EarlyStopping`.
"""

from app.callbacks.early_stopping import EarlyStopping
from app.callbacks.eval_visuals import EvalVisuals
from app.callbacks.lr_throughput import LRThroughputMonitor
from app.callbacks.model_summary import ModelSummary
from app.training.hooks import Callback, Callbacks, Run

__all__ = ["Callback", "Callbacks", "EarlyStopping", "EvalVisuals", "LRThroughputMonitor",
           "ModelSummary", "Run"]
