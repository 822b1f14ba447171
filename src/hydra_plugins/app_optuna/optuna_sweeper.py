"""The Optuna sweeper, made resumable (Hydra #3328): the study's trials are kept in
`SWEEP/optuna_study.pkl` before each batch and at the end, and the same command continues to
the requested total of completed trials. New trials take job numbers after the earlier ones;
those an interruption cut off run again first, in their own run directories. A file, not
Optuna's database: the sweeper pins optuna 2.x, whose database storage fails with SQLAlchemy 2
(a `hydra.sweeper.storage` URL is resumed the same way). Defined only where the optional
hydra-optuna-sweeper is installed: Hydra imports every plugin module at start-up.
Before the study, a trial's overrides are composed once: a searched key the config has not got
(a search written for app's CNN, run on a model of your own) fails then, with Hydra's report
and app's line after it, before any job or study file."""

from __future__ import annotations

import logging
import pickle
import sys
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


def compose_a_trial(impl: Any, arguments: list[str]) -> None:
    """Compose one trial's overrides (each searched key at its first choice or lowest value)
    as the launcher will. Else a searched key the config has not got fails job #0 once it is
    launched, with Hydra's report alone and the study file left behind."""
    from hydra._internal.utils import run_and_report
    from hydra.errors import ConfigCompositionException
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    from_file = [f"{k!s}={v}" for k, v in (impl.params or {}).items()]
    searched, fixed = create_params_from_overrides(from_file + arguments)
    trial = [f"{name}={d.choices[0] if hasattr(d, 'choices') else d.low}"
             for name, d in searched.items() if name not in fixed]
    trial += [f"{name}={value}" for name, value in fixed.items()]
    try:
        impl.hydra_context.config_loader.load_sweep_config(impl.config, trial)
    except ConfigCompositionException as e:
        cause = e.__cause__
        if not isinstance(cause, ConfigKeyError | ConfigAttributeError) or \
                not getattr(cause, "full_key", None):
            raise
        line = _missing_key_line(impl, cause, trial, arguments)

        def report(error: Exception = e) -> None:
            raise error

        try:
            run_and_report(report)  # Hydra's report of it (raises it with HYDRA_FULL_ERROR=1)
        except SystemExit:
            print(line, file=sys.stderr)
            sys.exit(2)  # bad input, as a config that cannot compose (app.compose_errors)


def _missing_key_line(impl: Any, cause: Exception, trial: list[str],
                      arguments: list[str]) -> str:
    """`hparams_search=NAME searches KEY, which GROUP=OPTION has not got (it has ...): ...`"""
    from omegaconf import DictConfig

    full = str(cause.full_key)
    typed = next((a for a in arguments if a.lstrip("+~").partition("=")[0] == full
                  or a.lstrip("+~").startswith(f"{full}.")), None)
    choices = dict(impl.config.hydra.runtime.choices)
    search = choices.get("hparams_search")
    where = f"`{typed}`" if typed is not None else \
        f"hparams_search={search}" if search is not None else "hydra.sweeper.params"
    # (a searched group, model=choice(mlp, cnn): the option the trial took)
    choices.update(o.partition("=")[::2] for o in trial if o.partition("=")[0] in choices)
    # The option of the innermost group the key lies in (model=mymodel), else the config.
    parts = full.split(".")
    owner = next((f"{'/'.join(parts[:i])}={choices['/'.join(parts[:i])]}"
                  for i in range(len(parts) - 1, 0, -1)
                  if isinstance(choices.get("/".join(parts[:i])), str)), "the config")
    parent = getattr(cause, "parent_node", None)
    has = [str(k) for k in parent.keys() if not str(k).startswith("_")] \
        if isinstance(parent, DictConfig) else []
    line = f"{where} searches {full}, which {owner} has not got"
    line += f" (it has {', '.join(has)})" if has else ""
    if typed is not None:
        return line
    return (f"{line}: search its keys in an hparams_search file of your own "
            f"(docs/sweeps.md#search-your-own-model)")


if OptunaSweeper is not None:

    class AppOptunaSweeper(OptunaSweeper):
        def sweep(self, arguments: list[str]) -> None:
            impl = self.sweeper
            compose_a_trial(impl, arguments)  # before the study: nothing to keep if it fails
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
