"""`run=DIR`: use an earlier run by its directory. Its saved config gives the model, the data
and the precision it was trained with, and its checkpoints the weights (`ckpt`: its best.pt,
or `ckpt=last` / `ckpt=best`), so that `python -m app trainer=eval run=outputs/DAY/TIME`
needs nothing retyped. What the command line sets still wins; where it differs from the run,
one line says so. A sweep's job directory is a run directory like any other.
A relative path in what is taken (`data.root=shapes`) is the run's: read from the folder the
run was started in (its .hydra/hydra.yaml keeps it), so that the command works from any folder.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from app.errors import UserError, first_line
from app.flat import leaves

log = logging.getLogger(__name__)

# The keys a run's weights depend on: a model built otherwise would not load them, and data
# normalised otherwise would not give the run's results.
TAKEN = ("model", "data", "precision")
# `ckpt=` words that name one of the run's own checkpoints.
CHECKPOINTS = {"best": "best.pt", "last": "last.pt"}
# The keys of a file or a folder (data.root, data.path, a data set's own cache_dir): of those
# alone a relative value is a path (data.train_split=train is not, whatever the folder holds).
PATH_KEY = re.compile(r"(^|_)(root|path|dir|folder|file)$")


def _set(given: set[str], leaf: str) -> bool:
    """Whether the command line sets this leaf (itself, a part of it, or a node above it)."""
    return any(g == leaf or leaf.startswith(g + ".") or g.startswith(leaf + ".") for g in given)


def is_checkpoint(path: Path) -> bool:
    """A checkpoint file or a sharded checkpoint's directory (app.checkpoint.io's test,
    repeated here: this module is read before torch is imported)."""
    return path.is_file() or (path / ".metadata").is_file()


def _checkpoint(path: Path, ckpt: str | None, run: str) -> str:
    folder = path / "checkpoints"
    if ckpt in CHECKPOINTS:
        chosen = folder / CHECKPOINTS[ckpt]
        if not is_checkpoint(chosen):
            raise UserError(f"run={run} ckpt={ckpt}: the run has no checkpoints/{chosen.name}")
        return str(chosen)
    for name in CHECKPOINTS.values():  # (best.pt, then last.pt)
        if is_checkpoint(folder / name):
            return str(folder / name)
    raise UserError(f"run={run}: the run has no checkpoint (checkpoints/best.pt or last.pt)")


def started_in(path: Path) -> Path | None:
    """The folder the run was started in, which its relative paths were read from."""
    try:
        return Path(OmegaConf.load(path / ".hydra" / "hydra.yaml").hydra.runtime.cwd)
    except Exception:  # (no hydra.yaml, an older or hand-made one): the paths left as they are
        return None


def _run_paths(composed: DictConfig, saved: DictConfig, given: set[str], path: Path,
               run: str) -> str:
    """The run's relative paths that the command line does not set, made absolute from the
    folder the run was started in where they are there; what run='s line says of them."""
    started = started_in(path)
    if started is None or started.resolve() == Path.cwd().resolve():
        return ""
    done = []
    for key in (k for k in TAKEN if k in saved):
        for leaf, value in leaves(saved._get_node(key), key).items():
            if not isinstance(value, str) or not value.strip() or _set(given, leaf) or \
                    not PATH_KEY.search(leaf.rpartition(".")[2]) or \
                    value.startswith(("~", "$", "/")) or "://" in value:
                continue
            if (started / value).exists():
                OmegaConf.update(composed, leaf, str(started / value))
                done.append(f"{leaf}={value} as {started / value}")
            elif not Path(value).exists():
                log.warning("run=%s: %s=%s (from its config) is neither in %s, where the run was "
                            "started, nor here: give %s=/ABS/PATH", run, leaf, value, started,
                            leaf)
    return f" ({', '.join(done)}: relative to {started}, where the run was started)" if done \
        else ""


def apply_run(composed: DictConfig, overrides: list[str]) -> DictConfig:
    """`composed` with what `run=` takes from the run (unchanged without `run=`)."""
    run = composed.get("run")
    ckpt = composed.get("ckpt")
    if run is None:
        if ckpt in CHECKPOINTS:
            raise UserError(f"ckpt={ckpt} names a checkpoint of a run: add run=RUN_DIR, or "
                            f"give ckpt=PATH/TO/{CHECKPOINTS[ckpt]}")
        return composed
    if composed.get("resume") not in (None, "auto"):
        raise UserError(f"run={run} and resume={composed.get('resume')}: choose one (run= takes "
                        f"a run's weights for a new schedule, resume= continues a checkpoint)")
    path = Path(str(run)).expanduser()
    if path.is_file():
        raise UserError(f"run={run}: a file, not a run directory (a checkpoint goes in ckpt=)")
    if not path.is_dir():
        raise UserError(f"run={run}: no such run directory")
    if not (path / ".hydra" / "config.yaml").is_file():
        raise UserError(f"run={run}: not a run directory (it has no .hydra/config.yaml)")
    try:
        saved = OmegaConf.load(path / ".hydra" / "config.yaml")
    except Exception as e:  # (YAML errors come in several types): one line
        raise UserError(f"run={run}: its .hydra/config.yaml does not load: "
                        f"{first_line(e)}") from None
    # The config keys the command line sets: `model=mlp` -> model, `+data.x=1` -> data.x.
    given = {o.split("=", 1)[0].lstrip("+~").split("@", 1)[0] for o in overrides}
    given = {key for key in given if key and not key.startswith("hydra")}
    if ckpt is None:  # (ckpt=null on the command line: the run's own, as without it)
        given.discard("ckpt")
    composed = composed.copy()
    differ: list[str] = []
    with read_write(composed), open_dict(composed):
        for key in TAKEN:
            if key not in saved:
                continue
            if not _set(given, key):
                composed[key] = saved[key]
                continue
            mine = leaves(composed._get_node(key), key)
            chosen = [leaf for leaf in sorted(mine) if _set(given, leaf)]
            if key not in given:  # a part set on the command line: the rest is the run's
                merged = saved[key].copy()
                for leaf in chosen:
                    OmegaConf.update(merged, leaf.split(".", 1)[1],
                                     OmegaConf.select(composed, leaf), force_add=True)
                composed[key] = merged
            theirs = leaves(saved._get_node(key), key)
            differ += [f"{leaf}={mine[leaf]} (the run: {theirs[leaf]})" if leaf in theirs
                       else f"{leaf}={mine[leaf]} (the run has no {leaf})" for leaf in chosen
                       if theirs.get(leaf, object()) != mine[leaf]]
        if "ckpt" not in given or ckpt in CHECKPOINTS:
            composed["ckpt"] = _checkpoint(path, ckpt, str(run))
        relative = _run_paths(composed, saved, given, path, str(run))
    if differ:
        log.warning("run=%s: the command line differs from the run in %s; the command line "
                    "wins", run, ", ".join(differ))
    log.info("run=%s: %s from its config%s, weights from %s", run,
             ", ".join(k for k in TAKEN if k in saved), relative, composed["ckpt"])
    return composed
