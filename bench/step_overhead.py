"""Step overhead: the app's training loop against the plain loop, step for step.

Both loops run in one process, each in a thread of its own, and they take turns: at the end
of each optimizer step (torch's global step hook) a loop hands over to the other and waits.
So each loop's steps lie between the other's, and a machine whose speed drifts (this one, by
tens of percent over seconds) slows both alike. A loop's step time is from getting its turn
to the end of its next optimizer step: loop bookkeeping, data, forward, backward and update.

The app's loop is `app.training.loop.train` with the config `python -m app` composes, logging to a
file as under Hydra; the plain loop is bench/plain_loop.py's `train`.
"""

from __future__ import annotations

import csv
import logging
import os
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import plain_loop
import torch
from hydra import compose, initialize_config_dir
from torch.optim.optimizer import register_optimizer_step_post_hook

from app.config import register_schemas, to_app_config
from app.resolvers import register_resolvers
from app.training.loop import train as app_train

REPO = Path(__file__).resolve().parents[1]
WARMUP = 10


class Turns:
    """Two loops, each in a thread of its own, one optimizer step each in turn; records each
    loop's step times."""

    def __init__(self, first: str, second: str, sync=lambda: None) -> None:
        self.sync = sync  # (on a GPU: wait for the step's kernels before it counts as done)
        self.cv = threading.Condition()
        self.turn, self.names = first, (first, second)
        self.finished: set[str] = set()
        self.times: dict[str, list[float]] = {first: [], second: []}
        self.since: dict[str, float] = {}
        self.local = threading.local()

    def begin(self, me: str) -> None:
        self.local.name = me
        with self.cv:
            self.cv.wait_for(lambda: self.turn == me)
        self.since[me] = time.perf_counter()

    def step_done(self) -> None:
        me = self.local.name
        self.sync()
        self.times[me].append(time.perf_counter() - self.since[me])
        other = self.names[1] if me == self.names[0] else self.names[0]
        with self.cv:
            if other not in self.finished:
                self.turn = other
                self.cv.notify_all()
                self.cv.wait_for(lambda: self.turn == me)
        self.since[me] = time.perf_counter()

    def end(self) -> None:
        me = self.local.name
        with self.cv:
            self.finished.add(me)
            self.turn = self.names[1] if me == self.names[0] else self.names[0]
            self.cv.notify_all()


_turns: Turns | None = None
register_optimizer_step_post_hook(lambda *_: _turns.step_done() if _turns else None)


def _app_config(overrides: list[str]):
    register_schemas()
    register_resolvers()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return to_app_config(compose("config", overrides=overrides))


def _logging_as_hydra(run_dir: Path) -> None:
    """A console handler (to /dev/null) and a file handler, as Hydra's job logging sets up."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    run_dir.mkdir(parents=True, exist_ok=True)
    for handler in (logging.StreamHandler(open(os.devnull, "w")),  # noqa: SIM115
                    logging.FileHandler(run_dir / "train.log")):
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(logging.INFO)


def _same_losses(metrics: Path, losses: list[float]) -> bool:
    with open(metrics, newline="") as f:
        logged = [(int(r["step"]), float(r["loss"])) for r in csv.DictReader(f)
                  if r["split"] == "train"]
    return bool(logged) and all(losses[s - 1] == loss for s, loss in logged)


def _in_turns(first, second, device: str = "cpu") -> tuple[float, float]:
    """Run two loops in turns, each in a thread of its own (so that neither has the main
    thread's place); their median step times."""
    firsts, seconds = _steps_in_turns(first, second, device)
    return statistics.median(firsts[WARMUP:]), statistics.median(seconds[WARMUP:])


def _steps_in_turns(first, second, device: str = "cpu") -> tuple[list[float], list[float]]:
    """Run two loops in turns; each one's step times, step by step."""
    global _turns
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    turns = _turns = Turns("first", "second", sync)

    def run(name: str, loop) -> None:
        turns.begin(name)
        try:
            loop()
        finally:
            turns.end()

    threads = [threading.Thread(target=run, args=("first", first)),
               threading.Thread(target=run, args=("second", second))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    _turns = None
    return turns.times["first"], turns.times["second"]


def compare(app_overrides: list[str], plain_args: list[str], rounds: int, tmp: Path,
            device: str = "cpu") -> tuple[list[float], list[float], bool]:
    """Per round, the median seconds per step of the app and of the plain loop, run in turns;
    and whether the app's logged losses equal the plain loop's (each run alone)."""
    cfg = _app_config(app_overrides)
    args = plain_loop.parser().parse_args([*plain_args, "--device", device])
    on = torch.device(device)
    # Parity first, each loop alone: in turns they draw dropout masks from torch's one global
    # generator alternately, so their losses differ there (their work does not).
    run_dir = tmp / f"alone-{abs(hash(tuple(app_overrides)))}"
    _logging_as_hydra(run_dir)
    app_train(cfg, run_dir, on)
    same = _same_losses(run_dir / "metrics.csv", plain_loop.train(args))
    apps, plains = [], []
    for r in range(rounds):
        run_dir = tmp / f"turns-{abs(hash(tuple(app_overrides)))}-{r}"
        _logging_as_hydra(run_dir)
        app_loop = lambda d=run_dir: app_train(cfg, d, on)  # noqa: E731
        if r % 2 == 0:  # who goes first alternates
            app, plain = _in_turns(app_loop, lambda: plain_loop.train(args), device)
        else:
            plain, app = _in_turns(lambda: plain_loop.train(args), app_loop, device)
        apps.append(app)
        plains.append(plain)
    logging.getLogger().handlers.clear()
    return apps, plains, same


def callback_cost(app_overrides: list[str], rounds: int, tmp: Path
                  ) -> tuple[list[float], list[float]]:
    """Per round, the median seconds per step of the app's loop with three no-op callbacks
    (every hook overridden) and without, run in turns."""
    noop = [f"+callbacks.noop{i}._target_=noop_callbacks.NoOp" for i in range(3)]
    return overrides_cost(app_overrides, noop, rounds, tmp, "callbacks")


def _paired_rounds(app_overrides: list[str], extra: list[str], rounds: int, tmp: Path,
                   name: str) -> Iterator[tuple[list[float], list[float]]]:
    """Per round, the step times of the app's loop with `extra` overrides and without, run
    in turns (who goes first alternating)."""
    with_cfg, without_cfg = _app_config([*app_overrides, *extra]), _app_config(app_overrides)
    for r in range(rounds):
        dirs = [tmp / f"{name}-{r}-{which}" for which in ("with", "without")]
        _logging_as_hydra(dirs[0])
        dirs[1].mkdir(parents=True)
        loops = [lambda d=dirs[0]: app_train(with_cfg, d, torch.device("cpu")),
                 lambda d=dirs[1]: app_train(without_cfg, d, torch.device("cpu"))]
        yield _steps_in_turns(*loops) if r % 2 == 0 else _steps_in_turns(*loops[::-1])[::-1]
    logging.getLogger().handlers.clear()


def window_cost(app_overrides: list[str], extra: list[str], window: range, rounds: int,
                tmp: Path) -> dict[str, list[float]]:
    """Per round, the app's loop with `extra` (a profiler's window of steps) against without,
    in turns: the ratio of their median step inside the window (its last step aside, where
    the trace is written), outside it, and the seconds that last step adds."""
    found: dict[str, list[float]] = {"inside": [], "outside": [], "last_s": []}
    for w, wo in _paired_rounds(app_overrides, extra, rounds, tmp, "window"):
        # A step's time ends at its optimizer step: what its callbacks' on_step_end does (the
        # profiler's step, its trace at the window's end) is in the next step's, index = step.
        inside = list(window)[:-1]
        outside = [i for i in range(WARMUP, len(w)) if i not in window]
        for key, steps in (("inside", inside), ("outside", outside)):
            found[key].append(statistics.median(w[i] for i in steps) /
                              statistics.median(wo[i] for i in steps))
        found["last_s"].append(w[window[-1]] - wo[window[-1]])
    return found


def overrides_cost(app_overrides: list[str], extra: list[str], rounds: int, tmp: Path,
                   name: str) -> tuple[list[float], list[float]]:
    """Per round, the median seconds per step of the app's loop with `extra` overrides and
    without, run in turns."""
    pairs = list(_paired_rounds(app_overrides, extra, rounds, tmp, name))
    return ([statistics.median(w[WARMUP:]) for w, _ in pairs],
            [statistics.median(wo[WARMUP:]) for _, wo in pairs])


def dispatch_seconds(calls: int = 200_000) -> float:
    """Seconds per optimizer step that calling three no-op callbacks' per-step hook costs (the
    loop's own calling code: `for hook in callbacks.on_step_end: hook(run, step, loss)`)."""
    from noop_callbacks import NoOp

    from app.callbacks import Callbacks

    callbacks, loss = Callbacks({f"noop{i}": NoOp() for i in range(3)}), torch.zeros(())
    started = time.perf_counter()
    for step in range(calls):
        for hook in callbacks.on_step_end:
            hook(None, step, loss)
    return (time.perf_counter() - started) / calls


def control(plain_args: list[str], rounds: int) -> tuple[list[float], list[float]]:
    """The plain loop against itself, in turns: the resolution of this measurement."""
    args = plain_loop.parser().parse_args(plain_args)
    pairs = [_in_turns(lambda: plain_loop.train(args), lambda: plain_loop.train(args))
             for _ in range(rounds)]
    return [a for a, _ in pairs], [b for _, b in pairs]
