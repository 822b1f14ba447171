"""A window of training steps traced with torch.profiler: a trace to open in Perfetto or
TensorBoard, and the top operators in the log."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from app import dist
from app.checks import whole
from app.errors import UserError
from app.training.hooks import Callback, Run

log = logging.getLogger(__name__)

PERFETTO = "https://ui.perfetto.dev"


class Profiler(Callback):
    """Traces steps wait+warmup+1 .. wait+warmup+active of the run, numbered from its start as
    the log numbers them (a resumed run traces what is left of the window), on the ranks
    asked for, into `profile/rank{N}.pt.trace.json` of the run: a Chrome trace, which Perfetto
    opens and whose name TensorBoard's profiler plugin looks for. Each step in it is marked
    `ProfilerStep#N`, N the run's step. When the window ends, the `top` operators by self
    time (CUDA's on a GPU, else the CPU's) are logged.

    The profiler exists only from the first warm-up step to the end of the window: before and
    after it, a step costs one comparison here."""

    every_rank = True  # each traced rank writes its own trace

    def __init__(self, wait: int = 10, warmup: int = 2, active: int = 3, ranks: Any = 0,
                 top: int = 10) -> None:
        self.wait = whole("wait", wait, 0)
        self.warmup = whole("warmup", warmup, 0)
        active = whole("active", active, 1)
        self.top = whole("top", top, 0)
        self.ranks = _ranks(ranks)
        # The steps traced, as the log counts them (step N: the N-th optimizer step).
        self.first, self.last = self.wait + self.warmup + 1, self.wait + self.warmup + active
        self._start_after: int | None = None  # the steps done when the profiler starts
        self._prof: profile | None = None

    def on_train_start(self, run: Run) -> None:
        if self.ranks is not None and dist.rank() not in self.ranks:
            return
        window = f"steps {self.first}-{self.last}"
        if run.step >= self.last:
            log.info("profiler: the run resumed at step %d, after the window (%s): nothing "
                     "traced", run.step, window)
            return
        if run.total_steps < self.first:
            log.info("profiler: the run has %d steps, fewer than the window (%s) needs: "
                     "nothing traced; lower callbacks.profiler.wait", run.total_steps, window)
            return
        short = (f" (the run ends at step {run.total_steps}, inside the window {window})"
                 if run.total_steps < self.last else "")
        self.first, self.last = max(self.first, run.step + 1), min(self.last, run.total_steps)
        log.info("profiler: tracing steps %d-%d on rank %d%s", self.first, self.last,
                 dist.rank(), short)
        self._start_after = max(self.wait, run.step)
        if self._start_after == run.step:
            self._start(run)

    def on_step_end(self, run: Run, step: int, loss: torch.Tensor) -> None:
        if self._prof is None:
            if step == self._start_after:
                self._start(run)
            return
        if step == self.first - 1:  # the warm-up is over
            self._active_since = time.perf_counter()
        self._prof.step()  # (after the window's last step, this writes the trace)
        if step == self.last:
            self._prof.stop()
            self._prof = None

    def on_train_end(self, run: Run, error: BaseException | None) -> None:
        if self._prof is None:
            return
        # Stopped inside the window (early stopping, a signal, an error): what was traced.
        prof, self._prof = self._prof, None
        if run.step < self.first:
            log.info("profiler: the run stopped at step %d, in the warm-up: nothing traced",
                     run.step)
        self.last = run.step
        prof.stop()  # (writes the trace when the window's active steps had begun)

    def _start(self, run: Run) -> None:
        done = run.step
        warmup = self.first - 1 - done
        window = schedule(wait=0, warmup=warmup, active=self.last - done - warmup, repeat=1)
        self._cuda = run.device.type == "cuda"
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self._cuda else [])]
        self._path = run.run_dir / "profile" / f"rank{dist.rank()}.pt.trace.json"
        # The profiler counts its steps from done + 1, so that ProfilerStep#N is the run's
        # step N; its constructor asks the schedule about step 0, hence the max.
        self._prof = profile(activities=activities, on_trace_ready=self._write,
                             schedule=lambda n: window(max(n - done - 1, 0)))
        self._prof.step_num = done + 1
        self._active_since = time.perf_counter()
        self._prof.start()

    def _write(self, prof: profile) -> None:
        per_step = (time.perf_counter() - self._active_since) / (self.last - self.first + 1)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self._path))
        log.info("profiler: steps %d-%d took %.3f s/step under the profiler; trace %s "
                 "(%.1f MB), to open in %s", self.first, self.last, per_step, self._path,
                 self._path.stat().st_size / 2**20, PERFETTO)
        if self.top:
            log.info("profiler: top %d operators of steps %d-%d on rank %d:\n%s", self.top,
                     self.first, self.last, dist.rank(), top_table(prof, self.top, self._cuda))


def top_table(prof: profile, rows: int, cuda: bool) -> str:
    """The `rows` operators with the most self time (CUDA's when `cuda`), the step markers
    left out: name, calls, self milliseconds and share of all the self time."""
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    columns = [("CUDA", "self_device_time_total")] if cuda else []
    columns.append(("CPU", "self_cpu_time_total"))
    events.sort(key=lambda e: getattr(e, columns[0][1]), reverse=True)
    totals = {attr: sum(getattr(e, attr) for e in events) or 1 for _, attr in columns}
    shown = events[:rows]
    width = max(len("operator"), *(len(e.key) for e in shown)) + 2
    lines = [f"{'operator':<{width}}{'calls':>6}"
             + "".join(f"{f'self {name} ms':>16}{'%':>7}" for name, _ in columns)]
    for e in shown:
        lines.append(f"{e.key:<{width}}{e.count:>6}" + "".join(
            f"{getattr(e, attr) / 1e3:>16.3f}{100 * getattr(e, attr) / totals[attr]:>7.1f}"
            for _, attr in columns))
    return "\n".join(lines)


def _ranks(value: Any) -> frozenset[int] | None:
    """The ranks to trace, None for all of them."""
    if value == "all":
        return None
    items = [value] if isinstance(value, int) else value
    if (isinstance(items, str) or not isinstance(items, Sequence) or not items
            or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in items)):
        raise UserError(f"ranks={value}: expected a rank (0), a list of ranks ([0,1]) or all")
    world = dist.world_size()
    if missing := [r for r in items if r >= world]:
        raise UserError(f"ranks={value}: the run has {world} rank(s), 0 to {world - 1}; "
                        f"there is no rank {missing[0]}")
    return frozenset(items)
