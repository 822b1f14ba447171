"""hydra-submitit-launcher, extended for app in three ways:

- Submit what was validated: every job's config is composed and validated in the submitting
  process; one invalid config submits nothing. The composed configs travel with the jobs, so
  a queued job runs its config as it was at submission even if YAML files change later.
- Failures are failures: a task whose job raised exits non-zero (the stock launcher returns
  the error as a value and the task exits 0, leaving Slurm's job COMPLETED), so srun's
  --kill-on-bad-exit ends its peers at once and Slurm marks the job FAILED; the submitting
  command reports the error instead of a traceback wall.
- Requeue after a checkpoint: app's loop itself handles submitit's requeue signal (see
  app/stop.py), so the stock `checkpoint()` (resubmit with the same arguments) suffices.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job, setup_globals
from hydra.types import RunMode
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

log = logging.getLogger(__name__)


class _SacctOnce(logging.Filter):
    """Without Slurm accounting every status poll warns that sacct failed; say it once."""

    seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "Bypassing sacct error" not in record.getMessage():
            return True
        if _SacctOnce.seen:
            return False
        _SacctOnce.seen = True
        record.msg = "sacct failed (no Slurm accounting?): job states come from squeue"
        record.args = ()
        return True


def device_slice(job_num: int, devices: int | str, ids: list[str]) -> list[str] | None:
    """The devices of local job `job_num`: slot job_num mod (len(ids) // devices). More jobs
    than slots share slots round-robin. None when there is nothing to split."""
    if devices == "auto" or len(ids) < 2 or devices >= len(ids):
        return None
    slot = job_num % (len(ids) // devices)
    return ids[slot * devices:(slot + 1) * devices]


def _root_cause(job: Any) -> tuple[int, str, str]:
    """(task, last line of its error, its log) of the task that failed first: a task that
    raises makes its peers fail in their next collective, or get killed by srun."""
    import math

    failures = []
    for task_id in range(job.num_tasks):
        task = job.task(task_id)
        error = task.exception()
        if error is None:
            continue
        result = task.paths.result_pickle
        when = result.stat().st_mtime if result.exists() else math.inf
        parts = str(error).split("----------------------")
        text = parts[1] if len(parts) > 2 else str(error)
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        failures.append((when, task_id, lines[-1] if lines else "unknown error",
                         str(task.paths.stderr)))
    if not failures:
        return 0, "the job ended without a result", str(job.paths.stderr)
    _, task_id, line, log = min(failures)
    return task_id, line, log


class _AppSubmititLauncher(BaseSubmititLauncher):
    def _compose_and_validate(self, overrides: list[str], job_num: int) -> DictConfig:
        # app is imported lazily, as the stock plugin does with submitit: Hydra imports every
        # plugin module at start-up, and this one must not slow down runs that don't use it.
        from app.config import AppError, to_app_config

        assert self.hydra_context is not None and self.config is not None
        config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.job.num = job_num
            # Fixed strings: the job must not re-derive its directory (from the clock, say).
            config.hydra.sweep.dir = str(config.hydra.sweep.dir)
            config.hydra.sweep.subdir = str(config.hydra.sweep.subdir)
            config.hydra.mode = RunMode.MULTIRUN
        try:
            cfg = to_app_config(config)
            self._check_allocation(cfg.devices, cfg.nodes)
            self._share_devices(config, cfg, job_num)
        except AppError as e:
            log.error("job #%d (%s): %s; nothing was submitted", job_num,
                      " ".join(filter_overrides(overrides)), e)
            sys.exit(2)
        return config

    def _share_devices(self, config: DictConfig, cfg: Any, job_num: int) -> None:
        """Local jobs run side by side: give each its own slice of this machine's GPUs."""
        if self._EXECUTOR != "local":
            return
        import os

        import torch

        from app.runtime import resolve_accelerator

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
        from app.config import UserError

        if self._EXECUTOR == "slurm" and (devices, nodes) != (
                self.params["tasks_per_node"], self.params["nodes"]):
            raise UserError(
                f"devices={devices} nodes={nodes} differ from the sweep's allocation "
                f"({self.params['tasks_per_node']} tasks per node, {self.params['nodes']} "
                f"nodes): submit one sweep per value of devices and nodes")

    def __call__(self, sweep_overrides: list[str], job_dir_key: str, job_num: int,
                 job_id: str, singleton_state: dict[type, Singleton]) -> JobReturn:
        import submitit  # lazy, as in the stock launcher

        assert self.hydra_context is not None and self.task_function is not None
        Singleton.set_state(singleton_state)
        setup_globals()
        config = self.composed[job_num].copy()
        with open_dict(config.hydra.job):
            config.hydra.job.id = submitit.JobEnvironment().job_id
        result = run_job(hydra_context=self.hydra_context, task_function=self.task_function,
                         config=config, job_dir_key=job_dir_key,
                         job_subdir_key="hydra.sweep.subdir")
        if result.status == JobStatus.FAILED:
            raise result._return_value
        return result

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
               ) -> Sequence[JobReturn]:
        import submitit

        assert self.config is not None
        # submitit prints its warnings on stdout and on stderr; Hydra's console handler (which
        # the records reach anyway) is enough in the submitting process.
        submitit_log = logging.getLogger("submitit")
        submitit_log.handlers.clear()
        submitit_log.addFilter(_SacctOnce())
        self.composed = {initial_job_idx + i: self._compose_and_validate(list(o),
                                                                           initial_job_idx + i)
                         for i, o in enumerate(job_overrides)}
        # Executor set-up as in the stock launcher: plugin keys that are not shared by every
        # executor get the executor's prefix (srun_args -> slurm_srun_args).
        params = dict(self.params)
        folder = params.pop("submitit_folder")
        init = {f"{self._EXECUTOR}_max_num_timeout": params.pop("max_num_timeout")} \
            if "max_num_timeout" in params else {}
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=folder, **init)
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in shared else f"{self._EXECUTOR}_{k}": v
                                      for k, v in params.items()})
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info("submitit '%s' sweep output dir: %s", self._EXECUTOR, sweep_dir)
        nums = sorted(self.composed)
        for num, overrides in zip(nums, job_overrides, strict=True):
            log.info("\t#%d : %s", num, " ".join(filter_overrides(overrides)))
        jobs = executor.map_array(
            self, [list(o) for o in job_overrides], ["hydra.sweep.dir"] * len(nums), nums,
            [f"job_id_for_{n}" for n in nums], [Singleton.get_state()] * len(nums))
        return [self._result(job, num, list(o))
                for job, num, o in zip(jobs, nums, job_overrides, strict=True)]

    def _result(self, job: Any, num: int, overrides: list[str]) -> JobReturn:
        import submitit

        try:
            return job.results()[0]
        except submitit.core.utils.UncompletedJobError:  # FailedJobError is one too
            task, line, task_log = _root_cause(job)
            message = (f"job #{num} ({self._EXECUTOR} job {job.job_id}) failed in task "
                       f"{task}: {line} (log: {task_log})")
            log.error("%s", message)
            # Reported here and in the sweep's summary (app.summary ends the command non-zero);
            # the sweep itself goes on, and NaN is what sweepers take for a failed trial.
            return JobReturn(overrides=overrides, status=JobStatus.COMPLETED,
                             _return_value=math.nan,
                             working_dir=str(Path(str(self.composed[num].hydra.sweep.dir),
                                                  str(self.composed[num].hydra.sweep.subdir))))


class AppSlurmLauncher(_AppSubmititLauncher):
    _EXECUTOR = "slurm"


class AppLocalLauncher(_AppSubmititLauncher):
    _EXECUTOR = "local"
