"""Local worker processes: start them, watch them, and end them all when one fails.

Imported without torch: the launching process starts the worker server (forkserver) before it
imports torch itself, so that both imports run at the same time.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from app import signals
from app.config import AppConfig, Mode
from app.errors import Interrupted, WorkerFailed, WorkerKilled
from app.launch import ends
from app.rundir.name import resume_hint

if TYPE_CHECKING:
    from app.launch.plan import Plan

log = logging.getLogger(__name__)

# What the forkserver imports once, so that each worker it forks starts with them: torch, and
# torch._dynamo, which every optimizer.step() imports (about as slow as torch itself).
PRELOAD = ["torch", "torch._dynamo", "app.launch.worker", "app.training.loop", "app.modes.evaluate"]
MP_TEMP_PREFIX = "app-mp-"  # + the launcher's pid: multiprocessing's folder of sockets


def prestart(cfg: AppConfig) -> None:
    """Start the worker server now, so that it imports torch while this process does its own
    imports. It never runs a torch op or touches a GPU: its forks inherit no CUDA context."""
    if cfg.distributed.start_method != "forkserver":
        return
    multiprocessing.set_forkserver_preload(PRELOAD)
    # multiprocessing's folder of sockets (`pymp-*`) outlives a launcher killed by SIGKILL: it
    # goes into one named for this process, and each start removes those of launchers gone.
    for old in Path(tempfile.gettempdir()).glob(f"{MP_TEMP_PREFIX}*"):
        pid = old.name.removeprefix(MP_TEMP_PREFIX).split("-")[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    mine = tempfile.mkdtemp(prefix=f"{MP_TEMP_PREFIX}{os.getpid()}-")
    before, tempfile.tempdir = tempfile.tempdir, mine
    try:
        multiprocessing.util.get_temp_dir()  # (kept by multiprocessing unless it has one)
        # Started first, out of the window below: starting it unblocks SIGINT, and a Ctrl-C
        # then met SIG_IGN here and was lost (the run trained on).
        multiprocessing.resource_tracker.ensure_running()
        # Ctrl-C ignored by the server, which imports torch before it sets its own handlers (a
        # Ctrl-C there printed a traceback), and blocked meanwhile here, where it stays pending
        # to be answered after (ignored, it was lost); its workers unblock it. The launcher
        # alone answers Ctrl-C.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        with signals.caught(signal.SIG_IGN, (signal.SIGINT,)):
            multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        tempfile.tempdir = before
    if any(Path(mine).iterdir()):  # after multiprocessing's own clean-up (exitpriority -100)
        multiprocessing.util.Finalize(None, shutil.rmtree, (mine, True), exitpriority=-101)
    else:
        os.rmdir(mine)


def _server() -> psutil.Process | None:
    """The worker server: the child of this process that runs multiprocessing.forkserver."""
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if any("multiprocessing.forkserver" in part for part in child.cmdline()):
                return child
    return None


def spawn(cfg: AppConfig, run_dir: Path, plan: Plan) -> float | None:
    """Start `plan.devices` workers (torch.multiprocessing.start_processes), watch them, and
    end them all if one fails or a signal comes."""
    import torch.multiprocessing

    from app.launch.worker import spawned_worker  # (torch: after the worker server has started)

    method, devices, url = cfg.distributed.start_method, plan.devices, plan.url
    prestart(cfg)  # (when __main__ could not know: devices=auto)
    base_rank = cfg.machine_rank * devices
    log.info("starting %d workers (%s, ranks %d-%d of %d, rendezvous %s)", devices, method,
             base_rank, base_rank + devices - 1, devices * cfg.nodes, url)
    if cfg.nodes > 1 and cfg.machine_rank == 0:  # (the rendezvous waits for them, silently)
        log.info("waiting for the other %d machine(s) to join at %s: run the same command on "
                 "each, with its machine_rank (1 to %d); distributed.timeout_s=%g", cfg.nodes - 1,
                 url, cfg.nodes - 1, cfg.distributed.timeout_s)
    # Workers of a forkserver are its children, not ours, so PR_SET_PDEATHSIG cannot tell them
    # that this process died, and the server lives as long as they do: each worker instead
    # watches the read end of this pipe, which reaches end-of-file when we exit in any way.
    launcher_alive, keep_open = multiprocessing.get_context(method).Pipe(duplex=False)
    results, result_sent = multiprocessing.get_context(method).Pipe(duplex=False)
    started, received, completed = time.time(), [], False
    # Ctrl-C / SIGTERM: the workers stop cleanly, once; again: they are killed.
    with keep_open, results, signals.caught(lambda sig, frame: received.append(sig)):
        if (held := signals.held()) is not None:  # (a job's task, before this)
            received.append(held)
        try:
            procs = torch.multiprocessing.start_processes(
                spawned_worker, (cfg, run_dir, plan, launcher_alive, result_sent), devices,
                join=False, start_method=method).processes
        except (EOFError, OSError) as e:  # (a signal to the process group ends the server too)
            if not received:
                raise
            raise Interrupted(f"stopped by {signal.Signals(received[0]).name} as the workers "
                              f"started: there is no checkpoint yet", received[0]) from e
        launcher_alive.close()
        result_sent.close()
        killed, server_died = _watch(cfg, procs, received,
                                     _server() if method == "forkserver" else None)
        ended = ends.read(run_dir, started, range(base_rank, base_rank + devices))
        # The first worker sends its result after the last collective: the run has completed,
        # even if a signal reached a worker (or ended the worker server) as it was exiting.
        if not ended and results.poll():
            with contextlib.suppress(EOFError):  # (EOF: none was sent)
                value, completed = results.recv(), True
    if not completed:
        raise _outcome(cfg, run_dir, procs, received, killed, ended, server_died, base_rank)
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    # In a sweep a signal ends the sweep as before: the next job has not begun.
    if not (HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN):
        signals.stop_signals_stop_nothing()
    return value


def _outcome(cfg: AppConfig, run_dir: Path, procs: list, received: list[int], killed: set[int],
             ended: dict[int, dict], server_died: bool, base_rank: int) -> Exception:
    """What ended workers that did not complete the run, as the error to raise."""
    periodic = sorted((run_dir / "checkpoints").glob("step-*.pt"))
    last = (f"the last checkpoint is {periodic[-1].relative_to(run_dir)}" if periodic else
            "there is no checkpoint yet") + f": {resume_hint(run_dir)}"
    stuck = ", ".join(str(base_rank + i) for i in sorted(killed))
    cause = ends.first_failure(ended)
    stall = cause is not None and cause["status"] == ends.STALLED
    stopped = sorted((e for e in ended.values() if e["status"] == ends.STOPPED),
                     key=lambda e: e["rank"])
    # (A rank stopped before its loop, by Ctrl-C as it started, has no step to name.)
    steps = [m[1] for e in stopped if (m := re.search(r"at step (\d+)", e["error"]))]
    saved = len(steps) == len(procs) and not killed  # every rank saved and stopped
    if server_died and not received:  # (a signal to the process group ends the server too)
        return WorkerFailed(f"the worker server (forkserver) ended under the workers: they were "
                            f"stopped; {last}")
    if received or saved:  # (not received: a worker was sent the signal, not us)
        sig = signal.Signals(received[0] if received else stopped[0]["exit_code"] - 128)
        said = f"stopped by {sig.name}{'' if received else ' sent to a worker'}"
        if saved:
            return Interrupted(f"{said}; the workers saved a checkpoint at step {steps[0]}: "
                               f"{resume_hint(run_dir)}", sig)
        if cfg.trainer.mode != Mode.trainval:
            return Interrupted(said, sig)
        # A rank ended before its loop by our SIGTERM (it was in a call into C, where the
        # signal's Python handler waits) recorded nothing: it died of it (the loop takes it).
        unrecorded = [p.exitcode for i, p in enumerate(procs) if base_rank + i not in ended]
        before_loop = stopped or (unrecorded and all(c == -signal.SIGTERM for c in unrecorded))
        why = cause["error"] if stall else f"rank(s) {stuck} did not stop and were killed" \
            if killed else "the workers had not begun training" if before_loop and not steps \
            else "not every rank reached the step they agreed to stop at"
        return Interrupted(f"{said}, but no checkpoint was saved at the stop ({why}); {last}", sig)
    # The cause: a stalled rank (the others ended because of it), a worker that died of a
    # signal we did not send, else the earliest failure.
    died = next((i for i, p in enumerate(procs)
                 if p.exitcode is not None and p.exitcode < 0 and i not in killed), None)
    if stall:
        message = cause["error"]
    elif died is not None:
        message = (f"rank {base_rank + died} (pid {procs[died].pid}) was killed by "
                   f"{signal.Signals(-procs[died].exitcode).name}; the other workers were stopped")
    elif cause is None:
        codes = {base_rank + i: p.exitcode for i, p in enumerate(procs)}
        message = f"workers exited with codes {codes}"
    else:
        message = ends.failed_line(run_dir, cause)
        if re.search("timed out|timeout", cause["error"], re.IGNORECASE):
            message += (f"; a rank did not reach a collective within "
                        f"distributed.timeout_s={cfg.distributed.timeout_s:g}")
        if killed:
            message += (f"; rank(s) {stuck} did not exit within "
                        f"{cfg.distributed.kill_grace_s:g} s and were killed")
    # A stalled rank (named by the watchdog, then killed) is not a machine's fault: only a
    # death by a signal of its own is retried (app.launch.run).
    if died is not None and not stall:
        return WorkerKilled(message)
    return WorkerFailed(message, 1 if stall or cause is None else cause["exit_code"])


def _process(pid: int) -> psutil.Process | None:
    """A worker that stays valid after its parent (the forkserver) is gone, and that is never
    another process that took the pid over (psutil checks its start time)."""
    with contextlib.suppress(psutil.Error):  # (it has ended already)
        return psutil.Process(pid)
    return None


def _alive(process: psutil.Process | None) -> bool:
    with contextlib.suppress(psutil.Error):
        return process is not None and process.status() != psutil.STATUS_ZOMBIE
    return False


def _watch(cfg: AppConfig, procs: list, received: list[int], server: psutil.Process | None
           ) -> tuple[set[int], bool]:
    """Wait until every worker has ended; stop them all when one fails, when a signal comes or
    when the worker server dies. Returns the workers killed, and whether the server died (the
    workers' exit codes are then unknown)."""
    grace, timeout_s = cfg.distributed.kill_grace_s, cfg.distributed.timeout_s
    workers = [_process(p.pid) for p in procs]
    killed: set[int] = set()
    failed_at = asked_at = None
    server_died = False

    def send(sig: int) -> list[int]:
        running = [i for i, worker in enumerate(workers) if _alive(worker)]
        for i in running:
            with contextlib.suppress(psutil.Error):
                workers[i].send_signal(sig)
        return running

    while any(_alive(worker) for worker in workers):
        time.sleep(0.1)
        now = time.monotonic()
        # The worker server gone (our child, a zombie until multiprocessing restarts it): the
        # workers' exit codes are lost with it (multiprocessing reads 255 for each).
        if server is not None and not server_died and not _alive(server):
            server_died, asked_at = True, now
            send(signal.SIGTERM)  # the workers checkpoint, then stop
            continue
        if failed_at is None and not server_died and any(
                p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        if received and asked_at is None:
            asked_at = now
            # Said at once: a rank that cannot answer (stopped, stuck) holds the stop until
            # the stall watchdog or timeout_s, minutes by default.
            log.warning("%s: the workers stop at a step they all reach and save a checkpoint "
                        "there; %s again ends them at once", signal.Signals(received[0]).name,
                        "Ctrl-C" if received[0] == signal.SIGINT else "the signal")
            send(signal.SIGTERM)  # the workers checkpoint, then stop
        # After a stop request, a rank held in a collective fails it at timeout_s; the grace
        # after that lets it report so, rather than be killed at the same moment.
        if (failed_at is not None and now - failed_at > grace) or (asked_at is not None and (
                len(received) > 1 or now - asked_at > timeout_s + grace)):
            killed.update(send(signal.SIGKILL))
    if not server_died:
        for p in procs:
            p.join()
    return killed, server_died
