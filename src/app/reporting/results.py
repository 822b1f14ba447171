"""What a run leaves for summaries: `result.json` (status, error, wall time) next to its
`metrics.csv`, and their readers."""

from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path
from typing import Any

from app.errors import WriteFailed
from app.files import write_text_atomically

log = logging.getLogger(__name__)

RESULT = "result.json"


def folder_arg(text: str) -> Path:
    """argparse's `type` for the folder the reading commands (app.status, app.report,
    app.runs) take: a missing one is named as such, not as a folder of the wrong kind."""
    import argparse

    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: give the folder")
    path = Path(text).expanduser()
    if not path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text}: {'not a folder' if path.exists() else 'no such folder'}")
    return path


def write_result(run_dir: Path, status: str, wall_s: float, error: str | None = None,
                 raise_errors: bool = True) -> None:
    """Record how the run ended, atomically (a summary may read it at any time). A write that
    fails (a full disk) is a WriteFailed; or, with `raise_errors=False` (a run that failed
    already: its own error is the one to report), a warning."""
    record = {"status": status, "wall_s": round(wall_s, 3), "error": error}
    try:
        write_text_atomically(run_dir / RESULT, json.dumps(record, indent=2) + "\n")
    except WriteFailed as e:
        if raise_errors:
            raise
        log.warning("%s", e)


def read_result(run_dir: Path) -> dict[str, Any]:
    """The run's result.json ({} when there is none); one that is not a JSON object (edited
    by hand, cut short by a full disk) reads as the status `unreadable result.json`."""
    try:
        result = json.loads((run_dir / RESULT).read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        result = None
    return result if isinstance(result, dict) else {"status": f"unreadable {RESULT}"}


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    path = run_dir / "metrics.csv"
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# --json, of this command and of app.status, app.report and the dry run: one JSON document on
# stdout, its fields documented in docs/json.md.
JSON_HELP = "print one JSON document (its fields: docs/json.md) instead of the text"


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
