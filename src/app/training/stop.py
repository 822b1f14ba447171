"""Stopping on a signal at a step boundary that every rank agrees on.

A signal handler only sets a flag. At each step boundary every rank calls `should_stop()`;
with several ranks it starts a non-blocking MAX all-reduce of the flag and reads the previous
step's result, so all ranks see the same answer at the same step, one step after the first
rank got the signal, without waiting on the network in the step loop.

SIGINT and SIGTERM stop the run. SIGUSR1/SIGUSR2 are handled only where a job system put a
handler of its own for them (submitit asks for USR2 before a time limit or on preemption):
the loop stops, the checkpoint is written, and then that handler runs (submitit's requeues
the job, which resumes from the checkpoint).

A log file that could not be written (a full disk: app.logfile) stops the run the same way,
and ends it with that error.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import torch
import torch.distributed as tdist

from app import dist, logfile, progress, signals
from app.errors import AppError, Interrupted, StoppedByPeer, WriteFailed, first_line

REQUEUE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
REQUEUE_WAIT_S = 120
LOG_FAILED = 1000  # + the rank: the flag of a rank whose log file failed (above any signal)


class StopRequest:
    def __init__(self) -> None:
        self.signal: int | None = None
        self.requeue_signal: int | None = None
        self.failed_rank: int | None = None  # another rank's log file failed
        self._previous: dict[int, Any] = {}
        self._pending: tuple[Any, torch.Tensor] | None = None

    def __enter__(self) -> StopRequest:
        self._previous = signals.install(self._handle)
        # A job system's own handler of a requeue signal
        self._previous.update(signals.install(self._handle, tuple(
            sig for sig in REQUEUE_SIGNALS if callable(signal.getsignal(sig)))))
        self.signal = signals.held()  # (before the loop, in a job's task)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        # A requeue request wins over a plain stop (submitit's preemption sends TERM, then USR2).
        if signum in REQUEUE_SIGNALS:
            self.requeue_signal = signum
        self.signal = self.requeue_signal or self.signal or signum

    def requeue(self) -> None:
        """After the checkpoint: hand a requeue request to the handler it was meant for.

        Rank 0's handler requeues the job (which ends every task of it) and exits. The other
        ranks wait to be ended: exiting first would make Slurm end rank 0 (--kill-on-bad-exit)
        before it could requeue.
        """
        if self.requeue_signal is None:
            return
        handler = self._previous[self.requeue_signal]
        self.__exit__(None)
        progress.leave()  # (the wait for Slurm to end this rank is not a stall)
        if dist.rank() == 0:
            handler(self.requeue_signal, None)
        else:
            time.sleep(REQUEUE_WAIT_S)

    def should_stop(self) -> bool:
        if not dist.initialized():
            return self.signal is not None or logfile.failure() is not None
        agreed = False
        if self._pending is not None:
            work, flag = self._pending
            with progress.waiting():
                work.wait()
            agreed = flag.item() > 0
            if agreed and self.signal is None and flag.item() >= LOG_FAILED:
                self.failed_rank = int(flag.item()) - LOG_FAILED
            elif agreed and self.signal is None:
                self.signal = int(flag.item())  # another rank's signal
        if not agreed:
            failed = logfile.failure() is not None
            flag = torch.tensor([LOG_FAILED + dist.rank() if failed else self.signal or 0])
            work = tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=dist.control_group(),
                                    async_op=True)
            self._pending = (work, flag)
        else:
            self._pending = None
        return agreed

    def stopped(self, step: int, resume: str) -> AppError:
        """What ends the run stopped at `step`, its checkpoint saved; `resume`: how to go on."""
        if (failed := logfile.failure()) is not None:
            return WriteFailed(f"{failed}: the run stopped at step {step} with a checkpoint; "
                               f"free some space (or fix the mount), then {resume}")
        if self.signal is None:  # (the rank that failed reports it)
            return StoppedByPeer(f"rank {self.failed_rank}'s log file could not be written: the "
                                 f"run stopped at step {step} with a checkpoint")
        return Interrupted(f"stopped by signal {signal.Signals(self.signal).name} at step "
                           f"{step}; checkpoint saved: {resume}", self.signal)

    def __exit__(self, exc_type: object, exc: BaseException | None = None,
                 *rest: object) -> None:
        # A collective left in flight must finish before the process group goes away; after an
        # error elsewhere it may never finish, so it is only waited for on a clean exit.
        if self._pending is not None and exc_type is None:
            self._pending[0].wait()
        self._pending = None
        signals.restore(self._previous)
        self._previous = {}
        if dist.initialized():
            # A rank of a job: its launcher (ours, torchrun's agent) passes a stop signal on to
            # every rank, and its copy may come after this rank left the loop (stopped or
            # completed): it must not end the rank before its end is recorded. A rank that does
            # not end is killed by its launcher.
            signals.install(signal.SIG_IGN)
        # A log file's failure (a full disk) is said with the failure that followed it: the
        # checkpoint at the stop may have failed too. (A signal's stop keeps its exit status.)
        failed = logfile.failure()
        if failed is not None and isinstance(exc, AppError) and \
                not isinstance(exc, Interrupted) and failed not in str(exc):
            raise WriteFailed(f"{failed}; {first_line(exc)}") from exc
