"""Unit tests of the pure parts: checkpoint files, schedules, metric files, RNG state, samplers."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from app import dist
from app.checkpoint import io, layout, restore
from app.checkpoint.rng import rng_state, set_rng_state
from app.errors import AppError, UserError
from app.reporting.loggers import CSVLogger
from app.schedulers import constant, respread, step, warmup_cosine
from app.training.build import ResumableSampler, shard_indices
from app.training.data_errors import DataItemError, NamedItems
from conftest import make_config


def test_save_is_atomic_and_links_share_one_file(tmp_path) -> None:
    d = tmp_path / "checkpoints"
    first = d / io.periodic_name(1)
    io.save({"model": {"w": torch.ones(3)}}, first)
    io.link(first, d / "last.pt")
    assert os.path.samefile(first, d / "last.pt")
    second = d / io.periodic_name(2)
    io.save({"model": {"w": torch.zeros(3)}}, second)
    io.link(second, d / "last.pt")
    assert torch.equal(layout.load(d / "last.pt")["model"]["w"], torch.zeros(3))
    assert torch.equal(layout.load(first)["model"]["w"], torch.ones(3))
    assert not list(d.glob(".*.tmp"))


def test_failed_write_keeps_previous_file(tmp_path, monkeypatch) -> None:
    path = tmp_path / "last.pt"
    io.save({"model": {"w": torch.ones(2)}}, path)

    def broken_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(AppError, match="could not be written .* already on disk are intact"):
        io.save({"model": {"w": torch.zeros(2)}}, path)
    assert torch.equal(layout.load(path)["model"]["w"], torch.ones(2))
    assert not list(tmp_path.glob(".*.tmp"))  # the partial file is gone


def test_prune_keeps_newest_and_named_links(tmp_path) -> None:
    for s in range(1, 6):
        io.save({"model": {}}, tmp_path / io.periodic_name(s))
    io.link(tmp_path / io.periodic_name(1), tmp_path / "best.pt")
    io.prune(tmp_path, keep=2)
    names = sorted(p.name for p in tmp_path.glob("*.pt"))
    assert names == ["best.pt", io.periodic_name(4), io.periodic_name(5)]
    io.prune(tmp_path, keep=0)
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["best.pt"]


def test_load_errors_name_the_file(tmp_path) -> None:
    with pytest.raises(UserError, match="not found"):
        layout.load(tmp_path / "nope.pt")
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00" * 100)
    with pytest.raises(UserError, match="garbage.pt"):
        layout.load(garbage)
    # Random bytes make the unpickler fail in many ways (IndexError, KeyError, ...): each is
    # a UserError naming the file, never a traceback.
    rng = random.Random(0)
    for _ in range(300):
        garbage.write_bytes(rng.randbytes(rng.choice((8, 64, 2048))))
        with pytest.raises(UserError, match="garbage.pt"):
            layout.load(garbage)
    other = tmp_path / "other.pt"
    torch.save({"weights": 1}, other)
    with pytest.raises(UserError, match="not an app checkpoint"):
        layout.load(other)


def test_mismatched_weights_list_the_differences() -> None:
    model = torch.nn.Linear(4, 2)
    state = {"model": {"weight": torch.zeros(3, 4), "extra": torch.zeros(1)},
             "config": {"model": {"_target_": "x.Y"}}}
    with pytest.raises(UserError) as err:
        restore.load_model_weights(model, state, "c.pt")
    message = str(err.value)
    assert "missing: bias" in message and "unexpected: extra" in message
    assert "weight (3, 4) vs (2, 4)" in message and "x.Y" in message


def _lrs(scheduler, n):
    out = []
    for _ in range(n):
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def _opt(lr=1.0):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_schedules() -> None:
    assert _lrs(constant(_opt(), 10), 3) == [1.0, 1.0, 1.0]
    assert _lrs(step(_opt(), 10, step_size=2, gamma=0.5), 5) == [1.0, 1.0, 0.5, 0.5, 0.25]
    lrs = _lrs(warmup_cosine(_opt(), total_steps=10, warmup_steps=4), 11)
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))
    assert lrs[10] == pytest.approx(0.0)


def test_schedule_state_round_trip() -> None:
    a = warmup_cosine(_opt(), total_steps=20, warmup_steps=3)
    _lrs(a, 7)
    b = warmup_cosine(_opt(), total_steps=20, warmup_steps=3)
    b.load_state_dict(a.state_dict())
    assert _lrs(a, 5) == _lrs(b, 5)


def test_a_respread_cosine_goes_on_from_where_it_is_and_ends_at_the_new_last_step() -> None:
    """A resume on half the ranks at step 10 of 20: 20 steps were left where 10 were."""
    saved = warmup_cosine(_opt(), total_steps=20, warmup_steps=4)
    _lrs(saved, 10)
    resumed = warmup_cosine(_opt(), total_steps=40, warmup_steps=4)  # as the loop builds it
    resumed.load_state_dict(saved.state_dict())
    respread(resumed, step=10, made_for=20, total_steps=30)
    assert resumed.lr_lambdas[0](10) == saved.get_last_lr()[0]  # no jump
    after = _lrs(resumed, 21)  # the lr of steps 11 to 31
    assert all(a > b for a, b in zip(after, after[1:], strict=False))  # decays to the end
    assert after[19] > 0 and after[20] == pytest.approx(0.0)  # (0 after the last step)
    again = warmup_cosine(_opt(), total_steps=40, warmup_steps=4)  # a later resume keeps it
    again.load_state_dict(resumed.state_dict())
    assert _lrs(again, 1) == [after[20]]


def test_respread_leaves_a_schedule_of_another_length_and_a_warm_up_goes_on() -> None:
    # Saved for 20 steps while the run's end was counted 25 (max_epochs raised): as saved.
    saved = warmup_cosine(_opt(), total_steps=20, warmup_steps=4)
    _lrs(saved, 10)
    respread(saved, step=10, made_for=25, total_steps=30)
    assert saved.lr_lambdas[0].total_steps == 20
    # In the warm-up: it ends as it would have, the decay then spans the new length.
    warming = warmup_cosine(_opt(), total_steps=20, warmup_steps=4)
    head = _lrs(warming, 2)
    respread(warming, step=2, made_for=20, total_steps=10)
    lrs = _lrs(warming, 9)
    assert head + lrs[:2] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[-1] == pytest.approx(0.0)


def test_a_warm_up_longer_than_the_run_is_named_with_its_fix(caplog) -> None:
    warmup_cosine(_opt(0.003), total_steps=15, warmup_steps=20)
    assert [r.getMessage() for r in caplog.records] == [
        "scheduler.warmup_steps=20 is longer than the run's 15 steps: the learning rate "
        "climbs to 0.00225, never to its peak 0.003 (optimizer.lr); set "
        "scheduler.warmup_steps=2, say"]
    caplog.clear()
    warmup_cosine(_opt(0.003), total_steps=20, warmup_steps=20)  # (its last step reaches it)
    assert not caplog.records


def test_csv_logger_widens_and_truncates_on_resume(tmp_path) -> None:
    path = tmp_path / "metrics.csv"
    log = CSVLogger(path)
    log.log(1, 0, "train", {"loss": 2.0, "lr": 0.1})
    log.log(2, 0, "val", {"loss": 1.5, "acc": 0.5})
    log.log(3, 0, "train", {"loss": 1.0, "lr": 0.1})
    # The earlier rows are kept, read back from the file (not from memory) at the widening.
    assert path.read_text().splitlines() == [
        "step,epoch,split,loss,lr,acc", "1,0,train,2.0,0.1,", "2,0,val,1.5,,0.5",
        "3,0,train,1.0,0.1,"]
    resumed = CSVLogger(path, resume_step=2)
    resumed.log(3, 0, "train", {"loss": 0.9, "lr": 0.1})
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and lines[-1].startswith("3,0,train,0.9")
    path.unlink()  # removed by hand: the next new column starts a new table
    resumed.log(4, 0, "val", {"top5": 1.0})
    assert path.read_text().splitlines() == ["step,epoch,split,loss,lr,acc,top5", "4,0,val,,,,1.0"]


def test_csv_logger_drops_a_partial_last_line_on_resume(tmp_path) -> None:
    path = tmp_path / "metrics.csv"
    log = CSVLogger(path)
    log.log(1, 0, "train", {"loss": 2.0})
    log.log(2, 0, "train", {"loss": 1.0})
    path.write_text(path.read_text() + "3,0,tra")  # killed while appending row 3
    CSVLogger(path, resume_step=5)
    assert path.read_text().splitlines() == ["step,epoch,split,loss", "1,0,train,2.0",
                                             "2,0,train,1.0"]
    assert not list(tmp_path.glob(".*.tmp"))


def test_named_items_fetch_a_batch_and_name_the_failing_index() -> None:
    class Faulty(TensorDataset):
        def __getitem__(self, i):
            if i == 7:
                raise ValueError("corrupt sample")
            return super().__getitem__(i)

    items = NamedItems(TensorDataset(torch.arange(10.0)), "training")
    batches = list(DataLoader(items, batch_size=4))
    assert [b[0].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with pytest.raises(DataItemError, match="training item 7 failed to load: ValueError"):
        list(DataLoader(NamedItems(Faulty(torch.arange(10.0)), "training"), batch_size=4))


def test_rng_state_round_trip() -> None:
    state = rng_state()
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a


def test_resumable_sampler_skips_without_changing_order() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(20))
    sampler = ResumableSampler(data, seed=3)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.set_epoch(2, skip=7)
    assert list(sampler) == full[7:] and len(sampler) == 13
    sampler.set_epoch(3)
    assert list(sampler) != full and sorted(sampler) == list(range(20))


def test_shard_sampler_and_helpers_without_process_group() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(7))
    assert list(shard_indices(data)) == list(range(7))
    assert (dist.rank(), dist.world_size(), dist.is_main(), dist.is_main(local=True)) == (
        0, 1, True, True)
    dist.barrier()
    x = torch.tensor([1.0, 2.0])
    assert torch.equal(dist.all_reduce_mean(x), x)
    assert dist.broadcast_object({"a": 1}) == {"a": 1}
    assert dist.all_gather_object(5) == [5]


def test_cpu_ranks_share_the_cores_unless_bound_or_told(monkeypatch) -> None:
    from app.training import runtime

    chosen = []
    monkeypatch.setattr(runtime.torch, "set_num_threads", chosen.append)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(runtime.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: set(range(8)))
    runtime.share_cpu_threads(2)  # both ranks see all 8 cores: 4 threads each
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: {2, 3})
    runtime.share_cpu_threads(2)  # bound to 2 cores of its own (Slurm task binding)
    runtime.share_cpu_threads(16)  # more ranks than cores: never fewer than 1 thread
    assert chosen == [4, 2, 2]
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: set(range(8)))
    runtime.share_cpu_threads(32)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    runtime.share_cpu_threads(2)  # the user's setting wins
    assert chosen == [4, 2, 2, 1]


def test_the_worker_server_ignores_ctrl_c_while_it_imports_torch() -> None:
    # Its imports run before it sets its own handlers: a Ctrl-C there ended it with a traceback.
    import app.launch.spawn as spawn

    def ours(signum: int, frame: object) -> None: ...

    previous = signal.signal(signal.SIGINT, ours)
    try:
        spawn.prestart(make_config("devices=2"))
        assert signal.getsignal(signal.SIGINT) is ours  # put back
    finally:
        signal.signal(signal.SIGINT, previous)
    pid = spawn._server().pid
    status = Path(f"/proc/{pid}/status").read_text()
    ignored = int(next(x for x in status.splitlines() if x.startswith("SigIgn:")).split()[1], 16)
    assert ignored & (1 << (signal.SIGINT - 1)), status


def test_the_resume_hint_names_the_sweep_for_a_job_of_a_sweep(tmp_path) -> None:
    """A stopped job of a sweep (Slurm too) resumes with the sweep's command; told to rerun
    its run directory alone, it would have resumed locally, outside its sweep."""
    from app.rundir.name import resume_hint

    assert resume_hint(tmp_path / "run") == \
        f"run the same command again with hydra.run.dir={tmp_path / 'run'} to resume"
    (tmp_path / "multirun.yaml").write_text("hydra: {}\n")
    assert resume_hint(tmp_path / "3") == f"run the sweep's command again with " \
                                          f"hydra.sweep.dir={tmp_path} to resume"


def test_the_resume_hint_knows_a_sweep_job_without_multirun_yaml(tmp_path) -> None:
    """The Optuna sweeper writes no multirun.yaml: the job's own hydra.yaml says MULTIRUN."""
    from app.rundir.name import resume_hint

    job = tmp_path / "search" / "1"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "hydra.yaml").write_text("hydra:\n  mode: MULTIRUN\n")
    assert resume_hint(job) == f"run the sweep's command again with " \
                               f"hydra.sweep.dir={tmp_path / 'search'} to resume"
