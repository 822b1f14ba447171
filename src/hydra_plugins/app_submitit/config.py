"""In app, `hydra/launcher=submitit_slurm` and `submitit_local` are app's launchers (typed
nodes, subclasses of the stock schemas); in every other Hydra program they stay the stock ones.
Hydra has no per-program choice of a node of the same name (a YAML file of that name is
validated against the stock schema), so it is made where Hydra builds a program's search path,
after its plugin scan and before it composes (`AppLaunchers`). Nothing of app is imported."""

# (No `from __future__ import annotations`: Hydra's scan executes this module outside
# sys.modules, where dataclasses cannot resolve string annotations.)
from dataclasses import dataclass
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.config_store import ConfigStore
from hydra.plugins.search_path_plugin import SearchPathPlugin
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf
from omegaconf import II

# GPUs to ask for: `devices` per node when accelerator=cuda, none otherwise.
GPUS = II("app_gpus_per_node:${accelerator},${devices}")


@dataclass
class AppSlurmConf(SlurmQueueConf):
    """SLURM through submitit: one task (rank) per device, devices and nodes stated once."""

    _target_: str = "hydra_plugins.app_submitit.launcher.AppSlurmLauncher"
    tasks_per_node: int = II("app_tasks_per_node:${devices}")  # one task (rank) per device
    nodes: int = II("nodes")  # machines, as the job's `nodes`
    gpus_per_node: int | None = GPUS
    cpus_per_task: int | None = 4  # CPU cores per task (data loading, the Python process)
    mem_gb: int | None = 16  # memory per node, GB
    timeout_min: int = 60  # time limit of one run of the job; requeued up to max_num_timeout
    max_num_timeout: int = 3  # times a job that hits its time limit is requeued (it resumes)
    # requeues after a task killed by a signal or a failed node (not an exception); it resumes
    max_num_failures: int = 3
    signal_delay_s: int = 120  # seconds before the time limit at which Slurm sends USR2
    # false: submit, say how to follow the jobs (python -m app.status DIR) and exit at once
    wait: bool = True
    # true: print each array's sbatch script, check it against the cluster, submit nothing;
    # json: the same as one JSON document (docs/json.md)
    dry_run: bool | str = False
    # the jobs (and their requeues) run a copy of the code taken at submission
    code_snapshot: bool = True
    snapshot_max_mb: float = 100  # a larger snapshot is refused (one line), nothing submitted


@dataclass
class AppLocalConf(LocalQueueConf):
    """Local submitit jobs: one process per job, which starts its `devices` workers."""

    _target_: str = "hydra_plugins.app_submitit.launcher.AppLocalLauncher"
    tasks_per_node: int = 1  # the job's process spawns its `devices` workers itself
    gpus_per_node: int | None = GPUS
    timeout_min: int = 60  # time limit of a job, minutes


# app's conf/ beside src/ (a checkout), or the copy a wheel installs (app/conf; as app/conf_dir.py)
_HERE = Path(__file__).resolve().parent  # .../hydra_plugins/app_submitit
_APP_CONF = {_HERE.parents[2] / "conf", _HERE.parents[1] / "app" / "conf"}
_NODES = {"submitit_slurm": (AppSlurmConf, SlurmQueueConf),
          "submitit_local": (AppLocalConf, LocalQueueConf)}
_PROVIDER = "app"


def is_app(search_path: ConfigSearchPath) -> bool:
    """Whether the program's primary config folder is app's conf/."""
    for element in search_path.get_path():
        if element.provider != "main" or element.path is None:
            continue
        path = element.path
        if path == "pkg://app.conf":
            return True
        path = path.removeprefix("file://")  # (a folder is given with it or without a scheme)
        return "://" not in path and Path(path).resolve() in _APP_CONF
    return False


def choose_launchers(app: bool) -> None:
    """app's nodes under the stock names for app; the stock ones back for any other program."""
    store = ConfigStore.instance()
    for name, (ours, stock) in _NODES.items():  # (the stock nodes were stored on import)
        if app:
            store.store(group="hydra/launcher", name=name, node=ours, provider=_PROVIDER)
        elif store.load(f"hydra/launcher/{name}.yaml").provider == _PROVIDER:
            store.store(group="hydra/launcher", name=name, node=stock(),
                        provider="submitit_launcher")


class AppLaunchers(SearchPathPlugin):
    """Adds no search path: the hook Hydra calls with the program's (see the docstring)."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        choose_launchers(is_app(search_path))
