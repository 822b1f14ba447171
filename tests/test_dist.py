"""The communication helpers with a real gloo process group: 2 'machines' x 2 processes."""

from __future__ import annotations

import json
import os
import re
import socket
import warnings

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from app import dist
from app.config import validate
from app.env import SINGLE
from app.errors import UserError
from conftest import make_config


def _free_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _worker(rank: int, url: str, out_dir: str) -> None:
    dist.init("gloo", url, rank=rank, world_size=4, local_rank=rank % 2, local_world_size=2,
              timeout_s=60)
    local = torch.tensor([float(rank)])
    tdist.all_reduce(local, group=dist.local_group())  # this machine's ranks only
    record = {
        "rank": dist.rank(), "world": dist.world_size(), "local_rank": dist.local_rank(),
        "main": dist.is_main(), "local_main": dist.is_main(local=True),
        "local_sum": local.item(),
        "mean": dist.all_reduce_mean(torch.tensor([float(rank)])).item(),
        "broadcast": dist.broadcast_object({"from": dist.rank()}),
        "gathered": dist.all_gather_object(rank * 10),
    }
    dist.barrier()
    dist.destroy()
    record["after_destroy"] = [dist.rank(), dist.world_size(), dist.initialized()]
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(record, f)


def test_helpers_and_the_per_machine_group(tmp_path) -> None:
    mp.start_processes(_worker, args=(_free_url(), str(tmp_path)), nprocs=4,
                       start_method="fork")
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["local_rank"] for r in records] == [0, 1, 0, 1]
    assert [r["main"] for r in records] == [True, False, False, False]
    assert [r["local_main"] for r in records] == [True, False, True, False]
    assert [r["local_sum"] for r in records] == [1.0, 1.0, 5.0, 5.0]  # 0+1 and 2+3
    assert all(r["mean"] == 1.5 and r["world"] == 4 for r in records)
    assert all(r["broadcast"] == {"from": 0} for r in records)
    assert all(r["gathered"] == [0, 10, 20, 30] for r in records)
    assert all(r["after_destroy"] == [0, 1, False] for r in records)


def test_a_host_that_does_not_resolve_fails_before_any_worker_starts(tmp_path,
                                                                     monkeypatch) -> None:
    from app.launch import run

    monkeypatch.setattr(run, "spawn", lambda *a: pytest.fail("workers were started"))
    cfg = make_config("devices=2", "dist_url=tcp://nonexistent.invalid:29511")
    with pytest.raises(UserError, match=r"^dist_url=tcp://nonexistent.invalid:29511: the host "
                                        r"nonexistent.invalid cannot be resolved"):
        run.launch(cfg, tmp_path, SINGLE)


@pytest.mark.parametrize("override,words", [
    ("distributed.timeout_s=nan", "distributed.timeout_s=nan: expected a finite number > 0"),
    ("distributed.timeout_s=inf", "distributed.timeout_s=inf: expected a finite number > 0"),
    ("distributed.stall_timeout_s=inf", "distributed.stall_timeout_s=inf: expected null or a "
                                        "finite number > 0"),
    ("distributed.stall_timeout_s=0", "distributed.stall_timeout_s=0.0: expected null or a"),
    ("dist_url=tcp://127.0.0.1:99999", "port 99999 is out of range; give a port from 1 to"),
    ("dist_url=tcp://127.0.0.1:0", "port 0 is out of range"),
])
def test_distributed_values_are_checked_before_spawning(override, words) -> None:
    with pytest.raises(UserError, match=re.escape(words)):
        validate(make_config("devices=2", override))


def test_the_stall_watchdog_can_be_turned_off() -> None:
    validate(make_config("distributed.stall_timeout_s=null"))


def test_cpu_devices_far_beyond_the_cores_are_refused(monkeypatch) -> None:
    from app.launch import plan

    monkeypatch.setattr(plan.os, "cpu_count", lambda: 2)
    with pytest.raises(UserError, match=r"^devices=1000: this machine has 2 CPU core\(s\).*"
                                        r"use devices=2 or fewer$"):
        plan.resolve_devices(1000, "cpu")
    assert plan.resolve_devices(8, "cpu") == 8  # a few per core: a warning only
    monkeypatch.setattr(plan.os, "cpu_count", lambda: 1)
    assert plan.resolve_devices(2, "cpu") == 2  # a debugging run of 2 on one core


def test_ddp_syncs_buffers_as_asked_without_a_deprecation_warning() -> None:
    from torch.nn.parallel import DistributedDataParallel

    tdist.init_process_group("gloo", init_method=_free_url(), rank=0, world_size=1)
    try:
        for sync in (True, False):
            model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # any warning fails the test
                ddp = DistributedDataParallel(model, **dist.ddp_buffer_sync(sync))
            synced = getattr(ddp, "forward_sync_buffers", None)
            assert (ddp.broadcast_buffers if synced is None else synced) is sync
    finally:
        tdist.destroy_process_group()


def test_an_nccl_rank_turns_pytorchs_flight_recorder_on(tmp_path, monkeypatch) -> None:
    # At a collective's timeout NCCL ranks dump their last collectives into the run's logs/
    # (PyTorch's Flight Recorder); a setting of the user's is kept. Read as the rank joins.
    from app.env import Kind, ProcessEnv
    from app.launch import worker
    from app.launch.plan import How, Plan

    seen = {}

    def join(*args, **kwargs) -> None:
        seen.update({k: os.environ.get(k) for k in (
            "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE")})
        raise KeyboardInterrupt  # (no NCCL here: stop before the process group)

    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    monkeypatch.setattr(worker.dist, "init", join)
    (tmp_path / "logs").mkdir()
    me = ProcessEnv(Kind.torchrun, rank=0, world_size=2, master_addr="127.0.0.1", master_port=1)
    with pytest.raises(KeyboardInterrupt):
        worker.run_rank(make_config(), tmp_path, Plan(How.rank, "cpu", "nccl"), me, print)
    assert seen == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                    "TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/logs/nccl_trace_rank_"}
