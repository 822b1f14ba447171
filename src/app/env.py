"""Is this process already one rank of a job? Read torchrun, SLURM and MPI variables.

Pure functions of an environment mapping, so every case is testable without a cluster.
Precedence: torchrun, then SLURM tasks, then MPI/PMI.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from app.errors import UserError

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class RankEnv:
    source: str  # torchrun | slurm | mpi
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    @property
    def dist_url(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: `gpu[07-09,12],cpu1` -> `gpu07`."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise UserError(f"SLURM_JOB_NODELIST={nodelist!r}: cannot read its first host")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        if env.get(name, "").strip().lstrip("-").isdigit():
            return int(env[name])
    return None


def check_horovod(env: Mapping[str, str], requested: bool) -> None:
    if requested or "HOROVOD_RANK" in env or "HOROVOD_SIZE" in env:
        raise UserError(
            "Horovod is not supported: its last release (0.28.1, 2023) no longer builds against "
            "current PyTorch, and open_clip dropped it too. Launch with torchrun "
            "(torchrun --nproc_per_node=N -m app ...) or SLURM (hydra/launcher=submitit_slurm)"
        )


def detect(env: Mapping[str, str]) -> RankEnv | None:
    """The rank environment this process runs in, or None if it is not one rank of many."""
    if "LOCAL_RANK" in env and "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return RankEnv(
            "torchrun", int(env["RANK"]), world, int(env["LOCAL_RANK"]),
            int(env.get("LOCAL_WORLD_SIZE", world)), env.get("MASTER_ADDR", "127.0.0.1"),
            int(env.get("MASTER_PORT", DEFAULT_PORT)),
        )
    # Tasks of a Slurm step. The batch script itself also sees SLURM_PROCID=0 but no
    # SLURM_STEP_NUM_TASKS: it is not a rank, and must not wait for peers that never come.
    world = _int(env, "SLURM_STEP_NUM_TASKS")
    if "SLURM_PROCID" in env and world is not None and world > 1:
        job_id = _int(env, "SLURM_JOB_ID") or 0
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "127.0.0.1")
        tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", ""))
        local_world = _int({"n": re.split(r"[(,]", tasks_per_node)[0]}, "n") or world
        return RankEnv(
            "slurm", int(env["SLURM_PROCID"]), world, _int(env, "SLURM_LOCALID") or 0,
            local_world, env.get("MASTER_ADDR") or first_host(nodelist),
            _int(env, "MASTER_PORT") or 15000 + job_id % 20000,
        )
    rank = _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    world = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    if rank is not None and world is not None and world > 1:
        if "MASTER_ADDR" not in env:
            raise UserError(
                "MPI launch detected (OMPI_COMM_WORLD_RANK/PMI_RANK) but MASTER_ADDR is not set: "
                "export MASTER_ADDR=<host of rank 0> and MASTER_PORT=<free port> for all ranks"
            )
        return RankEnv(
            "mpi", rank, world,
            _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK") or 0,
            _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE") or 1,
            env["MASTER_ADDR"], _int(env, "MASTER_PORT") or DEFAULT_PORT,
        )
    return None
