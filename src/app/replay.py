"""`python -m app.replay RUN_DIR`: why a run's loss went NaN or inf. The run is trained again
from its newest checkpoint before the step its loss was non-finite at, to that step, exactly
(app.training.replay); RUN_DIR/logs/nonfinite.json then names the first module whose output
(or gradient) was non-finite, and the data set's indices of the samples in that batch.

It replays a run of one process, in one process; a run of several ranks replays each rank's
batch with `trainer.replay_nonfinite=true` (when it stops)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from app.env import reproducible_matmuls
from app.errors import AppError, UserError
from app.reporting.results import folder_arg

reproducible_matmuls()  # before torch's first matrix product: the run's own rounding


def stopped_at(run_dir: Path) -> int:
    """The step the run stopped at for a non-finite loss: its result.json's error, else the
    last such stop in its train.log (a run killed before its record was written)."""
    from app.training.replay import STOPPED, stopped_at

    try:
        error = json.loads((run_dir / "result.json").read_text()).get("error") or ""
    except (OSError, ValueError, AttributeError):
        error = ""
    step = stopped_at(error)
    if step is None:
        try:
            found = STOPPED.findall((run_dir / "train.log").read_text(errors="replace"))
        except OSError:
            found = []
        step = int(found[-1][1]) if found else None
    if step is None:
        raise UserError(f"{run_dir} did not stop at a non-finite loss (its result.json and "
                        f"train.log name none); give the step with --step")
    return step


def replay(run_dir: Path, step: int | None = None) -> str:
    """Replay the run in `run_dir` to its non-finite loss; returns the line for the user."""
    from omegaconf import OmegaConf

    from app.config import AppConfig, register_schemas, to_app_config
    from app.from_run import started_in

    if not (run_dir / ".hydra" / "config.yaml").is_file():
        raise UserError(f"{run_dir}: not a run directory (it has no .hydra/config.yaml)")
    step = stopped_at(run_dir) if step is None else step
    register_schemas()
    cfg = to_app_config(OmegaConf.merge(OmegaConf.structured(AppConfig),
                                        OmegaConf.load(run_dir / ".hydra" / "config.yaml")))
    if cfg.nodes > 1 or cfg.devices not in (1, "auto") or \
            (run_dir / "logs" / "rank1.log").is_file():  # (devices=auto on several GPUs)
        raise UserError(f"{run_dir} trained on several processes (devices={cfg.devices}, "
                        f"nodes={cfg.nodes}): each replays its own batch when the run is "
                        f"resumed with trainer.replay_nonfinite=true")
    import torch

    from app.launch.plan import resolve_accelerator
    from app.training.replay import describe, write_report
    from app.training.runtime import apply_runtime_flags

    run_dir = run_dir.resolve()
    started = started_in(run_dir)  # the run's relative paths (data.root) are from there
    if started is not None and started.is_dir():
        os.chdir(started)
    kind = resolve_accelerator(cfg.accelerator, strict=False)
    device = torch.device(kind) if kind in ("cpu", "mps") else torch.device(kind, 0)
    apply_runtime_flags(cfg, device)
    path = write_report(cfg, run_dir, device, step)
    return f"{describe(json.loads(path.read_text()))}; details in {path}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=folder_arg, help="the run's directory (hydra.run.dir)")
    parser.add_argument("--step", type=int, help="the step to replay to (default: the step "
                        "the run stopped at for a non-finite loss)")
    args = parser.parse_args(argv)
    try:
        print(replay(args.run_dir, args.step))
    except AppError as e:
        print(f"python -m app.replay: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
