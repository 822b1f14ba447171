"""After the run has completed: a stop signal (Ctrl-C, SIGTERM) stops nothing, and must not
turn a completed run (result.json says so) into one ended by the signal while the process
ends. The first is noted at exit; a second ends the process as it would have.

Python puts back the default action of every signal it handles when the interpreter
finalizes, so a signal in the last moments of the process (torch's own clean-up takes a
few tenths of a second) would still end it with the default action: from the first exit
handler on, the two signals are ignored, which finalization keeps.
"""

from __future__ import annotations

import atexit
import logging
import signal

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_installed = False


def _ignore_from_now_on() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def stop_signals_stop_nothing() -> None:
    """Call in the main thread once the run has completed (not between the jobs of a
    sweep: there a signal ends the sweep, as the next job has not begun)."""
    global _installed
    received: list[int] = []

    def late(signum: int, frame: object) -> None:
        signal.signal(signum, signal.SIG_DFL)
        if not received:
            atexit.register(log.info, "%s arrived after the run had completed: nothing was "
                            "stopped", signal.Signals(signum).name)
        received.append(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, late)
    if not _installed:  # (registered last, so it runs first at exit)
        atexit.register(_ignore_from_now_on)
        _installed = True
