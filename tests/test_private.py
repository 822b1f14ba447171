"""Each private internal app reaches for (app._private) still works on the installed versions.

An upgrade of PyTorch, Hydra, submitit or Python that moves one fails here, by name.
"""

from __future__ import annotations

import signal
import subprocess

import pytest
import torch
import torch.distributed as tdist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data._utils import signal_handling

from app import _private


def test_the_process_group_store_is_reached_and_cloned(tmp_path) -> None:
    from app.launch.watchdog import _store_client

    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                             world_size=1)
    try:
        store = _private.process_group_store()
        store.set("probe", "1")
        client = _store_client()  # the watchdog's own connection
        assert client is not None and client.get("probe") == b"1"
    finally:
        tdist.destroy_process_group()


def test_the_slurm_watcher_is_ours_and_reads_sacct_and_squeue(tmp_path, monkeypatch) -> None:
    from submitit.slurm.slurm import SlurmJob

    from hydra_plugins.app_submitit._slurm_states import SlurmStates

    monkeypatch.setattr(SlurmJob, "watcher", SlurmJob.watcher)  # restored afterwards
    watcher = SlurmStates()
    _private.set_slurm_watcher(watcher)
    assert SlurmJob.watcher is watcher
    SlurmJob(folder=tmp_path, job_id="42")  # registers with the watcher
    SlurmJob(folder=tmp_path, job_id="43")
    out = {"sacct": "JobID|State|NodeList\n42|COMPLETED|n1\n43|RUNNING|n1\n",
           "squeue": "43|FAILED\n"}

    def run(command: list[str]) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(command, 0, out[command[0]], "")

    monkeypatch.setattr(watcher, "_run", run)
    watcher.update()
    assert watcher.get_state("42", mode="cache") == "COMPLETED" and watcher.is_done("42")
    assert watcher.get_state("43", mode="cache") == "RUNNING"
    watcher.source = "squeue"  # as after sacct failed
    watcher.update()
    assert watcher.get_state("43", mode="cache") == "FAILED" and watcher.is_done("43")


def test_a_loaders_workers_are_found() -> None:
    data = TensorDataset(torch.zeros(8, 2))
    batches = iter(DataLoader(data, batch_size=2, num_workers=1))
    next(batches)
    workers = _private.loader_workers(batches)
    assert workers is not None and len(workers) == 1
    assert workers[0].pid > 0 and workers[0].exitcode is None and workers[0].sentinel
    del batches
    assert _private.loader_workers(iter(DataLoader(data, num_workers=0))) is None


@pytest.mark.parametrize("unset", [False, True])
def test_the_dataloader_sigchld_handler_is_kept_out(monkeypatch, unset: bool) -> None:
    monkeypatch.setattr(signal_handling, "_SIGCHLD_handler_set", False)
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        if unset:
            _private.no_sigchld_handler()
        batches = iter(DataLoader(TensorDataset(torch.zeros(4, 2)), num_workers=1))
        next(batches)
        del batches
        # Without the flag PyTorch installs its handler: the case that shows the flag works.
        assert (signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL) is unset
    finally:
        signal.signal(signal.SIGCHLD, previous)


def test_the_sbatch_script_of_an_array_is_written_as_submitit_writes_it(tmp_path) -> None:
    import submitit

    executor = submitit.AutoExecutor(folder=tmp_path / "%j", cluster="slurm")
    executor.update_parameters(slurm_partition="debug", timeout_min=5)
    array = _private.sbatch_script(executor, 3)
    assert "#SBATCH --array=0-2%3" in array and "#SBATCH --partition=debug" in array
    assert "#SBATCH --time=5" in array and "-m submitit.core._submit" in array
    assert "--array" not in _private.sbatch_script(executor, 1)
