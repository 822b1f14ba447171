"""Every reach into another library's private internals, in one place: two, both submitit's.

submitit offers no public way to do these: its Slurm state watcher (replaced by one that
reads app.slurm's job states: scontrol, then sacct), and the sbatch script it would write
(`dry_run`). Each accessor checks that what it reaches for is there; tests/test_private.py
exercises each one on the installed versions, so an upgrade that moves one fails there, by
name, rather than somewhere inside a run.
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


# submitit -----------------------------------------------------------------------------------

def slurm_info_watcher() -> type:
    """submitit's class that polls sacct for job states (subclassed to read app.slurm's)."""
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
