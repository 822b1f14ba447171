"""This process's place in a job: one type for every environment it can run in.

torchrun, a SLURM task and an MPI rank are read from variables: pure functions of a mapping,
so every case is testable without a cluster (precedence: torchrun, then SLURM tasks, then
MPI/PMI). A worker this app spawned is told its place by its launcher (`spawned`); anything
else is a single process. The entry of each process detects it once (`enter`) and hands it down.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import urlsplit

from app.errors import UserError

DEFAULT_PORT = 29500


class Kind(StrEnum):
    torchrun = "torchrun"
    slurm = "slurm"
    mpi = "mpi"
    spawned = "spawned"  # a worker this app started (app.launch.spawn)
    single = "single"  # one process, no rank of any job


@dataclass(frozen=True)
class ProcessEnv:
    """One process's place in the job; the master address applies to ranks only."""

    kind: Kind
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def is_rank(self) -> bool:
        """Whether this process is one rank of a job (it joins a process group)."""
        return self.kind is not Kind.single

    @property
    def dist_url(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


SINGLE = ProcessEnv(Kind.single)


def spawned(local_rank: int, devices: int, node_rank: int, nodes: int, url: str) -> ProcessEnv:
    """Worker `local_rank` of the `devices` this app starts on machine `node_rank` of `nodes`."""
    where = urlsplit(url)
    return ProcessEnv(Kind.spawned, node_rank * devices + local_rank, devices * nodes,
                      local_rank, devices, node_rank, where.hostname, where.port)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: `gpu[07-09,12],cpu1` -> `gpu07`."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise UserError(f"SLURM_JOB_NODELIST={nodelist!r}: cannot read its first host")
    prefix, ranges = match.groups()
    return prefix + (ranges or "").split(",")[0].split("-")[0]


def _int(env: Mapping[str, str], *names: str, default: int | None = None) -> int | None:
    for name in names:
        if env.get(name, "").strip().lstrip("-").isdigit():
            return int(env[name])
    return default


def check_horovod(env: Mapping[str, str], requested: bool) -> None:
    if requested or "HOROVOD_RANK" in env or "HOROVOD_SIZE" in env:
        raise UserError(
            "Horovod is not supported: its last release (0.28.1, 2023) no longer builds against "
            "current PyTorch, and open_clip dropped it too. Launch with torchrun "
            "(torchrun --nproc_per_node=N -m app ...) or SLURM (hydra/launcher=submitit_slurm)"
        )


def _torchrun(env: Mapping[str, str]) -> ProcessEnv | None:
    if not ("LOCAL_RANK" in env and "RANK" in env and "WORLD_SIZE" in env):
        return None
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    return ProcessEnv(Kind.torchrun, rank, world, int(env["LOCAL_RANK"]), local_world,
                      _int(env, "GROUP_RANK", default=rank // local_world),
                      env.get("MASTER_ADDR", "127.0.0.1"),
                      int(env.get("MASTER_PORT", DEFAULT_PORT)))


def _slurm(env: Mapping[str, str]) -> ProcessEnv | None:
    # Tasks of a Slurm step. The batch script itself also sees SLURM_PROCID=0 but no
    # SLURM_STEP_NUM_TASKS: it is not a rank, and must not wait for peers that never come.
    world = _int(env, "SLURM_STEP_NUM_TASKS")
    if "SLURM_PROCID" not in env or world is None or world <= 1:
        return None
    rank = int(env["SLURM_PROCID"])
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "127.0.0.1")
    tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", ""))
    local_world = _int({"n": re.split(r"[(,]", tasks_per_node)[0]}, "n") or world
    return ProcessEnv(Kind.slurm, rank, world, _int(env, "SLURM_LOCALID") or 0, local_world,
                      _int(env, "SLURM_NODEID", default=rank // local_world),
                      env.get("MASTER_ADDR") or first_host(nodelist),
                      _int(env, "MASTER_PORT") or 15000 + (_int(env, "SLURM_JOB_ID") or 0) % 20000)


def _mpi(env: Mapping[str, str]) -> ProcessEnv | None:
    rank = _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    world = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    if rank is None or world is None or world <= 1:
        return None
    if "MASTER_ADDR" not in env:
        raise UserError(
            "MPI launch detected (OMPI_COMM_WORLD_RANK/PMI_RANK) but MASTER_ADDR is not set: "
            "export MASTER_ADDR=<host of rank 0> and MASTER_PORT=<free port> for all ranks"
        )
    local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE") or 1
    return ProcessEnv(Kind.mpi, rank, world,
                      _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                           "PMI_LOCAL_RANK") or 0,
                      local_world, rank // local_world, env["MASTER_ADDR"],
                      _int(env, "MASTER_PORT") or DEFAULT_PORT)


def detect(env: Mapping[str, str]) -> ProcessEnv:
    """The environment this process runs in, as its variables tell."""
    for read in (_torchrun, _slurm, _mpi):
        if (found := read(env)) is not None:
            return found
    return SINGLE


_entered: ProcessEnv | None = None


def enter(env: ProcessEnv | None = None) -> ProcessEnv:
    """Called once by the entry of each process (app.__main__, a submitit job, a spawned
    worker): this process's environment, detected (or the one given), kept for the code that
    Hydra calls (callbacks, a launcher's job), which cannot be handed it."""
    global _entered
    _entered = detect(os.environ) if env is None else env
    return _entered


def this_process() -> ProcessEnv:
    """What the entry of this process detected (detected now where no entry of ours ran)."""
    return _entered if _entered is not None else enter()


def reproducible_matmuls() -> None:
    """MKL's strict reproducibility mode, unless the user set one: MKL's matrix products
    otherwise round differently with another thread count, so a run resumed on other cores
    would not repeat the first bit for bit (no measurable cost: docs/measurements.md). MKL
    reads it at its first call, hence here, before torch is imported; workers inherit it."""
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
