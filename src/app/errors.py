"""The two kinds of expected failure (no imports: data and model modules use them alone)."""


class AppError(Exception):
    """An expected failure, reported as one line without a traceback."""

    exit_code = 1


class UserError(AppError, ValueError):
    """A mistake in what the user asked for: a bad value, a missing file."""

    exit_code = 2
