"""Step overhead: the app's training loop against the plain loop, step for step.

Both loops run in one process, the app's in the main thread (it installs signal handlers)
and the plain loop in a second thread, and they take turns: at the end of each optimizer step
(torch's global step hook) a loop hands over to the other and waits. So each loop's steps lie
between the other's, and a machine whose speed drifts (this one, by tens of percent over
seconds) slows both alike. A loop's step time is from getting its turn to the end of its
next optimizer step: loop bookkeeping, data, forward, backward and update.

The app's loop is `app.train.train` with the config `python -m app` composes, logging to a
file as under Hydra; the plain loop is bench/plain_loop.py's `train`.
"""

from __future__ import annotations

import csv
import logging
import os
import statistics
import threading
import time
from pathlib import Path

import plain_loop
import torch
from hydra import compose, initialize_config_dir
from torch.optim.optimizer import register_optimizer_step_post_hook

from app.config import register_schemas, to_app_config
from app.resolvers import register_resolvers
from app.train import train as app_train

REPO = Path(__file__).resolve().parents[1]
WARMUP = 10


class Turns:
    """Two loops, one optimizer step each in turn; records each loop's step times."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.turn = "app"
        self.finished: set[str] = set()
        self.times: dict[str, list[float]] = {"app": [], "plain": []}
        self.since: dict[str, float] = {}

    @staticmethod
    def me() -> str:
        return "app" if threading.current_thread() is threading.main_thread() else "plain"

    def begin(self) -> None:
        me = self.me()
        with self.cv:
            self.cv.wait_for(lambda: self.turn == me)
        self.since[me] = time.perf_counter()

    def step_done(self) -> None:
        me = self.me()
        self.times[me].append(time.perf_counter() - self.since[me])
        other = "plain" if me == "app" else "app"
        with self.cv:
            if other not in self.finished:
                self.turn = other
                self.cv.notify_all()
                self.cv.wait_for(lambda: self.turn == me)
        self.since[me] = time.perf_counter()

    def end(self) -> None:
        me = self.me()
        with self.cv:
            self.finished.add(me)
            self.turn = "plain" if me == "app" else "app"
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


def _in_turns(main_loop, other_loop) -> tuple[float, float]:
    """Run two loops in turns (the first in this, the main, thread); their median step times."""
    global _turns
    turns = _turns = Turns()

    def other() -> None:
        turns.begin()
        try:
            other_loop()
        finally:
            turns.end()

    thread = threading.Thread(target=other)
    thread.start()
    turns.begin()
    try:
        main_loop()
    finally:
        turns.end()
        thread.join()
        _turns = None
    return (statistics.median(turns.times["app"][WARMUP:]),
            statistics.median(turns.times["plain"][WARMUP:]))


def compare(app_overrides: list[str], plain_args: list[str], rounds: int, tmp: Path
            ) -> tuple[list[float], list[float], bool]:
    """Per round, the median seconds per step of the app and of the plain loop, run in turns;
    and whether the app's logged losses equal the plain loop's (each run alone)."""
    cfg = _app_config(app_overrides)
    args = plain_loop.parser().parse_args(plain_args)
    # Parity first, each loop alone: in turns they draw dropout masks from torch's one global
    # generator alternately, so their losses differ there (their work does not).
    run_dir = tmp / f"alone-{abs(hash(tuple(app_overrides)))}"
    _logging_as_hydra(run_dir)
    app_train(cfg, run_dir, torch.device("cpu"))
    same = _same_losses(run_dir / "metrics.csv", plain_loop.train(args))
    apps, plains = [], []
    for r in range(rounds):
        run_dir = tmp / f"turns-{abs(hash(tuple(app_overrides)))}-{r}"
        _logging_as_hydra(run_dir)
        app, plain = _in_turns(lambda d=run_dir: app_train(cfg, d, torch.device("cpu")),
                               lambda: plain_loop.train(args))
        apps.append(app)
        plains.append(plain)
    logging.getLogger().handlers.clear()
    return apps, plains, same


def control(plain_args: list[str], rounds: int) -> tuple[list[float], list[float]]:
    """The plain loop against itself, in turns: the resolution of this measurement."""
    args = plain_loop.parser().parse_args(plain_args)
    pairs = [_in_turns(lambda: plain_loop.train(args), lambda: plain_loop.train(args))
             for _ in range(rounds)]
    return [a for a, _ in pairs], [b for _, b in pairs]
