"""torch.compile's caches under the run directory, or, for a job of a sweep, under the sweep
directory, shared by its jobs: a requeued job, a resumed run and the next job of a sweep
compile from the cache instead of from scratch (minutes for a large model).

`compile_cache/` holds two caches. `inductor/` is inductor's own (TORCHINDUCTOR_CACHE_DIR:
the FX graphs, AOTAutograd's entries, the built C++ and Triton kernels), read and written as
torch.compile runs; its writes are atomic renames and its builds take file locks, so the
jobs of a sweep on several nodes share it. `artifacts/` holds PyTorch's portable cache
artifacts (`torch.compiler.save_cache_artifacts`), one file per job, saved when the job
ends (however it ends, a stop for a requeue included) and loaded by every job at its start:
the same entries in a few files, which refill an inductor folder that is gone (deleted for
its size, or a TORCHINDUCTOR_CACHE_DIR of the user's on a node's local disk). On a CPU they
save less: inductor's C++ kernels are built again from them (bench/compile_cache.py).

A TORCHINDUCTOR_CACHE_DIR set by the user wins over `inductor/` (the artifacts still go
under the run or sweep directory). Without compile=true nothing is created.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from app import _private, dist
from app.config import AppConfig, Mode
from app.errors import WriteFailed
from app.files import write_bytes_atomically
from app.rundir.name import is_job_of_sweep

log = logging.getLogger(__name__)

FOLDER = "compile_cache"
VAR = "TORCHINDUCTOR_CACHE_DIR"
TRITON = "TRITON_CACHE_DIR"


def cache_folder(run_dir: Path) -> Path:
    """The sweep directory's `compile_cache/` for a job of a sweep, else the run's."""
    return (run_dir.parent if is_job_of_sweep(run_dir) else run_dir) / FOLDER


@contextmanager
def compile_cache(cfg: AppConfig, run_dir: Path) -> Iterator[None]:
    """Around a training run with compile=true: the caches set up before anything compiles;
    at the end, this job's artifacts saved (rank 0) and the compile time and cache hits
    logged."""
    if not (cfg.compile and cfg.trainer.mode == Mode.trainval):
        yield
        return
    folder = cache_folder(run_dir)
    # (inductor sets Triton's folder under its own the first time it compiles for a GPU: put
    # back as well, or the next run in this process writes into this run's cache)
    previous = {name: os.environ.get(name) for name in (VAR, TRITON)}
    os.environ[VAR] = _users_folder(previous[VAR]) or str(folder / "inductor")
    loaded = _load_artifacts(folder / "artifacts")
    log.info("compile cache: %s%s", os.environ[VAR],
             f" ({loaded} entries loaded from {folder / 'artifacts'})" if loaded else "")
    seconds, counts = _private.compile_stats()
    try:
        yield
    finally:
        try:
            _report_and_save(run_dir, folder, seconds, counts)
        except Exception as e:  # (the run's own outcome, a NaN stop's too, is what it reports)
            log.warning("compile cache: not saved (%s: %s)", type(e).__name__, e)
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _report_and_save(run_dir: Path, folder: Path, seconds: float, counts: dict) -> None:
    spent, after = _private.compile_stats()
    hits, misses = (after[k] - counts[k] for k in ("hits", "misses"))
    if hits or misses:
        log.info("compile: %.1f s, cache hits %d, misses %d", spent - seconds, hits, misses)
    else:  # (the jobs of a sweep run in one process: the first one's compiled code serves)
        log.info("compile: none in this job (no step ran, or this process had compiled "
                 "the same code already)")
    if dist.is_main():
        _save_artifacts(folder / "artifacts" / f"{_job_name(run_dir, folder)}.bin")


def _users_folder(value: str | None) -> str | None:
    """The variable's value when the user set it: inductor sets it itself, to its default
    folder, at the import of torch._dynamo (in a worker server's preload, in any optimizer's
    first step)."""
    if value is None or os.path.abspath(value) == _private.inductor_default_cache_dir():
        return None
    return value


def _job_name(run_dir: Path, folder: Path) -> str:
    """The job's place under the sweep directory (`3`; a nested subdir `a_b`), or `run`."""
    if folder.parent == run_dir:
        return "run"
    return "_".join(run_dir.relative_to(folder.parent).parts)


def _load_artifacts(artifacts: Path) -> int:
    """Every job's artifacts into inductor's caches; the number of entries loaded."""
    import torch

    entries = 0
    for path in sorted(artifacts.glob("*.bin")):
        try:
            data = path.read_bytes()
        except OSError as e:  # (a cache: compiling without it is only slower)
            log.warning("compile cache: %s not read (%s): compiling without it", path, e)
            continue
        info = torch.compiler.load_cache_artifacts(data)  # (None, with a warning: unreadable)
        if info is not None:
            entries += sum(len(keys) for keys in info.artifacts.values())
    return entries


def _save_artifacts(path: Path) -> None:
    """This process's artifacts (what it compiled and what it found in the cache), written
    atomically: a job of the sweep starting meanwhile reads the old file or the new one."""
    import torch

    saved = torch.compiler.save_cache_artifacts()
    if saved is None:  # nothing compiled (a run that stopped before its first step)
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomically(path, saved[0])
    except (OSError, WriteFailed) as e:  # the run's own outcome stands
        log.warning("compile cache: %s", e)
