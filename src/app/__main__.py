"""`python -m app [overrides]`: compose conf/, validate, resolve once, launch."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from app.config import AppConfig, AppError, register_schemas, validate
from app.launch import launch
from app.run_name import run_name

log = logging.getLogger("app")

# conf/ sits at the top of the repository, beside src/ (the package is installed editable).
CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "conf")

register_schemas()
OmegaConf.register_new_resolver("app_run_name", run_name)


@hydra.main(config_path=CONFIG_DIR, config_name="config", version_base="1.3")
def main(dict_cfg: DictConfig) -> float | None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        # Convert at the boundary: below here code sees plain, resolved, typed objects.
        cfg: AppConfig = OmegaConf.to_object(dict_cfg)
        validate(cfg)
        return launch(cfg, run_dir)
    except AppError as e:
        log.error("%s", e)
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise  # the sweep records this job as failed
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
