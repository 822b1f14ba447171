"""Local worker processes: start them, watch them, and end them all when one fails.

Imported without torch: the launching process starts the worker server (forkserver) before it
imports torch itself, so that both imports run at the same time.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import tempfile
import time
from pathlib import Path

from app.cluster_env import detect
from app.config import AppConfig, AppError, Mode

log = logging.getLogger(__name__)

# What the forkserver imports once, so that each worker it forks starts with them: torch, and
# torch._dynamo, which every optimizer.step() imports (about as slow as torch itself).
PRELOAD = ["torch", "torch._dynamo", "app.worker", "app.train", "app.evaluate"]


def spawns_workers(cfg: AppConfig) -> bool:
    """Whether this process will start local workers (known before devices=auto resolves)."""
    return (detect(os.environ) is None and isinstance(cfg.devices, int)
            and cfg.devices * cfg.nodes > 1 and cfg.trainer.mode in (Mode.trainval, Mode.eval))


def prestart(cfg: AppConfig) -> None:
    """Start the worker server now when workers will be needed, so that it imports torch while
    this process does its own imports. The server never runs a torch op or touches a GPU, so
    forking workers from it is safe: no CUDA context and no thread pool are inherited."""
    if cfg.distributed.start_method == "forkserver" and spawns_workers(cfg):
        multiprocessing.set_forkserver_preload(PRELOAD)
        multiprocessing.forkserver.ensure_running()


class WorkerFailed(AppError):
    """A worker process raised or died; the message names the rank and the cause."""


class _ParentSignals:
    """Ctrl-C / SIGTERM to the launching process: ask workers to stop cleanly, once; again: kill."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def __enter__(self) -> _ParentSignals:
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT,
                                                                      signal.SIGTERM)}
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.received.append(signum)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _failure_message(procs: list, killed: set[int], reports: list[dict], grace: float,
                     timeout_s: float, run_dir: Path, base_rank: int) -> str:
    # A worker that died of a signal we did not send is the cause; otherwise the earliest
    # error, since a rank that fails makes its peers fail in their next collective.
    for local, proc in enumerate(procs):
        if proc.exitcode is not None and proc.exitcode < 0 and local not in killed:
            name = signal.Signals(-proc.exitcode).name
            return (f"rank {base_rank + local} (pid {proc.pid}) was killed by {name}; "
                    f"the other workers were stopped")
    if not reports:
        codes = {base_rank + i: p.exitcode for i, p in enumerate(procs)}
        return f"workers exited with codes {codes}"
    first = min(reports, key=lambda r: r["time"])
    rank_log = run_dir / "logs" / f"rank{first['rank']}.log"
    message = f"rank {first['rank']} failed: {first['error']} (traceback in {rank_log})"
    if "timed out" in first["error"].lower() or "timeout" in first["error"].lower():
        message += (f"; a rank did not reach a collective within "
                    f"distributed.timeout_s={timeout_s:g}")
    if killed:
        stuck = ", ".join(str(base_rank + i) for i in sorted(killed))
        message += f"; rank(s) {stuck} did not exit within {grace:g} s and were killed"
    return message


def spawn(cfg: AppConfig, run_dir: Path, kind: str, devices: int, url: str) -> float | None:
    """Start `devices` workers, watch them, and end them all if one fails or a signal comes."""
    from app.worker import spawned_worker  # (torch: after the worker server has started)

    if cfg.distributed.start_method == "forkserver":
        multiprocessing.set_forkserver_preload(PRELOAD)  # (when prestart could not know)
    ctx = multiprocessing.get_context(cfg.distributed.start_method)
    grace = cfg.distributed.kill_grace_s
    base_rank = cfg.machine_rank * devices
    log.info("starting %d workers (%s, ranks %d-%d of %d, rendezvous %s)", devices,
             cfg.distributed.start_method, base_rank, base_rank + devices - 1,
             devices * cfg.nodes, url)
    # Workers of a forkserver are its children, not ours, so PR_SET_PDEATHSIG cannot tell them
    # that this process died, and the server lives as long as they do: each worker instead
    # watches the read end of this pipe, which reaches end-of-file when we exit in any way.
    launcher_alive, keep_open = ctx.Pipe(duplex=False)
    with tempfile.TemporaryDirectory(prefix="app-workers-") as report_dir, keep_open:
        procs = [ctx.Process(target=spawned_worker, name=f"app-rank{base_rank + i}",
                             args=(i, cfg, run_dir, kind, devices, url, report_dir,
                                   launcher_alive))
                 for i in range(devices)]
        killed: set[int] = set()
        with _ParentSignals() as signals:
            for proc in procs:
                proc.start()
            launcher_alive.close()
            failed_at = asked_at = None
            while any(p.is_alive() for p in procs):
                multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()],
                                                timeout=0.2)
                now = time.monotonic()
                if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                    failed_at = now
                if signals.received and asked_at is None:
                    asked_at = now
                    for p in procs:
                        if p.is_alive():
                            os.kill(p.pid, signal.SIGTERM)  # workers checkpoint, then stop
                overdue = (failed_at is not None and now - failed_at > grace) or (
                    asked_at is not None and (len(signals.received) > 1 or
                                              now - asked_at > cfg.distributed.timeout_s))
                if overdue:
                    for i, p in enumerate(procs):
                        if p.is_alive():
                            killed.add(i)
                            p.kill()
            for p in procs:
                p.join()
        report = Path(report_dir)
        if all(p.exitcode == 0 for p in procs):
            return json.loads((report / "result.json").read_text())["result"]
        if signals.received:
            sig = signals.received[0]
            error = AppError(f"stopped by {signal.Signals(sig).name}; the workers saved a "
                             f"checkpoint: run again with hydra.run.dir={run_dir} to resume")
            error.exit_code = 128 + sig
            raise error
        reports = [json.loads(p.read_text()) for p in report.glob("rank*.json")]
        raise WorkerFailed(_failure_message(procs, killed, reports, grace,
                                            cfg.distributed.timeout_s, run_dir, base_rank))


