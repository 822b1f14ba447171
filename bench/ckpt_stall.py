"""How long one checkpoint of a ~200 MB model blocks the training loop.

Baseline: `torch.save` of the state to a file, in the loop's thread (what a plain loop does).
App, synchronous (trainer.async_checkpoint=false): the atomic save (temporary file, fsync,
rename). App, asynchronous (the default): the time `CheckpointWriter.save` blocks (the copy
of the state into reused host buffers); the write itself runs in a thread, timed separately.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from app.checkpoint.io import save as atomic_save
from app.checkpoint.writer import CheckpointWriter


def _state(size_mb: int) -> dict:
    width = int((size_mb * 2**20 / 4) ** 0.5)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    return {"model": model.state_dict(), "loop": {"step": 1}, "rng": [torch.get_rng_state()]}


def measure(repeats: int = 3, size_mb: int = 200) -> dict[str, list[float]]:
    state = _state(size_mb)
    size = sum(t.numel() * t.element_size() for t in state["model"].values()) / 2**20
    out: dict[str, list[float]] = {"plain": [], "sync": [], "blocked": [], "write": [],
                                   "size_mb": [size]}
    writer = CheckpointWriter(background=True)
    with tempfile.TemporaryDirectory(prefix="app-bench-ckpt-") as tmp:
        d = Path(tmp)
        for i in range(repeats):
            start = time.perf_counter()
            torch.save(state, d / f"plain-{i}.pt")
            out["plain"].append(time.perf_counter() - start)
            start = time.perf_counter()
            atomic_save(state, d / f"sync-{i}.pt")
            out["sync"].append(time.perf_counter() - start)
            start = time.perf_counter()
            out["blocked"].append(writer.save(state, d / f"async-{i}.pt", then=lambda: None))
            writer.wait()
            out["write"].append(time.perf_counter() - start)
            for f in d.glob("*.pt"):
                f.unlink()
    return out


# A real run with the same ~200 MB model: an MLP 7168 -> 7168 -> 10, a checkpoint every 3 steps.
# Training uses one of the two cores, so that the writer thread has one of its own (as on any
# machine with a core to spare); with both busy, the write slows the steps it overlaps.
LOOP_STEPS, LOOP_EVERY = 21, 3
LOOP_OVERRIDES = [
    "model=mlp", "model.hidden=[7168]", "model.dropout=0", "data=synthetic",
    "data.input_shape=[7168]", "data.num_samples=640", "data.batch_size=16",
    "optimizer=sgd", "optimizer.momentum=0", "optimizer.nesterov=false",
    f"trainer.max_steps={LOOP_STEPS}", "trainer.max_epochs=null", "trainer.val_every_n_epochs=null",
    f"trainer.ckpt_every_n_steps={LOOP_EVERY}", "trainer.ckpt_every_n_epochs=null",
    "distributed.omp_threads=1",
]


def stalls(times: list[float]) -> list[float]:
    """From the end times of each step: how much longer than the median step the steps that
    follow a checkpoint took (the checkpoint, or the copy it waits for, lies between)."""
    interval = {k: times[k] - times[k - 1] for k in range(2, len(times))}  # step k+1's time
    after = [k for k in interval if k % LOOP_EVERY == 0]
    typical = statistics.median(v for k, v in interval.items() if k not in after)
    return [interval[k] - typical for k in after]


def loop_wait(run_dir: Path) -> float:
    """Seconds the loop waited per checkpoint, from the line the run logs at its end (the
    final checkpoint, which the end of a run waits for in full, left out)."""
    line = next(x for x in (run_dir / "train.log").read_text().splitlines()
                if "the loop waited" in x)
    count = int(line.split(" - ", 1)[1].split()[0])
    waited = float(line.split("the loop waited ")[1].split()[0])
    return waited / count
