"""Every reach into another library's private internals, in one place: six.

PyTorch, Hydra and submitit offer no public way to do these: reading a sharded checkpoint whole
in memory without a model (DCP's public route, dcp_to_torch_save, writes a copy to disk first),
torch.compile's time spent compiling and its cache hits (kept in torch._dynamo.utils, printed
by TORCH_LOGS and tlparse only) and inductor's default cache folder, the CUDA allocator's
history for a memory snapshot (documented, but underscored), the jobs of a sweep as Hydra's
basic sweeper numbers them (to find a sweep directory used by other values before any job
runs), submitit's Slurm state watcher (replaced by one that reads app.slurm's job states:
scontrol, then sacct), and the sbatch script submitit would write (`dry_run`). Each accessor
checks that what it reaches for is there; tests/test_private.py exercises each one on the
installed versions, so an upgrade that moves one fails there, by name, rather than somewhere
inside a run.
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

def read_dcp_whole(reader: Any) -> dict[str, Any]:
    """Every tensor of a DCP checkpoint, whole, in this process alone (no process group):
    what DCP's own dcp_to_torch_save does before it writes the result to a file."""
    from torch.distributed.checkpoint import default_planner, state_dict_loader

    state: dict[str, Any] = {}
    _attr(state_dict_loader, "_load_state_dict")(
        state, storage_reader=reader,
        planner=_attr(default_planner, "_EmptyStateDictLoadPlanner")(), no_dist=True)
    return state


def record_memory_history(on: bool) -> None:
    """The CUDA caching allocator's history of allocations (for a snapshot on an
    out-of-memory error): documented ("Understanding CUDA Memory Usage"), but underscored."""
    import torch.cuda.memory as memory

    # (the last 100,000 allocations with their stacks: torchtitan's setting)
    _attr(memory, "_record_memory_history")("all" if on else None, max_entries=100_000)


def dump_memory_snapshot(path: Any) -> None:
    """The recorded history, as a file https://pytorch.org/memory_viz reads."""
    import torch.cuda.memory as memory

    _attr(memory, "_dump_snapshot")(str(path))


def compile_stats() -> tuple[float, dict[str, int]]:
    """Seconds torch.compile has spent compiling in this process so far (dynamo's frames and
    the backward graphs compiled at the first backward), and its cache `hits` and `misses`
    so far (inductor's FX graph cache and AOTAutograd's cache): PyTorch's running totals
    (torch._dynamo.reset() sets the time back to zero)."""
    from torch._dynamo import utils

    spent = _attr(utils, "calculate_time_spent")()
    counters = _attr(utils, "counters")
    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return spent.get("total_wall_time", 0.0), {
        "hits": inductor["fxgraph_cache_hit"] + aot["autograd_cache_hit"],
        "misses": inductor["fxgraph_cache_miss"] + aot["autograd_cache_miss"]}


def inductor_default_cache_dir() -> str:
    """The folder inductor falls back on, and writes into TORCHINDUCTOR_CACHE_DIR itself (at
    the import of torch._dynamo): a value there that is this one is not the user's."""
    from torch._inductor.runtime import cache_dir_utils

    return _attr(cache_dir_utils, "default_cache_dir")()


# Hydra --------------------------------------------------------------------------------------

def basic_sweep_jobs(overrides: list[Any]) -> list[list[str]]:
    """Each job's overrides (parsed `Override`s in), in the order Hydra's basic sweeper runs
    them: its batching of a sweep lives in its internal module only."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    split = _attr(BasicSweeper, "split_arguments")
    return [job for batch in split(overrides, None) for job in batch]


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
