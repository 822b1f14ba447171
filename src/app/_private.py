"""Every reach into another library's private internals, in one place: five.

PyTorch and submitit offer no public way to do these: the process group's store (the stall
watchdog's channel), a DataLoader's worker processes (to name the one that died), keeping
out the DataLoader's SIGCHLD handler, submitit's Slurm state watcher (squeue where sacct
fails), and the sbatch script submitit would write (`dry_run`). Each accessor checks that
what it reaches for is there; tests/test_private.py exercises each one on the installed
versions, so an upgrade that moves one fails there, by name, rather than somewhere inside a
run. Where a caller can do without (a less precise
message), a missing internal reads as "nothing to report", as the callers did before.
"""

from __future__ import annotations

from typing import Any

from app.errors import InternalMissing


def _attr(owner: Any, name: str) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError:
        where = getattr(owner, "__name__", type(owner).__name__)
        raise InternalMissing(f"{where}.{name} is gone: this version changed an internal "
                              f"that app._private reaches for") from None


# PyTorch ------------------------------------------------------------------------------------

def process_group_store() -> Any:
    """The default process group's store (the watchdog's own connection is cloned from it)."""
    from torch.distributed import distributed_c10d

    return _attr(distributed_c10d, "_get_default_store")()


def loader_workers(obj: Any) -> list[Any] | None:
    """The worker processes of `obj` if it is a DataLoader iterator that has workers, else
    None (also when the internals are gone: this runs while an error is being reported)."""
    from torch.utils.data import dataloader

    kind = getattr(dataloader, "_MultiProcessingDataLoaderIter", None)
    if kind is None or not isinstance(obj, kind):
        return None
    return list(getattr(obj, "_workers", ()))


def no_sigchld_handler() -> None:
    """Mark PyTorch's DataLoader SIGCHLD handler as installed already, so it never is (when
    the flag is gone, PyTorch's handler reports a dead worker, as it would anyway)."""
    from torch.utils.data._utils import signal_handling

    if hasattr(signal_handling, "_SIGCHLD_handler_set"):
        signal_handling._SIGCHLD_handler_set = True


# submitit -----------------------------------------------------------------------------------

def slurm_info_watcher() -> type:
    """submitit's class that polls sacct for job states (subclassed to add squeue)."""
    from submitit.slurm.slurm import SlurmInfoWatcher

    return SlurmInfoWatcher


def set_slurm_watcher(watcher: Any) -> None:
    """Make `watcher` the one every SlurmJob of this process registers with (submitit keeps a
    single watcher as a class attribute): set it before submitting."""
    from submitit.slurm.slurm import SlurmJob

    _attr(SlurmJob, "watcher")
    SlurmJob.watcher = watcher


def sbatch_script(executor: Any, num_jobs: int) -> str:
    """The sbatch script an executor (submitit's AutoExecutor for Slurm) would submit for an
    array of `num_jobs` jobs (one job: no array), as submitit writes it."""
    from submitit.slurm.slurm import _make_sbatch_string

    inner = _attr(executor, "_executor")
    parameters = dict(_attr(inner, "parameters"))
    if num_jobs > 1:
        parameters["map_count"] = num_jobs
    return _make_sbatch_string(command=_attr(inner, "_submitit_command_str"),
                               folder=_attr(inner, "folder"), **parameters)
