"""`python -m app.runs ls|show|diff` on a real 2x2 sweep made by the CLI, one job of which
fails; in-process (`main(argv)`), the printed lines are the subject."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from app import runs
from conftest import Sweep


@pytest.fixture(scope="module")
def outputs(faulty_sweep: Sweep) -> Path:
    """The outputs folder of the session's faulty sweep (`multirun/sweep`): one, shared by the
    pytest workers and the files that read it."""
    assert faulty_sweep.returncode == 1, faulty_sweep.output[-3000:]  # (one job failed)
    return faulty_sweep.folder.parent


def _run(capsys, *argv: str) -> tuple[int, list[str]]:
    code = runs.main(list(argv))
    captured = capsys.readouterr()
    return code, (captured.out + captured.err).splitlines()


def test_ls_lists_every_job_with_its_status_and_metric(outputs, capsys) -> None:
    code, lines = _run(capsys, "ls", str(outputs))
    assert code == 0 and lines[-1] == "4 run(s)"
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert sorted(rows) == [f"multirun/sweep/{n}" for n in range(4)], lines
    assert " failed " in rows["multirun/sweep/0"] and "+model.fault_call=5" in \
        rows["multirun/sweep/0"]
    for n in (1, 2, 3):
        assert " completed  trainval  val/acc 0." in rows[f"multirun/sweep/{n}"], lines
        assert " 44 " in rows[f"multirun/sweep/{n}"]  # steps


def test_ls_filters_by_key_and_by_status(outputs, capsys) -> None:
    _, lines = _run(capsys, "ls", str(outputs), "+model.fault_rank=0")
    assert lines[-1] == "2 run(s)"
    _, lines = _run(capsys, "ls", str(outputs), "model.fault_rank=1", "model.fault_call=5")
    assert lines[-1] == "1 run(s)" and lines[1].startswith("multirun/sweep/2")
    _, lines = _run(capsys, "ls", str(outputs), "--status", "failed")
    assert lines[-1] == "1 run(s)" and lines[1].startswith("multirun/sweep/0")
    _, lines = _run(capsys, "ls", str(outputs), "model.channels=[8,16]")  # a list value
    assert lines[-1] == "4 run(s)"
    _, lines = _run(capsys, "ls", str(outputs), "optimizer.lr=0.5")
    assert lines == [f"no runs under {outputs} that match"]


def test_show_gives_overrides_differences_result_and_files(outputs, capsys) -> None:
    code, lines = _run(capsys, "show", str(outputs / "multirun" / "sweep" / "1"))
    assert code == 0
    assert "status: completed" in lines
    assert "  model.channels: [8, 16] (default: [32, 64])" in lines, lines
    assert "  trainer.max_epochs: 2 (default: 20)" in lines
    assert not any(line.startswith("  optimizer.") for line in lines)  # (a default)
    assert any(line.startswith("  checkpoints/best.pt  ") for line in lines)
    command = next(line for line in lines if line.startswith("command: "))
    assert command.startswith("command: python -m app -m ") and command.endswith(
        f"hydra.sweep.dir={outputs / 'multirun' / 'sweep'}"), command  # (the sweep's)
    code, lines = _run(capsys, "show", str(outputs / "multirun" / "sweep" / "0"))
    assert "status: failed (RuntimeError: injected fault)" in lines[1], lines


def test_diff_gives_the_keys_that_differ_and_the_metrics_side_by_side(outputs, capsys) -> None:
    sweep = outputs / "multirun" / "sweep"
    code, lines = _run(capsys, "diff", str(sweep / "3"), str(sweep / "0"))
    assert code == 0
    keys = [line.split()[0] for line in lines[3:] if line and line.split()[0].startswith(
        "model.")]
    assert keys == ["model.fault_call", "model.fault_rank"], lines
    assert any(line.split() == ["status", "completed", "failed"] for line in lines), lines
    assert any(line.split()[:1] == ["44"] and line.split()[3:] == ["-", "-"]
               for line in lines), lines  # B has no validation at step 44


def _json(capsys, *argv: str) -> tuple[int, Any, str]:
    """The exit status, the one JSON document on stdout, and stderr of `main([*argv, --json])`."""
    code = runs.main([*argv, "--json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def test_ls_json_gives_each_run_s_fields(outputs, capsys) -> None:
    code, listed, _ = _json(capsys, "ls", str(outputs))
    assert code == 0
    assert [Path(r["run"]).relative_to(outputs).as_posix() for r in listed] == \
        [f"multirun/sweep/{n}" for n in range(4)], listed
    failed, done = listed[0], listed[1]
    assert (failed["status"], failed["error"]) == ("failed", "RuntimeError: injected fault")
    assert "+model.fault_call=5" in failed["overrides"]
    assert (failed["best"], failed["steps"]) == (None, None)  # (unknown: null)
    assert (done["status"], done["error"], done["steps"], done["attempts"]) == \
        ("completed", None, 44, 1)
    assert (done["mode"], done["monitor"], done["monitor_mode"]) == ("trainval", "val/acc", "max")
    assert isinstance(done["best"], float) and 0 < done["best"] <= 1 and done["wall_s"] > 0
    assert datetime.fromisoformat(done["started"]).tzinfo is not None
    _, only, _ = _json(capsys, "ls", str(outputs), "--status", "failed")
    assert only == [failed]
    # Nothing matches: an empty list; why, on stderr (stdout holds the document alone).
    code, none, said = _json(capsys, "ls", str(outputs), "optimzer.lr=0.003")
    assert (code, none) == (0, []) and "optimzer.lr: no run here has this key" in said


def test_show_and_diff_json_give_what_the_text_says(outputs, capsys) -> None:
    sweep = outputs / "multirun" / "sweep"
    _, listed, _ = _json(capsys, "ls", str(outputs))
    code, shown, _ = _json(capsys, "show", str(sweep / "1"))
    assert code == 0 and {k: shown[k] for k in listed[1]} == listed[1]  # ls's fields, and more
    assert {"key": "model.channels", "value": [8, 16], "default": [32, 64]} in \
        shown["differs_from_defaults"]
    assert {"key": "model.fault", "value": "raise", "default": None} in \
        shown["differs_from_defaults"]  # (a key the defaults lack: null)
    assert shown["result"]["status"] == "completed" and shown["unreadable"] == {}
    assert shown["choices"]["model"] == "cnn"
    assert shown["command"].startswith("python -m app -m ")
    files = {f["path"]: f["bytes"] for f in shown["files"]}
    assert files["metrics.csv"] == (sweep / "1" / "metrics.csv").stat().st_size
    code, diff, _ = _json(capsys, "diff", str(sweep / "3"), str(sweep / "0"))
    assert code == 0 and (diff["a"], diff["b"]) == (listed[3], listed[0])
    assert [d for d in diff["differences"] if d["key"].startswith("model.")] == [
        {"key": "model.fault_call", "a": 100000, "b": 5},
        {"key": "model.fault_rank", "a": 1, "b": 0}]
    at_44 = next(v for v in diff["validations"] if v["step"] == 44)
    assert 0 < at_44["a_val_acc"] <= 1 and at_44["a_val_loss"] > 0
    assert (at_44["b_val_loss"], at_44["b_val_acc"]) == (None, None)  # B failed at step 4


@pytest.mark.parametrize("argv, words", [
    (["ls", "/nonexistent"], "/nonexistent: no such folder"),
    (["show", "/tmp"], "/tmp: not a run directory"),
    (["diff", "/tmp", "/tmp"], "/tmp: not a run directory"),
])
def test_what_is_not_there_is_one_line_and_exit_2(capsys, argv, words) -> None:
    code, lines = _run(capsys, *argv)
    assert code == 2 and any(words in line for line in lines), lines


@pytest.mark.parametrize("command", [["runs", "show"], ["status"], ["report"], ["replay"]])
@pytest.mark.parametrize("where,words", [("/nonexistent", "/nonexistent: no such folder"),
                                         ("/etc/hostname", "/etc/hostname: not a folder"),
                                         ("", "an empty path: give the folder")])
def test_the_reading_commands_name_a_missing_folder_as_missing(capsys, command, where,
                                                              words) -> None:
    # (Not "neither a sweep nor a run directory", as for a folder of the wrong kind.)
    from app import replay, report, status

    main = {"runs": runs.main, "status": status.main, "report": report.main,
            "replay": replay.main}[command[0]]
    with pytest.raises(SystemExit) as exited:
        main([*command[1:], where])
    assert exited.value.code == 2
    assert words in capsys.readouterr().err


def test_a_filter_that_is_not_key_value_is_refused(outputs, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        runs.main(["ls", str(outputs), "optimizer.lr"])
    assert exited.value.code == 2
    assert "a filter is KEY=VALUE" in capsys.readouterr().err


def test_filters_by_group_option_and_number_and_a_misspelt_key_is_named(outputs, capsys) -> None:
    _, lines = _run(capsys, "ls", str(outputs), "model=cnn")  # (the group's option)
    assert lines[-1] == "4 run(s)"
    _, lines = _run(capsys, "ls", str(outputs), "optimizer.lr=3e-3")  # (0.003: a number)
    assert lines[-1] == "4 run(s)", lines
    _, lines = _run(capsys, "ls", str(outputs), "optimzer.lr=0.003", "--status", "bogus")
    assert lines == [f"no runs under {outputs} that match",
                     "  optimzer.lr: no run here has this key",
                     "  --status bogus: the runs here are completed, failed"]


def test_a_broken_run_folder_is_named_and_hides_no_other(tmp_path, capsys) -> None:
    def run(name: str, config: str, result: str | None = None) -> Path:
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / ".hydra" / "config.yaml").write_text(config)
        if result is not None:
            (tmp_path / name / "result.json").write_text(result)
        return tmp_path / name

    run("good", "trainer:\n  mode: trainval\n", '{"status": "completed", "wall_s": 1.0}')
    run("cut", "trainer:\n  mode: eval\n", "{not json")  # result.json cut short
    run("bad", ": : [\n")  # not YAML
    run("list", "- 1\n")  # YAML, not a config
    code, lines = _run(capsys, "ls", str(tmp_path))
    assert code == 0
    listed = {line.split()[0]: line.split()[1] for line in lines
              if line.split() and line.split()[0] in ("good", "cut")}
    assert listed == {"good": "completed", "cut": "unreadable"}, lines
    for name in ("bad", "list"):
        assert any(f"{name}: skipped: its .hydra/config.yaml does not load" in line
                   for line in lines), lines
        code, said = _run(capsys, "show", str(tmp_path / name))
        assert code == 2 and len(said) == 1 and "does not load as a config" in said[0], said
    code, said = _run(capsys, "show", str(tmp_path / "cut"))
    assert code == 0 and any(line.startswith("result.json: not valid JSON") for line in said)


def test_show_gives_a_run_s_command_with_its_search_path(tmp_path, capsys) -> None:
    """What `hydra.yaml` records of `python -m app 'hydra.searchpath=[file://conf]' model=mine`
    (a run of your own model): the command that runs it again has the search path too."""
    run = tmp_path / "outputs" / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("trainer:\n  mode: trainval\n")
    (run / ".hydra" / "overrides.yaml").write_text("- model=mine\n- optimizer.lr=0.01\n")
    (run / ".hydra" / "hydra.yaml").write_text(
        "hydra:\n  mode: RUN\n  overrides:\n    hydra:\n    - hydra.searchpath=[file://conf]\n"
        f"    - hydra.run.dir={run}\n    - hydra.mode=RUN\n    task:\n    - model=mine\n"
        "    - optimizer.lr=0.01\n")
    assert runs.rerun_command(run) == ("python -m app model=mine optimizer.lr=0.01 "
                                       f"'hydra.searchpath=[file://conf]' hydra.run.dir={run}")


def test_show_lists_the_compile_cache_as_one_folder(outputs, tmp_path, capsys) -> None:
    """compile=true keeps torch.compile's cache in the run (dozens of small files)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(outputs / "multirun" / "sweep" / "1", run)
    for i in range(30):
        (run / "compile_cache" / "inductor" / f"{i:02d}").mkdir(parents=True)
        (run / "compile_cache" / "inductor" / f"{i:02d}" / "kernel.so").write_bytes(b"x" * 100)
    code, lines = _run(capsys, "show", str(run))
    assert code == 0 and "  compile_cache/  3.00kB" in lines, lines
    assert not any("kernel.so" in line for line in lines)
