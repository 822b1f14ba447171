"""A data set that builds in one long call into C, where a signal's Python handler waits for
the call to return: a rank there when a stop signal comes dies of the launcher's SIGTERM that
follows it, before it can record how it ended (`data._target_=busy_setup.BusyDigits`, with
this folder on PYTHONPATH)."""

from __future__ import annotations

import hashlib
import os

from app.data import Digits


class BusyDigits(Digits):
    """Digits that, after touching `marker` (and MARKER.rankN), spend `rounds` rounds of
    PBKDF2 in one call (a second or more a million)."""

    def __init__(self, rounds: int, marker: str, **kwargs) -> None:
        open(f"{marker}.rank{os.environ.get('RANK', 0)}", "w").close()
        hashlib.pbkdf2_hmac("sha256", b"busy", b"setup", rounds)
        super().__init__(**kwargs)
