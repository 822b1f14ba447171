"""Callbacks: extensions of the training loop chosen by config (`conf/callbacks/`).

The contract is `base.Callback`; `base.Callbacks` calls them from the loop. The built-in ones
are importable from here, so a config names them `app.callbacks.EarlyStopping`.
"""

from app.callbacks.base import Callback, Callbacks, Run
from app.callbacks.early_stopping import EarlyStopping
from app.callbacks.eval_visuals import EvalVisuals
from app.callbacks.lr_throughput import LRThroughputMonitor
from app.callbacks.model_summary import ModelSummary

__all__ = ["Callback", "Callbacks", "EarlyStopping", "EvalVisuals", "LRThroughputMonitor",
           "ModelSummary", "Run"]
