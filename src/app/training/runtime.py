"""The process's numeric settings (threads, determinism, TF32, memory reservation) and seeding."""

from __future__ import annotations

import logging
import os
import random
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


def share_cpu_threads(local_processes: int) -> None:
    """Intra-op threads of one of `local_processes` CPU ranks on a machine. Left alone, each
    rank takes a thread per core, and N ranks x N threads on N cores spin against each other:
    the default job as a Slurm job of 2 CPU tasks took twice as long (docs/measurements.md). A
    rank whose CPU set is narrower than the machine is taken to be bound to cores of its own
    (Slurm's task binding, taskset) and uses them all. OMP_NUM_THREADS, when set, wins."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    usable = len(os.sched_getaffinity(0))
    if usable == os.cpu_count():  # every rank sees every core: they share them
        usable //= local_processes
    torch.set_num_threads(max(1, usable))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def apply_runtime_flags(cfg: Any, device: torch.device, ranks_here: int | None = None) -> None:
    """`ranks_here`: the ranks of the job on this machine (None: a run in this one process)."""
    if cfg.deterministic:
        # cuBLAS needs a fixed workspace for deterministic results (set before its first use).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True  # fastest kernels for fixed input shapes
    if cfg.tf32 is not None:
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32
    # Always an explicit count, even PyTorch's default: only torch.set_num_threads turns MKL's
    # dynamic threading off, and MKL's matmuls round differently with 1 thread than with 2
    # on some processors (docs/measurements.md), so a process whose MKL picked another
    # count would no longer repeat a run bit for bit.
    if device.type == "cpu" and ranks_here is not None:  # the ranks share this machine's cores
        share_cpu_threads(ranks_here)
    torch.set_num_threads(cfg.distributed.omp_threads or torch.get_num_threads())
    if cfg.occupy > 0:
        occupy_memory(device, cfg.occupy)


def occupy_memory(device: torch.device, fraction: float) -> None:
    """Reserve `fraction` of the free GPU memory for PyTorch's caching allocator (the older
    `--occupy`): the memory stays with this process for later tensors, not with other jobs."""
    if device.type != "cuda":
        log.info("occupy=%g: no GPU here, nothing reserved", fraction)
        return
    free, _ = torch.cuda.mem_get_info(device)
    block = torch.empty(int(free * fraction), dtype=torch.uint8, device=device)
    del block  # freed to the cache, which keeps it reserved
    log.info("occupy=%g: reserved %.1f GiB on %s", fraction,
             torch.cuda.memory_reserved(device) / 2**30, device)
