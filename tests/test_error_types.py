"""Every expected failure is a class of app.errors; its exit status and one-line record."""

from __future__ import annotations

import ast
import signal
from pathlib import Path

import app
from app import errors
from app.errors import AppError, Interrupted, UserError, WorkerFailed, one_line

SRC = Path(app.__file__).parent


def test_every_error_class_of_the_app_is_defined_in_app_errors() -> None:
    known = {"Exception", "BaseException", "ValueError", "RuntimeError", "OSError"}
    found: dict[str, str] = {}
    trees = {path: ast.parse(path.read_text()) for path in SRC.rglob("*.py")}
    for _ in range(3):  # subclasses of subclasses, whatever the order of the files
        for path, tree in trees.items():
            for node in ast.walk(tree):
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in
                         getattr(node, "bases", [])}
                if isinstance(node, ast.ClassDef) and bases & known:
                    known.add(node.name)
                    found[node.name] = path.relative_to(SRC).as_posix()
    assert {name for name, where in found.items() if where != "errors.py"} == set()
    assert {"AppError", "UserError", "Interrupted", "WorkerFailed", "RunDirInUse"} <= set(found)


def test_exit_status_comes_with_the_class() -> None:
    stop = Interrupted("stopped by signal SIGTERM at step 3", signal.SIGTERM)
    assert (stop.exit_code, stop.signum, isinstance(stop, AppError)) == (143, signal.SIGTERM,
                                                                         True)
    assert (AppError().exit_code, UserError().exit_code, WorkerFailed().exit_code) == (1, 2, 1)
    assert issubclass(errors.RunDirInUse, UserError)


def test_the_paths_errors_were_imported_from_still_work() -> None:
    from app.config import UserError as from_config
    from app.launch.run_lock import RunDirInUse
    from app.training.data_errors import DataItemError

    assert (from_config, RunDirInUse, DataItemError) == (
        UserError, errors.RunDirInUse, errors.DataItemError)


def test_one_line_keeps_the_type_and_the_first_line() -> None:
    assert one_line(WorkerFailed("rank 1 failed: boom\n  more")) == (
        "WorkerFailed: rank 1 failed: boom")
    assert one_line(KeyboardInterrupt()) == "KeyboardInterrupt"
