"""A Hydra callback that records what each job returned to Hydra, one JSON line per job."""

from __future__ import annotations

import json
from typing import Any

from hydra.experimental.callback import Callback


class Recorder(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"num": int(config.hydra.job.num),
                                "overrides": list(job_return.overrides),
                                "status": job_return.status.name,
                                "value": job_return._return_value}) + "\n")
