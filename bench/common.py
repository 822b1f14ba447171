"""Running a measured process, and the statistics and facts every benchmark reports."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
PROBE = BENCH / "probe"
WARMUP_STEPS = 10  # step times before this are left out (allocator and caches warming up)


@dataclass
class Run:
    first_step_s: float  # process start (Popen) to the end of rank 0's first optimizer step
    step_s: float  # median time per optimizer step of rank 0, after the warm-up
    peak_rss_mb: float  # peak resident memory of the started process itself (VmHWM)
    wall_s: float
    times: list[float]  # wall time at the end of each optimizer step of rank 0
    rank_peak_mb: dict[int, float]  # each rank's peak resident memory at its last step


def _read(path: Path) -> dict | None:
    """A probe record; None for one a late helper process is still writing."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def run_probed(cmd: list[str], steps: int, cwd: Path, env: dict[str, str] | None = None) -> Run:
    """Run `cmd` with the step probe; it must reach `steps` optimizer steps."""
    # (A spawned helper, such as multiprocessing's resource tracker, may write its record
    # late; cleaning up ignores that.)
    with tempfile.TemporaryDirectory(prefix="app-bench-", ignore_cleanup_errors=True) as \
            probe_dir, tempfile.TemporaryFile("w+") as log:
        path = os.pathsep.join(filter(None, [str(PROBE), os.environ.get("PYTHONPATH")]))
        full_env = {**os.environ, **(env or {}), "APP_PROBE_DIR": probe_dir,
                    "APP_PROBE_STEPS": str(steps), "PYTHONPATH": path}
        start = time.time()
        proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=log, stderr=log)
        proc.wait()
        wall = time.time() - start
        if proc.returncode != 0:
            log.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{log.read()[-3000:]}")
        records = [r for p in Path(probe_dir).glob("*-*.json")
                   if not p.name.startswith("peak-") and (r := _read(p)) is not None]
        peak = [r for p in Path(probe_dir).glob("peak-*.json") if (r := _read(p)) is not None]
    rank0 = max((r for r in records if r["rank"] == 0), key=lambda r: len(r["times"]))
    times = rank0["times"]
    if len(times) < steps:
        raise RuntimeError(f"{' '.join(cmd)}: {len(times)} steps recorded, {steps} expected")
    deltas = [b - a for a, b in zip(times[WARMUP_STEPS:], times[WARMUP_STEPS + 1:], strict=False)]
    step_s = statistics.median(deltas) if deltas else float("nan")
    # The started process's own peak (not wait4's, which counts this process's memory too:
    # Linux carries the peak across fork and exec).
    own = next((p["peak_mb"] for p in peak if p["pid"] == proc.pid), float("nan"))
    ranks = {r["rank"]: max(x.get("peak_mb") or 0.0 for x in records if x["rank"] == r["rank"])
             for r in records}
    return Run(times[0] - start, step_s, own, wall, times, ranks)


def time_to_exit(cmd: list[str], cwd: Path) -> float:
    start = time.time()
    subprocess.run(cmd, cwd=cwd, check=True, capture_output=True)
    return time.time() - start


@dataclass
class Stat:
    """The median of repeated measurements, with their range."""

    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def fmt(self, scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
        lo, hi = min(self.values) * scale, max(self.values) * scale
        return f"{self.median * scale:.{digits}f}{unit} ({lo:.{digits}f}-{hi:.{digits}f})"


def paired_ratio(a: Stat, b: Stat) -> float:
    """The median of the ratios of paired runs (run i of a with run i of b, side by side):
    robust to a machine whose speed drifts between pairs."""
    return statistics.median(x / y for x, y in zip(a.values, b.values, strict=True))


def ratio_range(a: Stat, b: Stat) -> str:
    pairs = [x / y for x, y in zip(a.values, b.values, strict=True)]
    return f"{paired_ratio(a, b):.3f} ({min(pairs):.3f}-{max(pairs):.3f})"


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               platform.processor() or "unknown CPU") if Path("/proc/cpuinfo").exists() else \
        platform.processor()
    mem = next((int(line.split()[1]) / 2**20 for line in
                Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")),
               0.0) if Path("/proc/meminfo").exists() else 0.0
    import hydra
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return (f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, GPU: {gpu}; "
            f"{platform.system()} {platform.release()}; Python {platform.python_version()}, "
            f"torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"hydra-core {hydra.__version__}")


def app_cmd(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "app", *overrides]
