"""Every expected failure is a class of app.errors; its exit status and one-line record."""

from __future__ import annotations

import ast
import signal
from pathlib import Path

import pytest

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


def test_the_app_imports_its_errors_from_app_errors_only() -> None:
    # (app.config still re-exports UserError and AppError for users' code that imports them)
    names = {n for n in dir(errors) if isinstance(getattr(errors, n), type)
             and issubclass(getattr(errors, n), BaseException)}
    elsewhere = []
    for path in [*SRC.rglob("*.py"), *(SRC.parent / "hydra_plugins").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("app.") \
                    and node.module != "app.errors":
                elsewhere += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                              if a.name in names]
    assert elsewhere == []


def test_exit_status_comes_with_the_class() -> None:
    stop = Interrupted("stopped by signal SIGTERM at step 3", signal.SIGTERM)
    assert (stop.exit_code, stop.signum, isinstance(stop, AppError)) == (143, signal.SIGTERM,
                                                                         True)
    assert (AppError().exit_code, UserError().exit_code, WorkerFailed().exit_code) == (1, 2, 1)
    # A worker's failure takes the status of its cause only when that was bad input (2).
    assert [WorkerFailed("rank 1 failed", code).exit_code for code in (2, 1, 143)] == [2, 1, 1]
    assert issubclass(errors.RunDirInUse, UserError)


def test_the_paths_errors_were_imported_from_still_work() -> None:
    from app.config import UserError as from_config
    from app.rundir.lock import RunDirInUse
    from app.training.data_errors import DataItemError

    assert (from_config, RunDirInUse, DataItemError) == (
        UserError, errors.RunDirInUse, errors.DataItemError)


def test_one_line_keeps_the_type_and_the_first_line() -> None:
    assert one_line(WorkerFailed("rank 1 failed: boom\n  more")) == (
        "WorkerFailed: rank 1 failed: boom")
    assert one_line(KeyboardInterrupt()) == "KeyboardInterrupt"


def test_ctrl_c_before_the_loop_ends_in_one_line_with_130(tmp_path, monkeypatch, capsys) -> None:
    import sys

    import app.__main__ as entry

    def interrupted(*args):  # Ctrl-C while torch is imported, before any worker or loop
        raise KeyboardInterrupt

    monkeypatch.setattr(entry, "launch", interrupted)
    monkeypatch.setattr(sys, "argv", ["app", "debug=fast", f"hydra.run.dir={tmp_path}",
                                      "hydra/job_logging=none", "hydra/hydra_logging=none"])
    with pytest.raises(SystemExit) as stop:
        entry.main()
    assert stop.value.code == 130
    assert '"status": "interrupted"' in (tmp_path / "result.json").read_text()


def _entry_raising(error: BaseException, tmp_path, monkeypatch):
    """`python -m app` in this process, its launch() raising `error`."""
    import sys

    import app.__main__ as entry

    def fails(*args):
        raise error

    monkeypatch.setattr(entry, "launch", fails)
    monkeypatch.setattr(sys, "argv", ["app", "debug=fast", f"hydra.run.dir={tmp_path}",
                                      "hydra/job_logging=none", "hydra/hydra_logging=none"])
    return entry


@pytest.mark.parametrize("error", [UserError, WorkerFailed, errors.WriteFailed,
                                   errors.DataItemError, errors.ExportMismatch, AppError])
def test_an_app_error_from_a_run_is_its_line_and_its_exit_status(error, tmp_path, monkeypatch,
                                                                  capsys, caplog) -> None:
    # What the tests that raise these errors in-process (run_job) rely on for the CLI.
    # (Hydra's logging setup is left out: it would outlive this test.)
    entry = _entry_raising(error("what went wrong, and the key to change"), tmp_path,
                           monkeypatch)
    with pytest.raises(SystemExit) as stop:
        entry.main()
    assert stop.value.code == error.exit_code
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        "what went wrong, and the key to change"]
    output = capsys.readouterr()
    assert not any(r.exc_info for r in caplog.records)  # no traceback logged ...
    assert "Traceback" not in output.out + output.err  # ... nor printed
    assert '"status": "failed"' in (tmp_path / "result.json").read_text()


def test_a_failed_rank_s_line_points_to_a_traceback_only_where_there_is_one(tmp_path) -> None:
    """An AppError is logged as its line: "(traceback in ...)" sent the reader to a log
    without one."""
    from app.launch import ends

    (tmp_path / "logs").mkdir()
    lines = []
    for rank, error in enumerate([AppError("the training loss was nan"), RuntimeError("boom")]):
        ends.write(tmp_path, rank, error)
        lines.append(ends.failed_line(tmp_path, ends.read(tmp_path, 0)[rank]))
    log = tmp_path / "logs"
    assert lines == [
        f"rank 0 failed: AppError: the training loss was nan (its log: {log}/rank0.log)",
        f"rank 1 failed: RuntimeError: boom (traceback in {log}/rank1.log)"]
