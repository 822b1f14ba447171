"""The communication helpers with a real gloo process group: 2 'machines' x 2 processes."""

from __future__ import annotations

import json
import socket

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from app import dist


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
