"""`distributed.strategy=fsdp` against `ddp` with 2 ranks on a ~200 MB model, and the stall of
a sharded checkpoint.

Memory: each rank's peak resident memory (VmHWM, read by the probe at its last step) in a
run of a 7168 -> 7168 -> 10 MLP (205 MB of float32 weights) with AdamW: DDP keeps weights,
gradients, DDP's gradient buckets and two AdamW moments whole on each rank; FSDP keeps 1/2
of weights, gradients and moments, plus the gathered weights of the unit that runs. What the
model costs is the peak above the same run with a 16-wide hidden layer (the process, torch,
the data: the same in both), and the target is FSDP's cost about half DDP's.

Step time: the median step of the same runs, FSDP against DDP (paired, alternating).

Checkpoint stall: how long the loop is blocked by a save of the same model's state dict from
one process: `dcp.save` (synchronous, the baseline) against the app's background sharded
save (app.checkpoint.sharded.ShardedWriter: DCP's `async_save` copies the tensors to host
memory, then a thread writes them); the background write's own time is shown too. The app's
save with its checksums (the thread hashes each file once it is written) and without them
(their writing patched out), alternating; and the hashing throughput over the written shard
(in the page cache) of the CRC-32 the app uses, against sha256 and blake2b.
"""

from __future__ import annotations

import contextlib
import hashlib
import tempfile
import time
import warnings
from pathlib import Path
from unittest import mock

from common import Stat, app_cmd, ratio_range, run_probed

STEPS = 12
WIDTH = 7168
HASHES = ("crc32", "sha256", "blake2b")  # the app's CRC-32 against two of hashlib's


def _overrides(hidden: int) -> list[str]:
    return ["model=mlp", f"model.hidden=[{hidden}]", "model.dropout=0", "data=synthetic",
            f"data.input_shape=[{WIDTH}]", "data.num_samples=640", "data.batch_size=16",
            f"trainer.max_steps={STEPS}", "trainer.max_epochs=null",
            "trainer.val_every_n_epochs=null", "trainer.ckpt_every_n_epochs=null",
            "trainer.progress_bar=false", "devices=2", "distributed.omp_threads=1"]


def _runs(tmp: Path, repeats: int, repo: Path) -> dict[str, list]:
    runs: dict[str, list] = {"ddp": [], "fsdp": [], "ddp_base": [], "fsdp_base": []}
    for r in range(repeats):
        for strategy in ("ddp", "fsdp"):
            for suffix, hidden in (("", WIDTH), ("_base", 16)):
                run_dir = tmp / f"{strategy}{suffix}-{r}"
                runs[strategy + suffix].append(run_probed(app_cmd(
                    *_overrides(hidden), f"distributed.strategy={strategy}",
                    f"hydra.run.dir={run_dir}"), STEPS, repo))
    return runs


def _rank_peak(runs: list) -> Stat:
    return Stat([max(run.rank_peak_mb.values()) for run in runs])


def _hashed_gbps(file: Path, algorithm: str) -> float:
    """GB/s of hashing `file` with `algorithm`: the app's CRC-32, or one of hashlib's."""
    from app.checkpoint import checksums

    start = time.perf_counter()
    if algorithm == "crc32":
        checksums.checksum(file)
    else:
        digest = hashlib.new(algorithm)
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return file.stat().st_size / (time.perf_counter() - start) / 1e9


def stall(repeats: int, size_mb: int = 200) -> dict[str, list[float]]:
    import torch.distributed.checkpoint as dcp
    from torch import nn

    from app.checkpoint import sharded

    width = int((size_mb * 2**20 / 4) ** 0.5)
    state = {"model": nn.Sequential(nn.Linear(width, width), nn.Linear(width, 10)).state_dict()}
    out: dict[str, list[float]] = {key: [] for key in (
        "sync", "blocked", "write", "blocked_unsummed", "write_unsummed", *HASHES)}
    writer = sharded.ShardedWriter(background=True, is_main=True)
    unsummed = mock.patch.object(sharded, "write_checksums", lambda *args: None)
    for i in range(repeats):
        with tempfile.TemporaryDirectory(prefix="app-bench-dcp-") as folder:
            tmp = Path(folder)
            start = time.perf_counter()
            with warnings.catch_warnings():  # (that it saves alone, as asked)
                warnings.simplefilter("ignore")
                dcp.save(state, checkpoint_id=tmp / "sync", no_dist=True)
            out["sync"].append(time.perf_counter() - start)
            for suffix, checksums in (("", contextlib.nullcontext()), ("_unsummed", unsummed)):
                start = time.perf_counter()
                with checksums:  # (until the write is done: its thread hashes)
                    out["blocked" + suffix].append(writer.save(
                        state, {"loop": {"step": i}}, tmp / f"async{suffix}.pt",
                        then=lambda: None))
                    writer.wait()
                out["write" + suffix].append(time.perf_counter() - start)
            for algorithm in HASHES:
                out[algorithm].append(_hashed_gbps(tmp / "async.pt" / "__0_0.distcp", algorithm))
    return out


def stall_table(repeats: int) -> str:
    s = {key: Stat(values) for key, values in stall(repeats).items()}
    blocked = s["blocked"].median / s["sync"].median
    return f"""Checkpoint stall, one process, a 200 MB state dict; the app's save with and without
its checksums, alternating (ratio: paired, median and range):

| save | loop blocked, s | the background write, start to on disk, s |
|---|---|---|
| `dcp.save` (synchronous) | {s['sync'].fmt()} | |
| app, sharded, background, with checksums | {s['blocked'].fmt()} | {s['write'].fmt()} |
| app, sharded, background, without checksums | {s['blocked_unsummed'].fmt()} | \
{s['write_unsummed'].fmt()} |
| with / without checksums | {ratio_range(s['blocked'], s['blocked_unsummed'])} | \
{ratio_range(s['write'], s['write_unsummed'])} |
| blocked (with checksums) / synchronous | {blocked:.2f} | |

Hashing throughput over the 200 MB shard file, GB/s: CRC-32 (zlib, the app's) \
{s['crc32'].fmt()}, sha256 {s['sha256'].fmt()}, blake2b {s['blake2b'].fmt()}."""


def section(tmp: Path, repeats: int, repo: Path) -> str:
    runs = _runs(tmp, repeats, repo)
    ddp, fsdp = _rank_peak(runs["ddp"]), _rank_peak(runs["fsdp"])
    ddp_base, fsdp_base = _rank_peak(runs["ddp_base"]), _rank_peak(runs["fsdp_base"])
    ddp_cost, fsdp_cost = ddp.median - ddp_base.median, fsdp.median - fsdp_base.median
    share = fsdp_cost / ddp_cost
    steps = {k: Stat([r.step_s for r in runs[k]]) for k in ("ddp", "fsdp")}
    return f"""Memory per rank, 2 ranks, MLP {WIDTH} -> {WIDTH} -> 10 (205 MB of weights), AdamW,
batch 16 per rank, {STEPS} steps; peak resident memory of the larger rank, MB:

| strategy | peak with the model | peak with a 16-wide layer | the model's cost |
|---|---|---|---|
| ddp | {ddp.fmt(digits=0)} | {ddp_base.fmt(digits=0)} | {ddp_cost:.0f} |
| fsdp | {fsdp.fmt(digits=0)} | {fsdp_base.fmt(digits=0)} | {fsdp_cost:.0f} |
| fsdp / ddp | | | {share:.2f} (target about 0.5: {'met' if share <= 0.6 else '**missed**'}) |

Step time of the same runs: ddp {steps['ddp'].fmt(1e3)} ms, fsdp {steps['fsdp'].fmt(1e3)} ms;
fsdp / ddp {ratio_range(steps['fsdp'], steps['ddp'])} (on the CPU, FSDP gathers the weights
for the forward and again for the backward, and reduce-scatters the gradients, where DDP
all-reduces them once).

{stall_table(repeats)}"""
