"""Local worker processes: start them, watch them, and end them all when one fails.

Imported without torch: the launching process starts the worker server (forkserver) before it
imports torch itself, so that both imports run at the same time.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
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
from app.run_name import resume_hint

if TYPE_CHECKING:
    from app.launch.plan import Plan

log = logging.getLogger(__name__)

# What the forkserver imports once, so that each worker it forks starts with them: torch, and
# torch._dynamo, which every optimizer.step() imports (about as slow as torch itself).
PRELOAD = ["torch", "torch._dynamo", "app.launch.worker", "app.training.loop", "app.modes.evaluate"]


def prestart(cfg: AppConfig) -> None:
    """Start the worker server now (workers will be needed: app.launch.plan.spawns_workers), so
    that it imports torch while this process does its own imports. The server never runs a
    torch op or touches a GPU, so forking workers from it is safe: no CUDA context and no
    thread pool are inherited."""
    if cfg.distributed.start_method == "forkserver":
        multiprocessing.set_forkserver_preload(PRELOAD)
        _start_worker_server()


MP_TEMP_PREFIX = "app-mp-"  # + the launcher's pid: multiprocessing's folder of sockets


def _start_worker_server() -> None:
    """Start the worker server with Ctrl-C ignored: it imports torch first and sets its own
    handlers only after that, so a Ctrl-C in that window would end it with a traceback (and
    the next worker's start with another). The launcher alone answers Ctrl-C; each worker
    takes SIGINT back at its start (app.launch.worker).

    multiprocessing keeps its sockets in a folder (`pymp-*`) that a launcher killed by SIGKILL
    cannot remove: it goes into one named for this process (unless multiprocessing has one
    already), and each start removes those of launchers of this host that are gone."""
    base = Path(tempfile.gettempdir())
    for old in base.glob(f"{MP_TEMP_PREFIX}*"):
        pid = old.name.removeprefix(MP_TEMP_PREFIX).split("-")[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    mine = tempfile.mkdtemp(prefix=f"{MP_TEMP_PREFIX}{os.getpid()}-")
    before, tempfile.tempdir = tempfile.tempdir, mine
    try:
        multiprocessing.util.get_temp_dir()
        with signals.caught(signal.SIG_IGN, (signal.SIGINT,)):
            multiprocessing.forkserver.ensure_running()
    finally:
        tempfile.tempdir = before
    if any(Path(mine).iterdir()):  # after multiprocessing's own clean-up (exitpriority -100)
        multiprocessing.util.Finalize(None, shutil.rmtree, (mine, True), exitpriority=-101)
    else:
        os.rmdir(mine)


def _server_pid() -> int | None:
    """The worker server: the child of this process that runs multiprocessing.forkserver."""
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if any("multiprocessing.forkserver" in part for part in child.cmdline()):
                return child.pid
    return None


class _ParentSignals:
    """Ctrl-C / SIGTERM to the launching process: ask workers to stop cleanly, once; again: kill."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.completed = False  # the workers completed the run (see _after_completion)

    def __enter__(self) -> _ParentSignals:
        self._previous = signals.install(self._handle)
        held = signals.held()  # (a job's task, before this)
        if held is not None:
            self.received.append(held)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.received.append(signum)

    def __exit__(self, *exc: object) -> None:
        signals.restore(self._previous)
        if self.completed:
            self._after_completion()

    def _after_completion(self) -> None:
        """The workers have completed the run (app.launch.completed); in a sweep a signal ends
        the sweep as before: the next job has not begun."""
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not (HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN):
            signals.stop_signals_stop_nothing()


def _handle(pid: int) -> psutil.Process | None:
    """A worker by pid that stays valid after its parent (the forkserver) is gone, and that is
    never another process that took the pid over (psutil checks its start time)."""
    try:
        return psutil.Process(pid)
    except psutil.Error:  # it has ended already
        return None


def _alive(handle: psutil.Process | None) -> bool:
    try:
        return handle is not None and handle.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _send(handle: psutil.Process | None, sig: int) -> None:
    with contextlib.suppress(psutil.Error, AttributeError):
        handle.send_signal(sig)


def _forkserver_death(pid: int | None, settle_s: float = 2.0) -> str | None:
    """How the worker server ended (it is this process's child), or None while it runs. It is
    not reaped here: multiprocessing restarts it (a sweep's next job) once it has reaped it.
    A dying server closes its sockets (the workers then read as exit code 255) a moment before
    it becomes a zombie that waitid sees, so its end is awaited up to `settle_s`."""
    if pid is None:
        return None
    deadline = time.monotonic() + settle_s
    while True:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return f"(pid {pid}) is gone"
        if info is not None or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    if info is None:
        return None
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return f"(pid {pid}) was killed by {signal.Signals(info.si_status).name}"
    return f"(pid {pid}) exited with code {info.si_status}"


def _last_checkpoint(run_dir: Path) -> str:
    periodic = sorted((run_dir / "checkpoints").glob("step-*.pt"))
    if not periodic:
        return "there is no checkpoint yet"
    return f"the last checkpoint is {periodic[-1].relative_to(run_dir)}"


def _killed_by_signal(procs: list, killed: set[int]) -> int | None:
    """The first worker that died by a signal this process did not send."""
    for local, proc in enumerate(procs):
        if proc.exitcode is not None and proc.exitcode < 0 and local not in killed:
            return local
    return None


def _failure_message(procs: list, killed: set[int], cause: dict | None, grace: float,
                     timeout_s: float, run_dir: Path, base_rank: int) -> str:
    """The cause: a stalled rank (the others ended because of it), a worker that died of a
    signal we did not send, else the earliest failure (app.launch.ends)."""
    died = _killed_by_signal(procs, killed)
    if cause is not None and cause["status"] == ends.STALLED:
        return cause["error"]
    if died is not None:
        return (f"rank {base_rank + died} (pid {procs[died].pid}) was killed by "
                f"{signal.Signals(-procs[died].exitcode).name}; the other workers were stopped")
    if cause is None:
        codes = {base_rank + i: p.exitcode for i, p in enumerate(procs)}
        return f"workers exited with codes {codes}"
    message = ends.failed_line(run_dir, cause)
    if "timed out" in cause["error"].lower() or "timeout" in cause["error"].lower():
        message += (f"; a rank did not reach a collective within "
                    f"distributed.timeout_s={timeout_s:g}")
    if killed:
        stuck = ", ".join(str(base_rank + i) for i in sorted(killed))
        message += f"; rank(s) {stuck} did not exit within {grace:g} s and were killed"
    return message


def _stop_message(sig: int, cfg: AppConfig, killed: set[int], ended: dict[int, dict],
                  devices: int, run_dir: Path, base_rank: int) -> str:
    """What a stop by `sig` left behind, as the workers recorded it (a checkpoint is saved only
    when every rank reached the step they agreed to stop at)."""
    name = signal.Signals(sig).name
    stopped = sorted((e for e in ended.values() if e["status"] == ends.STOPPED),
                     key=lambda e: e["rank"])
    if len(stopped) == devices and not killed:  # every rank saved and stopped
        step = re.search(r"at step (\d+)", stopped[0]["error"])
        return (f"stopped by {name}; the workers saved a checkpoint"
                f"{f' at step {step[1]}' if step else ''}: {resume_hint(run_dir)}")
    if cfg.trainer.mode != Mode.trainval:
        return f"stopped by {name}"
    stall = ends.first_failure(ended)
    if stall is not None and stall["status"] == ends.STALLED:
        why = stall["error"]
    elif killed:
        stuck = ", ".join(str(base_rank + i) for i in sorted(killed))
        why = f"rank(s) {stuck} did not stop and were killed"
    else:
        why = "not every rank reached the step they agreed to stop at"
    return (f"stopped by {name}, but no checkpoint was saved at the stop ({why}); "
            f"{_last_checkpoint(run_dir)}: {resume_hint(run_dir)}")


def spawn(cfg: AppConfig, run_dir: Path, plan: Plan) -> float | None:
    """Start `plan.devices` workers (torch.multiprocessing.start_processes), watch them, and
    end them all if one fails or a signal comes."""
    import torch.multiprocessing

    from app.launch.worker import spawned_worker  # (torch: after the worker server has started)

    method = cfg.distributed.start_method
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(PRELOAD)  # (when prestart could not know)
        _start_worker_server()
    server = _server_pid() if method == "forkserver" else None
    grace, devices, url = cfg.distributed.kill_grace_s, plan.devices, plan.url
    base_rank = cfg.machine_rank * devices
    log.info("starting %d workers (%s, ranks %d-%d of %d, rendezvous %s)", devices, method,
             base_rank, base_rank + devices - 1, devices * cfg.nodes, url)
    # Workers of a forkserver are its children, not ours, so PR_SET_PDEATHSIG cannot tell them
    # that this process died, and the server lives as long as they do: each worker instead
    # watches the read end of this pipe, which reaches end-of-file when we exit in any way.
    launcher_alive, keep_open = multiprocessing.get_context(method).Pipe(duplex=False)
    results, result_sent = multiprocessing.get_context(method).Pipe(duplex=False)
    started = time.time()
    with keep_open, results, _ParentSignals() as signals:
        procs = torch.multiprocessing.start_processes(
            spawned_worker, (cfg, run_dir, plan, launcher_alive, result_sent), devices,
            join=False, start_method=method).processes
        launcher_alive.close()
        result_sent.close()
        killed, server_died = _watch(cfg, procs, signals, server)
        ended = ends.read(run_dir, started, range(base_rank, base_rank + devices))
        # The first worker sends its result after the last collective: the run has completed,
        # even if a signal reached a worker as it was exiting.
        if server_died is None and not ended and results.poll():
            with contextlib.suppress(EOFError):  # (EOF: none was sent)
                value = results.recv()
                signals.completed = True
                return value
    if server_died is not None:
        raise WorkerFailed(
            f"the worker server (forkserver) {server_died}: the workers were stopped; "
            f"{_last_checkpoint(run_dir)}: {resume_hint(run_dir)}")
    if signals.received:
        sig = signals.received[0]
        raise Interrupted(_stop_message(sig, cfg, killed, ended, devices, run_dir, base_rank),
                          sig)
    stopped = [e for e in ended.values() if e["status"] == ends.STOPPED]
    if len(stopped) == devices and not killed:  # a worker was sent the signal, not us
        sig = signal.Signals(stopped[0]["exit_code"] - 128)
        said = _stop_message(sig, cfg, killed, ended, devices, run_dir, base_rank)
        raise Interrupted(said.replace(f"stopped by {sig.name}",
                                       f"stopped by {sig.name} sent to a worker", 1), sig)
    cause = ends.first_failure(ended)
    stall = cause is not None and cause["status"] == ends.STALLED
    # A stalled rank (which the watchdog names, and which is then killed) is not a machine's
    # fault: only a death by a signal of its own is retried.
    machine_fault = _killed_by_signal(procs, killed) is not None and not stall
    cause_code = 1 if machine_fault or stall or cause is None else cause["exit_code"]
    raise (WorkerKilled if machine_fault else WorkerFailed)(_failure_message(
        procs, killed, cause, grace, cfg.distributed.timeout_s, run_dir, base_rank),
        cause_code)


def _watch(cfg: AppConfig, procs: list, signals: _ParentSignals, server: int | None
           ) -> tuple[set[int], str | None]:
    """Wait until every worker has ended; stop them all when one fails, when a signal comes or
    when the worker server dies. Returns the workers killed, and how the server died (if it did:
    the workers' exit codes are then unknown)."""
    grace, forkserver = cfg.distributed.kill_grace_s, cfg.distributed.start_method == "forkserver"
    handles = [_handle(p.pid) for p in procs]
    killed: set[int] = set()
    failed_at = asked_at = server_died = None

    def running() -> list[int]:
        if server_died is None:
            return [i for i, p in enumerate(procs) if p.is_alive()]
        return [i for i, h in enumerate(handles) if _alive(h)]

    while alive := running():
        # Once the server is gone, its sentinels say nothing: the workers' handles tell their end.
        if server_died is None:
            multiprocessing.connection.wait([procs[i].sentinel for i in alive], timeout=0.2)
        else:
            time.sleep(0.2)
        now = time.monotonic()
        # A worker's end reads as exit code 255 when the server is gone: check which it is.
        if forkserver and server_died is None and any(p.exitcode == 255 for p in procs):
            server_died = _forkserver_death(server)
            if server_died is not None:
                asked_at = now
                for handle in handles:
                    _send(handle, signal.SIGTERM)  # the workers checkpoint, then stop
                continue
        if failed_at is None and server_died is None and any(
                p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        if signals.received and asked_at is None:
            asked_at = now
            # Said at once: a rank that cannot answer (stopped, stuck) holds the stop until
            # the stall watchdog or timeout_s, minutes by default.
            log.warning("%s: the workers stop at a step they all reach and save a checkpoint "
                        "there; %s again ends them at once",
                        signal.Signals(signals.received[0]).name,
                        "Ctrl-C" if signals.received[0] == signal.SIGINT else "the signal")
            for i in running():
                _send(handles[i], signal.SIGTERM)  # workers checkpoint, then stop
        # After a stop request, a rank held in a collective fails it at timeout_s; the grace
        # after that lets it report so, rather than be killed at the same moment.
        overdue = (failed_at is not None and now - failed_at > grace) or (
            asked_at is not None and (len(signals.received) > 1 or
                                      now - asked_at > cfg.distributed.timeout_s + grace))
        if overdue:
            for i in running():
                killed.add(i)
                _send(handles[i], signal.SIGKILL)
    if server_died is None:
        for p in procs:
            p.join()
    return killed, server_died
