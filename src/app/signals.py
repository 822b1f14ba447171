"""The stop signals, Ctrl-C (SIGINT) and SIGTERM: every handler app sets, in one module.

While a command composes, submits or sets a run up, SIGTERM ends it as Ctrl-C does (`exit_on`).
A job of a job system keeps that system's handling (submitit ignores the SIGTERM Slurm sends
before its SIGKILL), but one before the loop is held for it (`hold_sigterm`). The loop and the
launcher of local workers stop at a step (`caught`); a rank that has left its loop ignores them
(app.training.stop: its launcher passes each on, and kills a rank that does not end); once the
run has completed, a signal stops nothing (`stop_signals_stop_nothing`). Handlers are set in
the main thread only (Python's rule).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a closed session, `kill`) where the command ends as on Ctrl-C."""


def exit_on(e: KeyboardInterrupt, say: Callable[[str], Any], what: str = "") -> NoReturn:
    """One line, "stopped by SIG[: what]", then exit with the shell's status for the signal."""
    sig = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
    said = "SIGTERM" if isinstance(e, Terminated) else "SIGINT (Ctrl-C)"
    say(f"stopped by {said}" + (f": {what}" if what else ""))
    sys.exit(128 + sig)


def install(handler: Any, signals: tuple[int, ...] = STOP_SIGNALS) -> dict[int, Any]:
    """Returns the handlers before, for `restore`."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in signals}


def restore(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@contextlib.contextmanager
def caught(handler: Any, signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[dict[int, Any]]:
    previous = install(handler, signals)
    try:
        yield previous
    finally:
        restore(previous)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """The stop signals held while the block runs, then delivered to the handlers it had: for
    a long import (torch), which a KeyboardInterrupt cuts short with its modules half made,
    and then the signal was lost, or later imports failed."""
    got: list[int] = []
    previous = install(lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        restore(previous)
    if got:
        os.kill(os.getpid(), got[0])  # (its handler runs before kill returns)


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def sigterm_raises() -> contextlib.AbstractContextManager[dict[int, Any]]:
    return caught(_raise_terminated, (signal.SIGTERM,))


def raise_on_sigterm() -> None:
    """From now on in this process (an entry point's set-up), SIGTERM raises Terminated."""
    install(_raise_terminated, (signal.SIGTERM,))


_held: list[int] = []


def hold_sigterm() -> None:
    """In a job's task before its loop: a SIGTERM is kept for the loop (`held`), not lost."""
    _held.clear()
    install(lambda signum, frame: _held.append(signum), (signal.SIGTERM,))


def held() -> int | None:
    """The signal held since `hold_sigterm`, once (the loop stops at its first step)."""
    return _held.pop(0) if _held else None


@functools.cache
def _ignore_at_exit() -> None:
    atexit.register(install, signal.SIG_IGN)  # (registered last: it runs first at exit)


def stop_signals_stop_nothing() -> None:
    """Once the run has completed (result.json says so), a stop signal must not turn it into a
    run ended by that signal: the first is noted at exit; a second ends the process.

    Python puts back the default action of the signals it handles as the interpreter finalizes,
    and torch's clean-up takes a few tenths of a second: from the first exit handler on, both
    signals are ignored."""
    received: list[int] = []

    def late(signum: int, frame: object) -> None:
        signal.signal(signum, signal.SIG_DFL)
        if not received:
            atexit.register(log.info, "%s arrived after the run had completed: nothing was "
                            "stopped", signal.Signals(signum).name)
        received.append(signum)

    if install(late):  # (not in another thread)
        _ignore_at_exit()
