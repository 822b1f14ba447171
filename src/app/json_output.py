"""`--json` of the reading commands (app.status, app.runs, app.report) and the Slurm dry run:
one JSON document on stdout, its fields documented in docs/json.md."""

from __future__ import annotations

import json
import math
from typing import Any

HELP = "print one JSON document (its fields: docs/json.md) instead of the text"


def plain(value: Any) -> Any:
    """VALUE as JSON has it: paths as strings, a number that is not one (NaN, inf) as null."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)  # (a Path; a config value of another type, as the text shows it)


def emit(document: Any) -> None:
    print(json.dumps(plain(document), indent=2), flush=True)
