"""Where a run's time and memory go (`trainer.telemetry=true`): each rank's step time broken
into data wait, compute (forward and backward up to the last gradient), the wait for the
gradients' all-reduce, optimizer and checkpoint stall; throughput and MFU; peak memory. Read
at logging steps only: on a GPU the marks are CUDA events read back once they are done, never
a synchronisation per step.

Why the wait is measured apart: DDP's all-reduce evens out the ranks' step times (every rank
waits for the slowest at the end of its backward), so a slow rank is the one with the most
time *before* the collective, not the longest step. `logs/steps.csv` keeps every rank's
breakdown per logging step; `logs/telemetry.json` the run's roll-up (app.status and the sweep
summary name its slowest rank).
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import resource
import socket
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from app import dist
from app.reporting.breakdown import draw_breakdown

log = logging.getLogger(__name__)

# Seconds per optimizer step, per rank (the columns of logs/steps.csv after step, rank, host).
SECTIONS = ("data_s", "compute_s", "wait_s", "optimizer_s", "checkpoint_s")
# Dense bf16/fp16 tensor-core peak FLOP/s per device, from the vendors' data sheets (without
# sparsity), by a part of torch.cuda.get_device_name(); `trainer.peak_flops` for any other.
# The words of a key must all be words of the name ("L4" is not an "L40"'s).
PEAK_FLOPS = {"H200": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12,
              "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12, "V100": 125e12,
              "T4": 65e12, "MI300X": 1307e12}
MB = 2**20


def peak_flops(device: torch.device, given: float | None) -> float | None:
    """The device's peak FLOP/s: `trainer.peak_flops`, else the table's (None: unknown)."""
    if given is not None or device.type != "cuda":
        return given
    return peak_of(torch.cuda.get_device_name(device))


def peak_of(name: str) -> float | None:
    words = set(name.replace("-", " ").split())
    return next((peak for key, peak in PEAK_FLOPS.items() if set(key.split()) <= words), None)


def flops_per_batch(model: nn.Module, input_shape: tuple[int, ...], batch_size: int,
                    num_classes: int) -> int | None:
    """FLOPs of one training forward and backward of a batch, counted once with PyTorch's
    FLOP counter on meta tensors: the model's own weights, buffers and random states are not
    touched, so a run counts the same with and without it. None when the model cannot run on
    meta tensors (what it does then is logged)."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with torch.random.fork_rng(devices=[]):
            meta = {name: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
                    for name, t in [*model.named_parameters(), *model.named_buffers()]}
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                         torch.float32)
            x = torch.empty(batch_size, *input_shape, device="meta", dtype=dtype)
            y = torch.zeros(batch_size, dtype=torch.long, device="meta")
            with FlopCounterMode(display=False) as counter:
                out = torch.func.functional_call(model, meta, (x,))
                F.cross_entropy(out.float(), y % max(1, num_classes)).backward()
        return int(counter.get_total_flops())
    except Exception as e:  # (any model of a user's: MFU is then left out, the run goes on)
        log.warning("telemetry: the FLOPs of a step were not counted (%s): no MFU",
                    f"{type(e).__name__}: {e}".splitlines()[0])
        return None


class _Marks:
    """Named points of one step: host times, or CUDA events read once they are done."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.points: dict[str, Any] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points[name] = event
        else:
            self.points[name] = time.perf_counter()

    def done(self) -> bool:
        return not self.cuda or all(e.query() for e in self.points.values())

    def between(self, a: str, b: str) -> float:
        if a not in self.points or b not in self.points:
            return 0.0
        if self.cuda:
            return self.points[a].elapsed_time(self.points[b]) / 1e3
        return self.points[b] - self.points[a]

    def sections(self) -> list[float]:
        grads = "grads" if "grads" in self.points else "backward"
        return [self.between("start", "data"), self.between("data", grads),
                self.between(grads, "backward"), self.between("backward", "optimizer"),
                self.between("checkpoint", "checkpointed")]


class Telemetry:
    """The loop's and the train step's marks (`mark`), read at logging steps (`read`)."""

    def __init__(self, run_dir: Path, device: torch.device, global_batch: int,
                 flops_per_step: int | None, peak: float | None) -> None:
        self.run_dir, self.device = run_dir, device
        self.cuda = device.type == "cuda"
        self.global_batch, self.flops_per_step, self.peak = global_batch, flops_per_step, peak
        self.step_marks = _Marks(self.cuda)
        self.pending: list[_Marks] = []  # steps whose marks are not read yet
        self.sums, self.steps = [0.0] * len(SECTIONS), 0
        self.since, self.since_step = time.perf_counter(), 0
        self.hosts = dist.all_gather_object(socket.gethostname())
        # Seconds before the collective, per rank, over the run: from the attempts before this
        # one too (a resumed or requeued run) when they had as many ranks.
        self.busy = _saved_busy(run_dir, dist.world_size()) or [0.0] * dist.world_size()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)

    # -- marks, from the loop and the train step ----------------------------------------------

    def begin(self, step: int) -> None:
        """Training starts (or resumes) at `step`: the throughput counts from here."""
        self.since, self.since_step = time.perf_counter(), step

    def mark(self, name: str) -> None:
        self.step_marks.mark(name)

    def watch_gradients(self, model: nn.Module) -> None:
        """Mark when the last gradient of a backward is computed: after it the rank waits for
        the all-reduce of the last bucket. (A model sharded by FSDP computes its gradients on
        gathered parameters, which this does not see: its wait is counted as compute.)"""
        params = [p for p in model.parameters() if p.requires_grad]
        if params and not hasattr(model, "set_requires_gradient_sync"):
            torch.autograd.graph.register_multi_grad_hook(
                params, lambda grads: self.mark("grads"), mode="all")

    def step_done(self) -> None:
        """The step's marks are complete (its checkpoint's too): keep them to be read."""
        self.pending.append(self.step_marks)
        self.step_marks = _Marks(self.cuda)

    # -- read at logging steps ----------------------------------------------------------------

    def read(self, step: int) -> dict[str, float]:
        """The metrics of the steps since the last read: every rank calls it (one all-gather
        of a few numbers). Returns the mean over ranks of each section, the step time,
        samples/s, FLOP/s and MFU, peak memory, and the rank most busy before the collective."""
        ready = [m for m in self.pending if m.done()]
        self.pending = [m for m in self.pending if m not in ready]
        for marks in ready:
            self.sums = [s + v for s, v in zip(self.sums, marks.sections(), strict=True)]
        self.steps += len(ready)
        now = time.perf_counter()
        wall = now - self.since
        steps = step - self.since_step
        mine = [s / max(1, self.steps) for s in self.sums] + [_peak_rss_mb()]
        if self.cuda:
            mine += [torch.cuda.max_memory_allocated(self.device) / MB,
                     torch.cuda.max_memory_reserved(self.device) / MB]
            torch.cuda.reset_peak_memory_stats(self.device)
        ranks = dist.all_gather_floats(mine)
        self.sums, self.steps, self.since, self.since_step = [0.0] * len(SECTIONS), 0, now, step
        n = len(SECTIONS)
        metrics = {f"time/{name}": statistics.fmean(r[i] for r in ranks)
                   for i, name in enumerate(SECTIONS)}
        metrics["time/step_s"] = sum(metrics[f"time/{name}"] for name in SECTIONS)
        if steps > 0 and wall > 0:
            metrics["samples_per_s"] = steps * self.global_batch / wall
            if self.flops_per_step:
                flops = steps * self.flops_per_step / wall  # (one rank's FLOPs a step)
                metrics["tflops_per_device"] = flops / 1e12
                if self.peak:
                    metrics["mfu"] = flops / self.peak
        metrics["mem/peak_rss_mb"] = max(r[n] for r in ranks)
        if self.cuda:
            metrics["mem/cuda_max_allocated_mb"] = max(r[n + 1] for r in ranks)
            metrics["mem/cuda_max_reserved_mb"] = max(r[n + 2] for r in ranks)
        # Before the collective: data, compute, optimizer (not the wait; not a checkpoint's
        # stall either: rank 0 alone copies it).
        busy = [r[0] + r[1] + r[3] for r in ranks]
        if len(ranks) > 1:
            slow, excess = _slowest(busy)
            metrics["straggler/rank"], metrics["straggler/excess"] = slow, excess
            self.busy = [b + v * steps for b, v in zip(self.busy, busy, strict=True)]
        if dist.is_main():  # (appended as they come: a killed run keeps its rows)
            self._append_rows([{"step": step, "rank": rank, "host": self.hosts[rank],
                                **{name: round(r[i], 6) for i, name in enumerate(SECTIONS)}}
                               for rank, r in enumerate(ranks)])
        return metrics

    def _append_rows(self, rows: list[dict[str, Any]]) -> None:
        """logs/steps.csv: each rank's parts at each logging step, over every attempt."""
        path = self.run_dir / "logs" / "steps.csv"
        path.parent.mkdir(exist_ok=True)
        new = not path.is_file() or path.stat().st_size == 0
        with open(path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            if new:
                writer.writeheader()
            writer.writerows(rows)

    def line(self, metrics: dict[str, float]) -> str:
        """The progress line's part: ms a step and its sections, speed, memory."""
        ms = {name: metrics[f"time/{name}"] * 1e3 for name in SECTIONS}
        parts = [f"{metrics['time/step_s'] * 1e3:.1f} ms/step (data {ms['data_s']:.1f}, "
                 f"compute {ms['compute_s']:.1f}, wait {ms['wait_s']:.1f}, optimizer "
                 f"{ms['optimizer_s']:.1f}, checkpoint {ms['checkpoint_s']:.1f})"]
        if "samples_per_s" in metrics:
            parts.append(f"{metrics['samples_per_s']:.0f} samples/s")
        if "mfu" in metrics:
            parts.append(f"MFU {metrics['mfu']:.1%}")
        parts.append(f"peak RSS {metrics['mem/peak_rss_mb']:.0f} MB")
        if "mem/cuda_max_allocated_mb" in metrics:
            parts.append(f"CUDA max allocated {metrics['mem/cuda_max_allocated_mb']:.0f} MB")
        return ", ".join(parts)

    def close(self) -> None:
        """Rank 0 writes logs/telemetry.json (the slowest rank, named) and draws the parts."""
        if not dist.is_main():
            return
        folder = self.run_dir / "logs"
        folder.mkdir(exist_ok=True)
        summary: dict[str, Any] = {"world_size": len(self.busy), "hosts": self.hosts,
                                   "flops_per_step": self.flops_per_step, "peak_flops": self.peak,
                                   "busy_s": [round(b, 3) for b in self.busy]}
        if len(self.busy) > 1 and max(self.busy) > 0:
            slow, excess = _slowest(self.busy)
            summary["straggler"] = {"rank": slow, "host": self.hosts[slow],
                                    "excess": round(excess, 4)}
            log.info("slowest rank: %d on %s, %.1f%% more time before the gradients' all-reduce "
                     "than the other ranks' median (logs/steps.csv has each rank's steps)", slow,
                     self.hosts[slow], 100 * excess)
        (folder / "telemetry.json").write_text(json.dumps(summary, indent=2) + "\n")
        draw_breakdown(self.run_dir)

    @contextlib.contextmanager
    def memory_snapshot_on_oom(self) -> Iterator[None]:
        """On CUDA: record the allocator's history, and on an out-of-memory error write its
        snapshot to logs/ with one line naming the file and the viewer."""
        if not self.cuda:
            yield
            return
        from app import _private

        _private.record_memory_history(True)
        try:
            yield
        except torch.OutOfMemoryError:
            path = self.run_dir / "logs" / f"rank{dist.rank()}.memory.pickle"
            with contextlib.suppress(Exception):  # (the error itself is what the run reports)
                _private.dump_memory_snapshot(path)
                log.error("out of memory: the allocator's history is in %s (drag it into "
                          "https://pytorch.org/memory_viz)", path)
            raise
        finally:
            _private.record_memory_history(False)


def _saved_busy(run_dir: Path, world_size: int) -> list[float] | None:
    """The busy seconds per rank an earlier attempt of the run left, if as many ranks."""
    try:
        busy = json.loads((run_dir / "logs" / "telemetry.json").read_text())["busy_s"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return [float(b) for b in busy] if len(busy) == world_size else None


def _slowest(busy: list[float]) -> tuple[int, float]:
    """The rank most busy before the collective, and its excess over the others' median (with
    two ranks: over the other one)."""
    slow = max(range(len(busy)), key=busy.__getitem__)
    others = statistics.median(b for rank, b in enumerate(busy) if rank != slow)
    return slow, busy[slow] / others - 1 if others > 0 else 0.0


def _peak_rss_mb() -> float:
    """This process's peak resident set (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MB if sys.platform == "darwin" else peak / 1024
