"""OmegaConf resolvers used in conf/: the run directory's name, SLURM resources, the path of
the reference page and the config groups (--help)."""

from __future__ import annotations

from omegaconf import OmegaConf

from app.conf_dir import reference
from app.errors import UserError
from app.help import config_groups
from app.rundir.name import run_name


def slurm_tasks_per_node(devices: int | str) -> int:
    """One SLURM task per device: a number is needed when the job is submitted."""
    if devices == "auto" or not str(devices).isdigit():
        raise UserError(f"devices={devices}: SLURM jobs need a number of devices per node")
    return int(devices)


def slurm_gpus_per_node(accelerator: str, devices: int | str) -> int | None:
    """GPUs to ask for: one per task on cuda; none otherwise."""
    return slurm_tasks_per_node(devices) if accelerator == "cuda" else None


def register_resolvers() -> None:
    for name, fn in (("app_run_name", run_name), ("app_tasks_per_node", slurm_tasks_per_node),
                     ("app_gpus_per_node", slurm_gpus_per_node), ("app_reference", reference),
                     ("app_config_groups", config_groups)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
