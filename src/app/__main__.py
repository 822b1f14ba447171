"""`python -m app [overrides]`: compose conf/, validate, resolve once, launch."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from app.config import AppError, register_schemas, to_app_config
from app.launch import launch
from app.resolvers import register_resolvers

log = logging.getLogger("app")

# conf/ sits at the top of the repository, beside src/ (the package is installed editable).
CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "conf")

register_schemas()
register_resolvers()
# conf/hydra/launcher/submitit_*.yaml shadow the stock options on purpose (same names, app's
# launcher) and are checked against their schemas; Hydra warns about that on every run.
warnings.filterwarnings("ignore", message=r"(?s).*is validated against ConfigStore schema")


@hydra.main(config_path=CONFIG_DIR, config_name="config", version_base="1.3")
def main(dict_cfg: DictConfig) -> float | None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        # Convert at the boundary: below here code sees plain, resolved, typed objects.
        return launch(to_app_config(dict_cfg), run_dir)
    except AppError as e:
        log.error("%s", e)
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise  # the sweep records this job as failed
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
