"""A sweep directory used again: the same command resumes its jobs (job N in `SWEEP/N`), but
a job with other values would resume another job's run directory as its own, and report
that job's result. A job's identity is its whole override set (Hydra's own `hydra.*` settings
aside: they are not the job's); `conflicts` finds the jobs whose run directory holds a job of
other overrides, and the submitit launchers and, for Hydra's basic sweeper, the sweep
summary's start refuse them before any job runs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

# Keys that choose where a job runs, not what it computes: `launcher=slurm` is
# `hydra/launcher=submitit_slurm` (a Hydra override, never among a job's) typed shorter.
WHERE_ONLY = {"launcher"}


def _by_key(overrides: list[str]) -> dict[str, str]:
    """key -> value as typed: `+x=1`, `++x=1` and `x=1` set the same value; `~x` deletes."""
    found = {}
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+~") not in WHERE_ONLY:
            found[key.lstrip("+~")] = "(deleted)" if key.startswith("~") else value
    return found


def same_job(a: list[str], b: list[str]) -> bool:
    """Whether two jobs' overrides are the same job (in any order, `+x=1` as `x=1`)."""
    return _by_key(a) == _by_key(b)


def conflicts(overrides: dict[int, list[str]], run_dirs: dict[int, Path]) -> list[str]:
    """Jobs whose run directory holds an earlier job of other overrides (that directory would
    be resumed as this job's, and its result reported as this job's). One line each."""
    said = []
    for num, run_dir in sorted(run_dirs.items()):
        try:
            earlier = OmegaConf.load(run_dir / ".hydra" / "overrides.yaml")
        except (OSError, ValueError, TypeError, AttributeError):
            continue
        before, now = _by_key([str(o) for o in earlier]), _by_key(overrides[num])
        differ = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        if differ:
            was, is_ = (" ".join(f"{k}={d[k]}" if k in d else f"(no {k})" for k in differ)
                        for d in (before, now))
            said.append(f"job #{num}: its run directory {run_dir} holds a job of {was}, "
                        f"this one is {is_}")
    return said


def basic_sweep_jobs(config: DictConfig) -> dict[int, list[str]] | None:
    """Each job's overrides as Hydra's basic sweeper will number them (None: another sweeper,
    or app's submitit launchers, which check their jobs themselves, dry run too)."""
    sweeper = str(OmegaConf.select(config, "hydra.sweeper._target_", default=""))
    launcher = str(OmegaConf.select(config, "hydra.launcher._target_", default=""))
    if not sweeper.endswith(".BasicSweeper") or \
            launcher.startswith("hydra_plugins.app_submitit."):
        return None
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from app._private import basic_sweep_jobs as numbered

    # As the basic sweeper builds them: hydra.sweeper.params first, then the command's.
    params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
    parsed = OverridesParser.create().parse_overrides(
        [f"{k}={v}" for k, v in params.items()]
        + OmegaConf.to_container(config.hydra.overrides.task, resolve=False))  # (as typed)
    return dict(enumerate(numbered(parsed)))


def refuse_other_values(config: DictConfig, log: Any) -> None:
    """At a basic sweep's start: exit 2, naming the jobs, if its directory holds a sweep of
    other values."""
    jobs = basic_sweep_jobs(config)
    if not jobs:
        return
    sweep_dir = Path(str(config.hydra.sweep.dir))
    # Each job's run directory. A subdir other than the job number (the job's overrides,
    # `${hydra.job.override_dirname}`, or anything else of its config) is each job's config
    # composed as the launcher will compose it: one compose a job, only for such a subdir.
    run_dirs = {num: sweep_dir / str(num) for num in jobs}
    if OmegaConf.to_container(config.hydra.sweep)["subdir"] != "${hydra.job.num}":
        from hydra.core.global_hydra import GlobalHydra

        loader = GlobalHydra.instance().config_loader()
        for num, overrides in jobs.items():
            job = loader.load_sweep_config(config, list(overrides))
            with open_dict(job.hydra.job):
                job.hydra.job.num = job.hydra.job.id = num  # (as Hydra's basic launcher does)
            run_dirs[num] = sweep_dir / str(job.hydra.sweep.subdir)
    clashes = conflicts(jobs, run_dirs)
    if clashes:
        log.error("hydra.sweep.dir=%s was used by a sweep of other values: %s. Its run "
                  "directories would be resumed as these jobs'; give this sweep a new "
                  "hydra.sweep.dir (no job was run)", sweep_dir, "; ".join(clashes))
        sys.exit(2)
