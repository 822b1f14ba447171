"""app's launchers for SLURM and local submitit jobs: hydra-submitit-launcher, extended."""

import logging
import sys
from typing import Any, NoReturn

log = logging.getLogger("hydra_plugins.app_submitit.launcher")  # (every module's lines)


def refuse(message: str, *args: Any) -> NoReturn:
    """Exit 2 before anything is submitted, in one line."""
    log.error(f"{message} (nothing was submitted)", *args)
    sys.exit(2)
