"""Where the start-up of `python -m app` goes: runs the app as `python -m app` would, with
marks at the big stages, and prints them as JSON (seconds since the process started).

    python bench/timeline.py trainer.max_steps=1
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import runpy
import sys
import time


def _process_start() -> float:
    """Wall time at which this process started (Linux), else now."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


START = _process_start()
marks: list[tuple[str, float]] = []


def mark(what: str) -> None:
    marks.append((what, time.time() - START))


class _Timed(importlib.abc.MetaPathFinder):
    """Marks the start and end of the import of some modules, and patches some on import."""

    def __init__(self, names: set[str], patch: dict) -> None:
        self.names, self.patch = names, patch

    def find_spec(self, name, path, target=None):
        if name not in self.names and name not in self.patch:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            if name in self.names:
                mark(f"import {name} begins")
            run(module)
            if name in self.names:
                mark(f"import {name} ends")
            if name in self.patch:
                self.patch[name](module)

        spec.loader.exec_module = exec_module
        return spec


def _wrap(owner, attr: str, label: str) -> None:
    inner = getattr(owner, attr)

    def wrapped(*args, **kwargs):
        mark(f"{label} begins")
        try:
            return inner(*args, **kwargs)
        finally:
            mark(f"{label} ends")

    setattr(owner, attr, wrapped)


def _patch_hydra(module) -> None:
    _wrap(module.Hydra, "compose_config", "compose")


def _patch_train(module) -> None:
    for name in ("build_data", "build_model", "build_optimizer"):
        _wrap(module, name, name)


def _patch_optimizer(module) -> None:
    def first_step(optimizer, args, kwargs) -> None:
        if not any(label == "first step ends" for label, _ in marks):
            mark("first step ends")
            print(json.dumps(marks), file=sys.__stderr__, flush=True)
            os._exit(0)  # the start-up is measured; nothing after it matters here

    module.register_optimizer_step_post_hook(first_step)


mark("interpreter ready")
sys.meta_path.insert(0, _Timed({"torch", "hydra", "torch._dynamo"}, {
    "hydra._internal.hydra": _patch_hydra, "app.training.loop": _patch_train,
    "torch.optim.optimizer": _patch_optimizer}))
sys.argv = ["app", *sys.argv[1:]]
runpy.run_module("app", run_name="__main__", alter_sys=True)
