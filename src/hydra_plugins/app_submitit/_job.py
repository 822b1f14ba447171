"""The job's side, a mixin of `launcher._AppSubmititLauncher`: each job's config composed and
validated before submission, and what runs in the job (`__call__`)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from . import log, refuse


def device_slice(job_num: int, devices: int | str, ids: list[str]) -> list[str] | None:
    """The devices of local job `job_num`, round-robin; None when there is nothing to split."""
    if devices == "auto" or len(ids) < 2 or devices >= len(ids):
        return None
    slot = job_num % (len(ids) // devices)
    return ids[slot * devices:(slot + 1) * devices]


def uses_job_id(config: DictConfig) -> bool:
    return "hydra.job.id" in str(OmegaConf.to_container(config.hydra.sweep)["subdir"])


class ComposedOnce:
    """Hydra's sweepers compose each job's config to check the batch and throw it away (0.1-0.2
    s a job): wrapped around `load_sweep_config`, this keeps them for the launcher to `take`."""

    def __init__(self, load: Any) -> None:
        self.load, self.kept = load, {}

    def __call__(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        config = self.load(master_config=master_config, sweep_overrides=sweep_overrides)
        self.kept.setdefault((id(master_config), tuple(sweep_overrides)), []).append(config)
        return config

    def take(self, master_config: DictConfig, overrides: list[str]) -> DictConfig:
        kept = self.kept.get((id(master_config), tuple(overrides)))
        return kept.pop(0) if kept else self.load(master_config=master_config,
                                                  sweep_overrides=overrides)

    def forget(self) -> None:
        self.kept.clear()


class JobSide:
    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function,  # type: ignore
                      config=config)
        loader = hydra_context.config_loader
        if not isinstance(loader.load_sweep_config, ComposedOnce):
            loader.load_sweep_config = ComposedOnce(loader.load_sweep_config)

    def _forget_composed(self) -> None:
        self.hydra_context.config_loader.load_sweep_config.forget()

    def _compose_and_validate(self, overrides: list[str], job_num: int) -> DictConfig:
        # app is imported lazily, as the stock plugin does with submitit: Hydra imports every
        # plugin module at start-up, and this one must not slow down runs that don't use it.
        from app.config import to_app_config
        from app.errors import AppError
        from app.from_run import apply_run

        assert self.hydra_context is not None and self.config is not None
        config = self.hydra_context.config_loader.load_sweep_config.take(self.config, overrides)
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.job.num = job_num
            # Fixed strings: the job must not re-derive its directory (from the clock, say).
            # A subdir of the job's id (`${hydra.job.id}`, as with the stock launcher) stays as
            # written: the id is known once the job is submitted (`with_job_id`).
            config.hydra.sweep.dir = str(config.hydra.sweep.dir)
            if not uses_job_id(config):
                config.hydra.sweep.subdir = str(config.hydra.sweep.subdir)
            config.hydra.mode = RunMode.MULTIRUN
        try:
            config = apply_run(config, overrides)  # (the job applies it again: the same)
            cfg = to_app_config(config)
            self._check_allocation(cfg.devices, cfg.nodes)
            self._share_devices(config, cfg, job_num)
        except AppError as e:
            refuse("job #%d (%s): %s", job_num, " ".join(filter_overrides(overrides)), e)
        return config

    def _share_devices(self, config: DictConfig, cfg: Any, job_num: int) -> None:
        """Local jobs run side by side: each gets its own slice of this machine's GPUs."""
        if self._EXECUTOR != "local":
            return
        import os

        import torch

        from app.launch.plan import resolve_accelerator

        if resolve_accelerator(cfg.accelerator, cfg.accelerator_strict) != "cuda":
            return
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(
            torch.cuda.device_count())]
        own = device_slice(job_num, cfg.devices, ids)
        if own is not None:
            with open_dict(config.hydra.job):
                config.hydra.job.env_set.CUDA_VISIBLE_DEVICES = ",".join(own)
            log.info("job #%d: CUDA_VISIBLE_DEVICES=%s", job_num, ",".join(own))

    def _check_allocation(self, devices: int | str, nodes: int) -> None:
        """One allocation serves every job of a sweep: it must fit each job's topology."""
        from app.errors import UserError

        tasks, hosts = self.params["tasks_per_node"], self.params["nodes"]
        if self._EXECUTOR == "local" and (tasks, hosts) != (1, 1):
            raise UserError(
                f"hydra.launcher.tasks_per_node={tasks} nodes={hosts}: a local job is one "
                f"process on this machine, which starts its `devices` workers itself; set "
                f"devices=N instead")
        if self._EXECUTOR == "slurm" and (devices, nodes) != (tasks, hosts):
            raise UserError(
                f"devices={devices} nodes={nodes} differ from the sweep's allocation ({tasks} "
                f"tasks per node, {hosts} nodes): submit one sweep per value of devices and nodes")

    def __call__(self, sweep_overrides: list[str], job_dir_key: str, job_num: int,
                 job_id: str, singleton_state: dict[type, Singleton]) -> JobReturn:
        from app.env import enter, this_process
        from app.errors import JobFailed
        from app.reporting.results import read_result
        from app.signals import hold_sigterm

        assert self.hydra_context is not None
        # submitit ignores SIGTERM in a task (Slurm sends it before SIGKILL); one that comes
        # while the run is set up must still stop the loop at its first step, with a checkpoint.
        hold_sigterm()
        enter()  # this job's place: detected once, in this process's entry
        if self._EXECUTOR == "slurm":
            from ._recover import check_restarts

            check_restarts(self.params.get("max_num_timeout", 0), self.max_num_failures)
        # The stock job, on the config composed and validated at submission.
        self.hydra_context.config_loader.load_sweep_config = \
            lambda *_: self.composed[job_num].copy()
        result = super().__call__(sweep_overrides, job_dir_key, job_num,  # type: ignore
                                  job_id, singleton_state)
        if result.status == JobStatus.FAILED:
            # Raises the job's own exception (Hydra writes a line of its own first: not here)
            with contextlib.redirect_stderr(io.StringIO()):
                _ = result.return_value
        # A one-task job returns NaN when it fails, so that a local sweep goes on
        # (app/__main__.py); its task must still exit non-zero for Slurm to mark it FAILED.
        ended = {} if this_process().is_rank else read_result(
            Path(result.hydra_cfg.hydra.runtime.output_dir))
        if ended.get("status") == "failed":
            raise JobFailed(ended.get("error") or "the job failed")
        return result
