"""Step-time probe for the benchmarks, loaded by every Python process whose PYTHONPATH has
this folder (so also by launcher workers and forkserver children).

With APP_PROBE_DIR set, it registers torch's global optimizer-step post hook as soon as
`torch.optim.optimizer` is imported (never importing torch itself, which would move the
start-up being measured), and records the wall time of each optimizer step's end. The
records go to APP_PROBE_DIR/<rank>-<pid>.json after the first step and after APP_PROBE_STEPS
steps. With APP_PROBE_EXIT=1 the process ends right after its first step (start-up runs).
At exit, the process's peak resident memory (VmHWM: of this program alone, not of the
process it was started from) goes to APP_PROBE_DIR/peak-<pid>.json.
The app and the plain loop are measured by this same probe.
"""

import atexit
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

_DIR = os.environ.get("APP_PROBE_DIR")
_STEPS = int(os.environ.get("APP_PROBE_STEPS", "0"))
_EXIT = os.environ.get("APP_PROBE_EXIT") == "1"
_times: list[float] = []


def _vm_hwm_mb() -> float | None:
    try:
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) / 1024
    except (OSError, StopIteration):
        return None


def _dump() -> None:
    rank = os.environ.get("RANK", "0")
    # The peak so far goes with the step times: a worker of a multiprocessing pool ends
    # without running atexit, so this is where a rank's peak is seen.
    with open(os.path.join(_DIR, f"{rank}-{os.getpid()}.json"), "w") as f:
        json.dump({"rank": int(rank), "pid": os.getpid(), "times": _times,
                   "peak_mb": _vm_hwm_mb()}, f)


def _after_step(optimizer, args, kwargs) -> None:
    _times.append(time.time())
    if len(_times) in (1, _STEPS):
        _dump()
    if _EXIT:
        os._exit(0)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.optim.optimizer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.register_optimizer_step_post_hook(_after_step)

        spec.loader.exec_module = exec_module
        return spec


def _peak() -> None:
    mb = _vm_hwm_mb()
    if mb is None:
        return
    with open(os.path.join(_DIR, f"peak-{os.getpid()}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "peak_mb": mb}, f)


if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    sys.meta_path.insert(0, _Finder())
    atexit.register(_peak)
