"""plan(): in this process, spawn workers here, or already a rank; and on what device."""

from __future__ import annotations

import pytest
import torch

from app.env import SINGLE, Kind, detect, spawned
from app.errors import UserError
from app.launch import plan as plan_module
from app.launch.plan import How, plan, spawns_workers
from conftest import make_config

TORCHRUN_RANK_1 = detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"})
SLURM_RANK_0 = detect({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0",
                       "SLURM_STEP_NODELIST": "node1", "SLURM_JOB_ID": "9"})


@pytest.fixture(autouse=True)
def _cpu_machine(monkeypatch) -> None:
    monkeypatch.setattr(plan_module, "available", lambda kind: kind == "cpu")


@pytest.mark.parametrize("overrides,how", [
    ([], How.in_process),  # devices=1, nodes=1: this process
    (["devices=2"], How.spawn),
    (["devices=2", "trainer=eval"], How.spawn),
    (["devices=2", "trainer=predict"], How.in_process),  # predict and export: one process
    (["devices=2", "trainer=export"], How.in_process),
    (["devices=auto"], How.in_process),  # one CPU device
])
def test_a_single_process_runs_in_process_or_spawns(overrides, how) -> None:
    cfg = make_config(*overrides)
    chosen = plan(cfg, SINGLE)
    assert chosen.how is how
    assert (chosen.kind, chosen.backend) == ("cpu", "gloo")
    # The one-process rule is the same one the entry asks before torch is imported.
    assert spawns_workers(cfg, SINGLE) == (how is How.spawn and cfg.devices != "auto")
    if how is How.spawn:
        assert chosen.devices == 2 and chosen.url.startswith("tcp://127.0.0.1:")


@pytest.mark.parametrize("env", [TORCHRUN_RANK_1, SLURM_RANK_0])
def test_a_rank_of_a_job_is_already_placed(env) -> None:
    cfg = make_config("devices=2")
    chosen = plan(cfg, env)
    assert chosen.how is How.rank
    assert not spawns_workers(cfg, env)  # a rank never starts workers of its own
    assert str(chosen.device(env.local_rank)) == "cpu"
    with pytest.raises(UserError, match=f"^device_id=0: under {env.kind.value} each rank takes "
                                        f"its local rank's device; drop device_id$"):
        plan(make_config("device_id=0"), env)


def test_the_backend_follows_the_device_unless_asked(monkeypatch) -> None:
    assert plan(make_config("distributed.backend=nccl"), SINGLE).backend == "nccl"
    monkeypatch.setattr(plan_module, "available", lambda kind: kind in ("cpu", "cuda"))
    monkeypatch.setattr(plan_module, "device_count", lambda kind: 4)
    chosen = plan(make_config("devices=2"), SINGLE)
    assert (chosen.kind, chosen.backend, chosen.how) == ("cuda", "nccl", How.spawn)


def test_a_rank_takes_its_local_rank_s_device(monkeypatch) -> None:
    current = []
    monkeypatch.setattr(plan_module, "available", lambda kind: kind in ("cpu", "cuda"))
    monkeypatch.setattr(plan_module, "device_count", lambda kind: 2)
    monkeypatch.setattr(torch, "get_device_module",
                        lambda kind: type("Cuda", (), {"set_device": current.append}))
    chosen = plan(make_config(), TORCHRUN_RANK_1)
    assert str(chosen.device(1)) == "cuda:1" and [str(d) for d in current] == ["cuda:1"]
    with pytest.raises(UserError, match="local rank 2 needs cuda:2, but only 2 cuda device"):
        chosen.device(2)
    shared = plan(make_config("distributed.set_device_rank=false"), TORCHRUN_RANK_1)
    assert str(shared.device(1)) == "cuda:0"  # each process sees only its own device
    one = plan(make_config("device_id=1"), SINGLE)
    assert (one.how, str(one.device())) == (How.in_process, "cuda:1")


@pytest.mark.parametrize("overrides,words", [
    (["devices=2", "device_id=0"], "device_id=0 picks the one device of a devices=1 run"),
    (["devices=2", "nodes=2"], "dist_url=auto works on one machine only; with nodes=2"),
    # (each worker failed on it alike, exit 1, after they started)
    (["devices=2", "data=image_folder", "data.root=/nonexistent"],
     "data.root=/nonexistent: no such file or folder here"),
    (["devices=2", "data=hf", "data.path=/nonexistent"], "data.path=/nonexistent: no such"),
])
def test_a_spawn_that_cannot_work_is_refused_before_it_starts(overrides, words) -> None:
    with pytest.raises(UserError, match=words):
        plan(make_config(*overrides), SINGLE)


def test_a_spawned_worker_s_place_comes_from_the_plan() -> None:
    chosen = plan(make_config("devices=2"), SINGLE)
    me = spawned(1, chosen.devices, 0, 1, chosen.url)
    assert (me.kind, me.rank, me.world_size, me.dist_url) == (Kind.spawned, 1, 2, chosen.url)
