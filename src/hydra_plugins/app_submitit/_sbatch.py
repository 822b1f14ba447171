"""What sbatch says when it refuses a submission: submitit lets sbatch's stderr through and
raises with part of it; `captured_stderr` keeps those lines and `refusal` makes them one.
The module name starts with "_": Hydra's plugin scan skips it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def captured_stderr(active: bool) -> Iterator[list[str]]:
    """The lines written on stderr (fd 2) inside the block. Slurm only: a local job would
    inherit the captured stderr for its whole life."""
    said: list[str] = []
    if not active:
        yield said
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield said
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            said.extend(sink.read().decode(errors="replace").splitlines())


def refusal(e: Exception, stderr: list[str]) -> str:
    """sbatch's own words, each of its error lines once (from its stderr and submitit's
    error), or the error's first line."""
    text = str(e)
    said = list(dict.fromkeys(
        line.strip().removeprefix("sbatch: error:").strip()
        for line in [*stderr, *text.splitlines()] if "sbatch: error" in line))
    return "; ".join(said) if said else (text.strip().splitlines() or [type(e).__name__])[0]
