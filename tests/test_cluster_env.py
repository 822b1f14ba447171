"""Process environments read from variables (torchrun, SLURM, MPI/PMI, Horovod), spawned
workers and single processes; run names."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime

import pytest

from app import env as env_module
from app.env import SINGLE, Kind, check_horovod, detect, first_host, spawned
from app.errors import UserError
from app.launch.plan import device_count, resolve_devices
from app.rundir.name import run_name

NOW = datetime(2026, 12, 2, 15, 4, 5, 123456)


def test_plain_process_is_not_a_rank() -> None:
    assert detect({}) == SINGLE
    assert detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}) == SINGLE
    assert detect({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}) == SINGLE
    assert detect({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}) == SINGLE
    assert (SINGLE.kind, SINGLE.rank, SINGLE.world_size, SINGLE.is_rank) == (
        Kind.single, 0, 1, False)


def test_torchrun_variables() -> None:
    env = detect({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400",
                  "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"})
    assert (env.kind, env.rank, env.world_size, env.local_rank, env.local_world_size) == (
        Kind.torchrun, 3, 8, 1, 2)  # torchrun wins over SLURM variables
    assert env.dist_url == "tcp://10.1.2.3:29400"
    assert env.node_rank == 1 and env.is_rank  # no GROUP_RANK: rank // local world size
    assert detect({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "GROUP_RANK": "0"}).node_rank == 0  # torchrun's own word wins


def test_slurm_task_variables() -> None:
    env = detect({"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1",
                  "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_ID": "123456",
                  "SLURM_STEP_NODELIST": "gpu[07-08]"})
    assert (env.kind, env.rank, env.world_size, env.local_rank, env.local_world_size) == (
        Kind.slurm, 5, 8, 1, 4)
    assert env.node_rank == 1
    assert env.master_addr == "gpu07"
    assert env.master_port == 15000 + 123456 % 20000


def test_mpi_variables() -> None:
    env = detect({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                  "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                  "MASTER_ADDR": "node1", "MASTER_PORT": "23456"})
    assert (env.kind, env.rank, env.world_size, env.local_rank, env.local_world_size) == (
        Kind.mpi, 2, 4, 0, 2)
    assert env.node_rank == 1 and env.dist_url == "tcp://node1:23456"
    pmi = detect({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
                  "MASTER_ADDR": "127.0.0.1"})
    assert (pmi.rank, pmi.world_size, pmi.local_rank, pmi.master_port) == (1, 2, 1, 29500)
    with pytest.raises(UserError, match="MASTER_ADDR"):
        detect({"PMI_RANK": "1", "PMI_SIZE": "2"})


def test_a_spawned_worker_knows_its_place_from_its_launcher() -> None:
    me = spawned(1, devices=2, node_rank=1, nodes=2, url="tcp://10.0.0.5:29511")
    assert (me.kind, me.rank, me.world_size, me.local_rank, me.local_world_size,
            me.node_rank) == (Kind.spawned, 3, 4, 1, 2, 1)
    assert me.dist_url == "tcp://10.0.0.5:29511" and me.is_rank


def test_the_entry_detects_once_and_the_process_keeps_it(monkeypatch) -> None:
    monkeypatch.setattr(env_module, "_entered", None)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert env_module.enter().kind == Kind.torchrun
    monkeypatch.delenv("RANK")  # read once: a later change is not this process's place
    assert env_module.this_process().rank == 1
    me = spawned(0, 2, 0, 1, "tcp://127.0.0.1:29500")
    assert env_module.enter(me) is me and env_module.this_process() is me


def test_an_environment_that_cannot_work_ends_the_command_in_one_line(tmp_path) -> None:
    mpi = {**os.environ, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
    mpi.pop("MASTER_ADDR", None)
    result = subprocess.run([sys.executable, "-m", "app", f"hydra.run.dir={tmp_path}"],
                            env=mpi, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "MPI launch detected (OMPI_COMM_WORLD_RANK/PMI_RANK) but MASTER_ADDR is not set: export "
        "MASTER_ADDR=<host of rank 0> and MASTER_PORT=<free port> for all ranks"], result.stderr


@pytest.mark.parametrize("nodelist,host", [
    ("node1", "node1"), ("gpu[07-09,12]", "gpu07"), ("a[3],b[1-2]", "a3"),
    ("cpu1,cpu2", "cpu1"), ("rack1-node[010-011]", "rack1-node010"),
])
def test_first_host_of_a_nodelist(nodelist, host) -> None:
    assert first_host(nodelist) == host


def test_horovod_is_refused_with_a_pointer() -> None:
    check_horovod({}, requested=False)
    for env, requested in (({"HOROVOD_RANK": "0"}, False), ({}, True)):
        with pytest.raises(UserError, match="torchrun"):
            check_horovod(env, requested)


def test_run_names_agree_between_ranks() -> None:
    assert run_name({}, NOW) == "2026-12-02/15-04-05-123456"
    assert run_name({"TORCHELASTIC_RUN_ID": "job42"}, NOW) == "torchrun/job42"
    assert run_name({"SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"},
                    NOW) == "slurm/77.0"
    # torchrun's own random id: a name from the start time of the agent, shared by its ranks
    uuid = "0b0f4b4e-3a52-4a8e-9d7e-3f1b2c3d4e5f"
    assert run_name({"TORCHELASTIC_RUN_ID": uuid}) == run_name({"TORCHELASTIC_RUN_ID": uuid})


def test_device_counts() -> None:
    assert resolve_devices("auto", "cpu") == 1
    assert resolve_devices(3, "cpu") == 3
    too_many = device_count("cuda") + 1
    with pytest.raises(UserError, match=f"devices={too_many}"):
        resolve_devices(too_many, "cuda")


def test_local_jobs_get_disjoint_device_slices() -> None:
    from hydra_plugins.app_submitit._job import device_slice

    ids = ["0", "1", "2", "3", "4", "5", "6", "7"]
    assert [device_slice(n, 2, ids) for n in range(5)] == [
        ["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"], ["0", "1"]]  # job 4 shares with job 0
    assert device_slice(3, 1, ["4", "6"]) == ["6"]  # respects CUDA_VISIBLE_DEVICES
    assert device_slice(0, 8, ids) is None and device_slice(0, "auto", ids) is None
    assert device_slice(0, 1, ["0"]) is None
