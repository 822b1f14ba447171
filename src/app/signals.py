"""The stop signals, Ctrl-C (SIGINT) and SIGTERM: every handler app sets, in one module.

What each part of a command does with them:
- While it composes, submits or sets a run up: SIGTERM ends it as Ctrl-C does
  (`sigterm_raises`: `Terminated`, a KeyboardInterrupt), exit 128 + the signal (`exit_on`).
- A job of a job system (submitit) keeps that system's handling (submitit ignores SIGTERM, as
  Slurm sends it before its SIGKILL), but a SIGTERM that arrives before the loop is not lost:
  it is held (`hold_sigterm`) and the loop stops at its first step with a checkpoint.
- The loop and the launcher of local workers catch both (`caught`): they stop at a step.
- Once the run has completed, a signal stops nothing (`stop_signals_stop_nothing`).

Python runs handlers in the main thread only: elsewhere these set nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a closed session, `kill`) where the command ends as on Ctrl-C."""


def name(sig: int) -> str:
    return "SIGINT (Ctrl-C)" if sig == signal.SIGINT else signal.Signals(sig).name


def signum(e: KeyboardInterrupt) -> int:
    return signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT


def exit_on(e: KeyboardInterrupt, say: Callable[[str], Any], what: str = "") -> NoReturn:
    """One line, "stopped by SIG[: what]", then exit with the shell's status for the signal."""
    say(f"stopped by {name(signum(e))}" + (f": {what}" if what else ""))
    sys.exit(128 + signum(e))


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def install(handler: Any, signals: tuple[int, ...] = STOP_SIGNALS) -> dict[int, Any]:
    """`handler` (a function, SIG_IGN or SIG_DFL) for `signals`; returns the handlers before
    it, for `restore`."""
    return {sig: signal.signal(sig, handler) for sig in signals} if _main_thread() else {}


def restore(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@contextlib.contextmanager
def caught(handler: Any, signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[dict[int, Any]]:
    """`handler` for `signals` while in the block; the handlers before it (yielded) are put
    back after it."""
    previous = install(handler, signals)
    try:
        yield previous
    finally:
        restore(previous)


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


_ignored_at_exit = False


def stop_signals_stop_nothing() -> None:
    """Once the run has completed (not between the jobs of a sweep, where a signal ends the
    sweep: the next job has not begun): a stop signal must not turn a completed run, which
    result.json says it is, into one ended by that signal as the process ends. The first is
    noted at exit; a second ends the process as it would have.

    Python puts back the default action of every signal it handles when the interpreter
    finalizes, and torch's own clean-up takes a few tenths of a second: from the first exit
    handler on, both signals are ignored, which finalization keeps."""
    global _ignored_at_exit
    received: list[int] = []

    def late(signum: int, frame: object) -> None:
        signal.signal(signum, signal.SIG_DFL)
        if not received:
            atexit.register(log.info, "%s arrived after the run had completed: nothing was "
                            "stopped", signal.Signals(signum).name)
        received.append(signum)

    if not _main_thread():
        return
    install(late)
    if not _ignored_at_exit:  # (registered last, so it runs first at exit)
        atexit.register(install, signal.SIG_IGN)
        _ignored_at_exit = True
