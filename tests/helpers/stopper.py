"""A user callback that signals its own process at one step: a `kill -s SIGTERM PID` that lands
at a known step, so an in-process test can stop a run where it wants (`+callbacks.stop`)."""

from __future__ import annotations

import signal

from app.callbacks import Callback


class SignalAt(Callback):
    def __init__(self, step: int, signal: str = "SIGTERM") -> None:
        self.step, self.signal = step, signal

    def on_step_end(self, run, step, loss) -> None:
        if step == self.step:  # the app's own handler takes it, as it would from outside
            signal.raise_signal(getattr(signal, self.signal))
