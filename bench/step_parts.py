"""Where a step of the app's loop goes: the app's loop alone, its parts timed one by one.

Each timed part is bracketed by device syncs (on a GPU), so a part's time includes the device
work it queued, and the parts add up to the loop's time: the train step (forward, backward,
update), the check of the previous step's loss, a logging step's report (the loss read back, the
callbacks' on_log, a row of metrics.csv, the log line), a validation, a checkpoint save, and
what is left (the batch from the loader, the loop's own bookkeeping). On the step ratio's
GPU (bench/gpu_steps.py) this says what a ratio above 1 comes from; no assertion on time.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import step_overhead
import torch

from app.checkpoint.manager import CheckpointManager
from app.training import loop
from app.training.step import FiniteLosses, TrainStep

# (owner, attribute, label): what the loop calls, looked up where the loop looks it up.
PARTS = [
    (TrainStep, "__call__", "train step"),
    (FiniteLosses, "check", "loss check"),
    (loop._Report, "train", "logging step"),
    (loop, "validate", "validation"),
    (CheckpointManager, "save", "checkpoint save"),
]


def measure(app_overrides: list[str], run_dir: Path, device: str = "cpu"
            ) -> tuple[int, float, dict[str, tuple[int, float]]]:
    """The app's loop alone: its steps, its seconds, and per part (calls, seconds)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)

    def timed(fn: Callable, label: str) -> Callable:
        def run(*args, **kwargs):
            sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                spans[label].append((start, time.perf_counter()))
        return run

    cfg = step_overhead._app_config(app_overrides)
    step_overhead._logging_as_hydra(run_dir)
    with ExitStack() as patches:
        for owner, name, label in PARTS:
            patches.enter_context(mock.patch.object(owner, name, timed(getattr(owner, name),
                                                                       label)))
        loop.train(cfg, run_dir, torch.device(device))
    # From the first step's start to the last timed part's end: not the set-up before the
    # loop, nor the curves drawn after it.
    first = spans["train step"][0][0]
    last = max(end for calls in spans.values() for _, end in calls)
    return len(spans["train step"]), last - first, {
        label: (len(calls), sum(end - start for start, end in calls))
        for label, calls in spans.items()}


def table(steps: int, total: float, parts: dict[str, tuple[int, float]]) -> str:
    """Markdown: per part, its calls, ms per call and ms per optimizer step."""
    rows = ["| part | calls | ms per call | ms per step |", "|---|---|---|---|"]
    for label, (calls, seconds) in parts.items():
        rows.append(f"| {label} | {calls} | {seconds / calls * 1e3:.3f} | "
                    f"{seconds / steps * 1e3:.3f} |")
    rest = total - sum(seconds for _, seconds in parts.values())
    rows.append(f"| the rest (batches, the loop's own work) | | | {rest / steps * 1e3:.3f} |")
    rows.append(f"| **all** | {steps} steps | | {total / steps * 1e3:.3f} |")
    return "\n".join(rows)
