"""Every failure the app expects, in one module (no imports: data and model modules use them
alone). Each ends a run with one line (`one_line` for the run's records) and the exit status
of its class; anything else is a bug and keeps its traceback."""

from __future__ import annotations


class AppError(Exception):
    """An expected failure, reported as one line without a traceback."""

    exit_code = 1


class UserError(AppError, ValueError):
    """A mistake in what the user asked for: a bad value, a missing file."""

    exit_code = 2


class BadImage(UserError):
    """An image file that cannot be decoded; the message names the file and why."""


class RunDirInUse(UserError):
    """Another live command owns the run directory; nothing was written into it."""


class Interrupted(AppError):
    """The run was stopped by a signal (SIGINT/SIGTERM); the message says what was saved."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum  # what a shell reports for a process ended by signum


class StoppedByPeer(Interrupted):
    """A rank stopped at the step every rank agreed on because another rank failed there (its
    log file could not be written): a stop, so that the failed rank's error is the run's."""

    def __init__(self, message: str) -> None:
        AppError.__init__(self, message)
        self.signum, self.exit_code = None, 1


class WorkerFailed(AppError):
    """A worker process raised or died; the message names the rank and the cause. Its exit
    status is the cause's when that was a user's mistake (2): a script that tells bad input
    from a failure sees the same status with devices=2 as with one process."""

    def __init__(self, message: str = "", cause_exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = UserError.exit_code if cause_exit_code == UserError.exit_code else 1


class WorkerKilled(WorkerFailed):
    """A worker died by a signal the launcher did not send (the OOM killer, a crash): a fault
    of the machine, not of the code, which `distributed.max_restarts` retries."""


class WriteFailed(AppError):
    """A run file could not be written (its previous content is intact)."""


class ExportMismatch(AppError):
    """An exported model whose outputs differ from the eager model's."""


class DataItemError(AppError):
    """An item of a data set failed to load."""

    def __init__(self, message: str) -> None:
        # A loader worker's error comes back as "Caught DataItemError in DataLoader worker
        # process N.\nOriginal Traceback ... app.errors.DataItemError: <message>".
        if message.startswith("Caught "):
            last = message.strip().splitlines()[-1]
            message = last.split(f"{type(self).__name__}: ", 1)[-1]
        super().__init__(message)


class JobFailed(Exception):  # noqa: N818 (reads as the task's last line: "JobFailed: ...")
    """Raised in a submitit task whose job recorded a failure but returned: its task must exit
    non-zero (Slurm then marks the job FAILED)."""


class RecordUnreadable(Exception):  # noqa: N818 (reads as what happened)
    """A sweep's `submission.json` that cannot be read (cut short, edited by hand): not the
    same as none, since its jobs may still be queued. The message names it."""


class LockHeld(Exception):  # noqa: N818 (reads as what happened)
    """Another process holds a lock this one asked for at once: `pid P on HOST`."""


class InternalMissing(RuntimeError):
    """A private attribute app relies on is gone: an upgrade moved it (see app._private). A bug
    of this version of app, not a user's mistake: it keeps its traceback."""


def first_line(e: BaseException) -> str:
    """The first line of the error's message; its type's name when it has none."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def one_line(e: BaseException) -> str:
    """`Type: first line of the message` (the type alone for an empty one): how a run's
    records (result.json, a worker's report) keep the error that ended it."""
    first = first_line(e)
    return type(e).__name__ if first == type(e).__name__ else f"{type(e).__name__}: {first}"
