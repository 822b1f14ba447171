"""The Optuna sweeper, made resumable (Hydra #3328): the study's trials are kept in
`SWEEP/optuna_study.pkl` before each batch and at the end, and the same command continues to
the requested total of completed trials. New trials take job numbers after the earlier ones;
those an interruption cut off run again first, in their own run directories. A file, not
Optuna's database: the sweeper pins optuna 2.x, whose database storage fails with SQLAlchemy 2
(a `hydra.sweeper.storage` URL is resumed the same way). Defined only where the optional
hydra-optuna-sweeper is installed: Hydra imports every plugin module at start-up."""

from __future__ import annotations

import logging
import pickle
import warnings
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

log = logging.getLogger(__name__)
STUDY_FILE = "optuna_study.pkl"

try:
    from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper
except ImportError:  # (the optional extra is not installed)
    OptunaSweeper = None


def _save(path: Path, storage: Any, study_name: str, next_job: int,
          running_from: int | None = None) -> None:
    """The trials told so far, and those still running with the first one's job number."""
    import optuna

    from app.files import write_bytes_atomically

    trials = optuna.load_study(study_name=study_name, storage=storage).trials
    running = [t.params for t in sorted(trials, key=lambda t: t.number)
               if t.state == optuna.trial.TrialState.RUNNING]
    write_bytes_atomically(path, pickle.dumps({
        "trials": [t for t in trials if t.state != optuna.trial.TrialState.RUNNING],
        "next_job": next_job, "running": running if running_from is not None else [],
        "running_from": running_from}))


def _reseed(impl: Any, count: int) -> None:
    """Seed a seeded sampler with the seed plus the trials done: else a resumed study draws
    the first trials' suggestions again (optuna 2.x keeps its generators here)."""
    import numpy

    seed = OmegaConf.select(impl.config, "hydra.sweeper.sampler.seed", default=None)
    for sampler in (impl.sampler, getattr(impl.sampler, "_random_sampler", None)):
        if seed is not None and hasattr(sampler, "_rng"):
            sampler._rng = numpy.random.RandomState(int(seed) + count)


def resume(impl: Any) -> Path | None:
    """Give the sweeper its study so far; the file that keeps it (None: the user's database)."""
    import optuna

    sweep_dir = Path(str(impl.config.hydra.sweep.dir)).resolve()
    path: Path | None = None
    if impl.study_name is None:
        # Optuna would draw a random name, under which the same command could not find the
        # study again (and a study of its own in the storage could not be told apart).
        impl.study_name = f"{sweep_dir.parent.name}/{sweep_dir.name}"
        log.info("hydra.sweeper.study_name is null: the study is named %s", impl.study_name)
    if impl.storage is not None:  # the user's database
        try:
            done = optuna.load_study(study_name=impl.study_name, storage=impl.storage).trials
        except KeyError:  # a new study
            return None
        next_job = len(done)
    else:
        path = sweep_dir / STUDY_FILE
        kept = pickle.loads(path.read_bytes()) if path.is_file() else {"trials": [],
                                                                         "next_job": 0}
        impl.storage = optuna.storages.InMemoryStorage()
        with warnings.catch_warnings():  # ("add_trial is experimental" in optuna 2.x)
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study = optuna.create_study(study_name=impl.study_name, storage=impl.storage,
                                        directions=impl._get_directions())
            study.add_trials(kept["trials"])
            for params in kept.get("running", []):  # (cut off: they resume where they ran)
                study.enqueue_trial(params)
        done = kept["trials"]
        next_job = kept["running_from"] if kept.get("running") else kept["next_job"]
    if done:
        _reseed(impl, len(done))
        complete = sum(t.state == optuna.trial.TrialState.COMPLETE for t in done)
        wanted = impl.n_trials
        impl.n_trials, impl.job_idx = max(0, wanted - complete), next_job
        log.info("study %s resumed: %d of %d trials completed; %d to go, as jobs #%d on",
                 impl.study_name, complete, wanted, impl.n_trials, next_job)
    return path


if OptunaSweeper is not None:

    class AppOptunaSweeper(OptunaSweeper):
        def sweep(self, arguments: list[str]) -> None:
            impl = self.sweeper
            path = resume(impl)
            if path is None:
                return impl.sweep(arguments)
            path.parent.mkdir(parents=True, exist_ok=True)
            launch, next_job = impl.launcher.launch, [impl.job_idx]
            running_from: list[int | None] = [None]  # the first job of the last batch

            def launch_and_keep(overrides: Any, initial_job_idx: int) -> Any:
                # The trials told so far, before this batch starts: a kill during it loses
                # only the batch, whose job numbers are not given again.
                next_job[0] = initial_job_idx + len(overrides)
                running_from[0] = initial_job_idx
                _save(path, impl.storage, impl.study_name, next_job[0], initial_job_idx)
                # (running_from stays: a stop before the sweeper has told these results runs
                # them again, and their finished runs return at once)
                return launch(overrides, initial_job_idx=initial_job_idx)

            impl.launcher.launch = launch_and_keep
            # Between trials no handler of the app's is set: SIGTERM would end the process
            # before the trials told since the last batch are kept.
            from app.signals import sigterm_raises

            try:
                with sigterm_raises():
                    return impl.sweep(arguments)
            finally:
                impl.launcher.launch = launch
                _save(path, impl.storage, impl.study_name, max(next_job[0], impl.job_idx),
                      running_from[0])
