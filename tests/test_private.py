"""Each private internal app reaches for (app._private) still works on the installed versions.

An upgrade of PyTorch, Hydra, submitit or Python that moves one fails here, by name.
"""

from __future__ import annotations

import pytest

from app import _private
from app.errors import InternalMissing


def test_the_slurm_watcher_is_ours_and_reads_app_slurm(tmp_path, monkeypatch) -> None:
    from submitit.slurm.slurm import SlurmJob

    from app import slurm
    from hydra_plugins.app_submitit._slurm_states import SlurmStates

    monkeypatch.setattr(SlurmJob, "watcher", SlurmJob.watcher)  # restored afterwards
    watcher = SlurmStates()
    _private.set_slurm_watcher(watcher)
    assert SlurmJob.watcher is watcher
    SlurmJob(folder=tmp_path, job_id="42")  # registers with the watcher
    SlurmJob(folder=tmp_path, job_id="43")
    states = {"42": slurm.Job("42", "COMPLETED"), "43": slurm.Job("43", "RUNNING")}
    monkeypatch.setattr(slurm, "states", lambda ids: {i: states[i] for i in ids})
    watcher.update()
    assert watcher.get_state("42", mode="cache") == "COMPLETED" and watcher.is_done("42")
    assert watcher.get_state("43", mode="cache") == "RUNNING"
    states["43"] = slurm.Job("43", "FAILED")
    watcher.update()
    assert watcher.get_state("43", mode="cache") == "FAILED" and watcher.is_done("43")


def test_the_sbatch_script_of_an_array_is_written_as_submitit_writes_it(tmp_path) -> None:
    import submitit

    executor = submitit.AutoExecutor(folder=tmp_path / "%j", cluster="slurm")
    executor.update_parameters(slurm_partition="debug", timeout_min=5)
    array = _private.sbatch_script(executor, 3)
    assert "#SBATCH --array=0-2%3" in array and "#SBATCH --partition=debug" in array
    assert "#SBATCH --time=5" in array and "-m submitit.core._submit" in array
    assert "--array" not in _private.sbatch_script(executor, 1)


def test_a_dcp_checkpoint_is_read_whole_without_a_model(tmp_path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "optimizer": {"lr": 0.5}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    read = _private.read_dcp_whole(dcp.FileSystemReader(str(tmp_path)))
    assert torch.equal(read["model"]["w"], state["model"]["w"])
    assert read["optimizer"] == {"lr": 0.5}


def test_a_sweep_s_jobs_are_numbered_as_the_basic_sweeper_runs_them() -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(["a=1,2", "b=x,y", "c=3"])
    assert _private.basic_sweep_jobs(parsed) == [
        ["a=1", "b=x", "c=3"], ["a=1", "b=y", "c=3"], ["a=2", "b=x", "c=3"], ["a=2", "b=y", "c=3"]]


def test_the_cuda_allocator_s_history_is_reached_where_torch_has_it(monkeypatch) -> None:
    """Called for real on a GPU (tests/test_gpu.py); here: the two functions are there (a
    monkeypatch of a missing one raises), and one gone is named."""
    import torch.cuda.memory as memory

    calls = []
    monkeypatch.setattr(memory, "_record_memory_history",
                        lambda on, max_entries: calls.append(on))
    monkeypatch.setattr(memory, "_dump_snapshot", lambda path: calls.append(path))
    _private.record_memory_history(True)
    _private.record_memory_history(False)
    _private.dump_memory_snapshot("x.pickle")
    assert calls == ["all", None, "x.pickle"]
    monkeypatch.delattr(memory, "_dump_snapshot")
    with pytest.raises(InternalMissing, match=r"_dump_snapshot is gone"):
        _private.dump_memory_snapshot("x.pickle")


def test_torch_compile_s_time_and_cache_counts_are_reached_where_torch_keeps_them(
        monkeypatch) -> None:
    """Their meaning is checked for real by tests/test_compile_cache.py (a run's compile
    misses the cache, its resumed run hits it); here: they are there, and one gone is named."""
    from torch._dynamo import utils

    seconds, counts = _private.compile_stats()
    assert seconds >= 0 and set(counts) == {"hits", "misses"}
    monkeypatch.delattr(utils, "calculate_time_spent")
    with pytest.raises(InternalMissing, match=r"calculate_time_spent is gone"):
        _private.compile_stats()


def test_inductor_s_default_cache_folder_is_the_one_it_sets_itself(monkeypatch) -> None:
    from torch._inductor.runtime import cache_dir_utils

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert cache_dir_utils.cache_dir() == _private.inductor_default_cache_dir()
    monkeypatch.delattr(cache_dir_utils, "default_cache_dir")
    with pytest.raises(InternalMissing, match=r"default_cache_dir is gone"):
        _private.inductor_default_cache_dir()
