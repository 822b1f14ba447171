"""app's launcher options: `hydra/launcher=submitit_slurm` and `hydra/launcher=submitit_local`
(`launcher=slurm` selects the first) run app's launchers (launcher.py), not the stock ones.

They are typed nodes in Hydra's ConfigStore, subclasses of hydra-submitit-launcher's schemas
stored under the stock names, so a misspelt or mistyped launcher key fails at compose time and
users type what the stock plugin documents. They are not YAML files of the same names: Hydra
validates such a file against the ConfigStore schema of that name, a deprecated mechanism
that warns on every run ("automatic schema matching").

The stock plugin stores its nodes when its module is executed, and Hydra's plugin scan
executes every plugin module again, in an order that depends on how the packages are
installed; nodes stored at import could be overwritten. Hydra calls search-path plugins
after that scan and before it composes anything, so that is where ours are stored.
"""

# (No `from __future__ import annotations`: Hydra's scan executes this module outside
# sys.modules, where dataclasses cannot resolve string annotations.)
from dataclasses import dataclass, field

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.config_store import ConfigStore
from hydra.plugins.search_path_plugin import SearchPathPlugin
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf
from omegaconf import II

# GPUs to ask for: `devices` per node when accelerator=cuda, none otherwise.
GPUS = II("app_gpus_per_node:${accelerator},${devices}")


@dataclass
class AppSlurmConf(SlurmQueueConf):
    """SLURM through submitit, with app's launcher (validates before submitting; a failing
    task fails the job). You state devices and nodes once: one task per device, each task one
    rank."""

    _target_: str = "hydra_plugins.app_submitit.launcher.AppSlurmLauncher"
    tasks_per_node: int = II("app_tasks_per_node:${devices}")  # one task (rank) per device
    nodes: int = II("nodes")  # machines, as the job's `nodes`
    gpus_per_node: int | None = GPUS
    cpus_per_task: int | None = 4  # CPU cores per task (data loading, the Python process)
    mem_gb: int | None = 16  # memory per node, GB
    timeout_min: int = 60  # time limit of one run of the job; requeued up to max_num_timeout
    max_num_timeout: int = 3  # times a job that hits its time limit is requeued (it resumes)
    # times a job is requeued after a transient fault (a task killed by a signal, a node that
    # failed), apart from timeouts; it resumes from last.pt. An exception stays a failure.
    max_num_failures: int = 3
    signal_delay_s: int = 120  # seconds before the time limit at which Slurm sends USR2
    # Lines run before srun: a failing task ends the others.
    setup: list[str] | None = field(default_factory=lambda: ["export SLURM_KILL_BAD_EXIT=1"])
    # false: submit, record the jobs in the sweep directory, print how to follow them and
    # exit 0 at once (python -m app.status / app.report DIR); Optuna needs results: refused.
    wait: bool = True
    # true: print each array's sbatch script and the resources, check them against the
    # cluster (partitions, limits, nodes, MaxArraySize) and submit nothing.
    dry_run: bool = False
    # Copy the code the jobs import (tracked files) into the sweep directory at submission,
    # and run the jobs (and their requeues) from that copy: edits never reach a queued job.
    code_snapshot: bool = True
    snapshot_max_mb: float = 100  # a larger snapshot is refused (one line), nothing submitted


@dataclass
class AppLocalConf(LocalQueueConf):
    """Local submitit jobs (one process per job, which spawns `devices` workers), with app's
    launcher: validates before submitting; a failing job is reported as failed."""

    _target_: str = "hydra_plugins.app_submitit.launcher.AppLocalLauncher"
    tasks_per_node: int = 1  # the job's process spawns its `devices` workers itself
    gpus_per_node: int | None = GPUS
    timeout_min: int = 60  # time limit of a job, minutes


def store_launchers() -> None:
    store = ConfigStore.instance()
    store.store(group="hydra/launcher", name="submitit_slurm", node=AppSlurmConf, provider="app")
    store.store(group="hydra/launcher", name="submitit_local", node=AppLocalConf, provider="app")


class AppLaunchers(SearchPathPlugin):
    """Adds no search path: the hook Hydra calls after its plugin scan (see the docstring)."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        store_launchers()
