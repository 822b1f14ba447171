"""A full disk at a run file (result.json, metrics.csv): one line, no partial file, the previous
content intact. In-process with the write made to fail, and on a real full file system (a
small tmpfs) where this machine lets the test mount one. At a log file (train.log, a rank's
log): the run stops at a step with a checkpoint, and says so in one line."""

from __future__ import annotations

import builtins
import errno
import logging
import re
import resource
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from app import files
from app.errors import WriteFailed
from app.reporting.loggers import CSVLogger
from app.reporting.results import write_result
from app.training.build import build_data, build_model
from conftest import REPO, TINY, load_state, make_config, run_app

ENOSPC = OSError(errno.ENOSPC, "No space left on device")


class _FillsUp:
    """A file whose writes stop half-way with ENOSPC, as on a disk that fills up."""

    def __init__(self, f) -> None:
        self.f = f

    def write(self, text: str) -> int:
        self.f.write(text[: len(text) // 2])
        self.f.flush()
        raise ENOSPC

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


@pytest.fixture
def full_disk(monkeypatch):
    """Every file that app.files opens for writing fills the disk half-way through a write."""
    def fake_open(path, mode="r", *args, **kwargs):
        return _FillsUp(builtins.open(path, mode, *args, **kwargs))

    monkeypatch.setattr(files, "open", fake_open, raising=False)


def _one_line(error: WriteFailed, path) -> None:
    assert str(path) in str(error) and "No space left on device" in str(error)
    assert "\n" not in str(error)


def test_a_full_disk_at_result_json_is_one_line_and_leaves_no_partial_file(
        tmp_path, full_disk, caplog) -> None:
    (tmp_path / "result.json").write_text("previous\n")
    with pytest.raises(WriteFailed) as error:
        write_result(tmp_path, "completed", 1.0)
    _one_line(error.value, tmp_path / "result.json")
    assert (tmp_path / "result.json").read_text() == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]  # no .tmp
    # A run that failed already: its own error is reported, this one is a warning.
    with caplog.at_level(logging.WARNING):
        write_result(tmp_path, "failed", 1.0, "AppError: the real cause", raise_errors=False)
    assert "result.json could not be written" in caplog.text


def test_a_full_disk_at_a_metrics_row_is_one_line_and_leaves_no_partial_row(
        tmp_path, monkeypatch) -> None:
    logger = CSVLogger(tmp_path / "metrics.csv")
    logger.log(1, 0, "train", {"loss": 2.5})
    before = (tmp_path / "metrics.csv").read_text()
    monkeypatch.setattr(files, "open", lambda *a, **k: _FillsUp(builtins.open(*a, **k)),
                        raising=False)
    with pytest.raises(WriteFailed) as error:
        logger.log(2, 0, "train", {"loss": 2.4})  # an appended row
    _one_line(error.value, tmp_path / "metrics.csv")
    with pytest.raises(WriteFailed):
        logger.log(2, 0, "train", {"loss": 2.4, "lr": 0.1})  # a new column: a rewrite
    assert (tmp_path / "metrics.csv").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv"]


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs."""
    yield from mounted_tmpfs(tmp_path / "tmpfs", "size=1m")


def mounted_tmpfs(mount: Path, options: str):
    """A tmpfs mounted with `options` at `mount`. As root it is mounted there; as another user,
    in a mount namespace of its own (`unshare --user --map-root-user --mount`), kept by a
    process of that namespace through whose /proc/PID/root the test reaches it. Where neither
    can be done, a skip saying why (the in-process tests above cover the same logic)."""
    mount.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", options, "tmpfs"]
    done = subprocess.run([*command, str(mount)], capture_output=True, text=True)
    if done.returncode == 0:
        yield mount
        subprocess.run(["umount", str(mount)], check=True)
        return
    why = done.stderr.strip() or f"exit {done.returncode}"
    try:  # the process mounts, says so, then waits for its stdin to close
        keeper = subprocess.Popen(
            ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
             f'{" ".join(command)} "$0" && echo mounted && exec cat >/dev/null', str(mount)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except FileNotFoundError as e:
        pytest.skip(f"cannot mount a tmpfs here ({why}; {e}): the real file system is not "
                    f"tried")
    try:
        if keeper.stdout.readline().strip() != "mounted":
            keeper.stdin.close()
            pytest.skip(f"cannot mount a tmpfs here ({why}; in a user namespace: "
                        f"{keeper.stderr.read().strip() or keeper.wait()}): the real file "
                        f"system is not tried")
        yield Path(f"/proc/{keeper.pid}/root") / mount.relative_to("/")
    finally:
        if not keeper.stdin.closed:
            keeper.stdin.close()  # the namespace, and its tmpfs, end with the process
        keeper.wait(timeout=30)


def fill(directory) -> None:
    with open(directory / "filler", "wb", buffering=0) as f:
        with pytest.raises(OSError) as full:
            while True:
                f.write(b"\0" * 4096)
    assert full.value.errno == errno.ENOSPC


def test_a_really_full_disk_at_run_files_is_one_line_and_leaves_no_partial_file(
        tiny_tmpfs) -> None:
    metrics = {f"metric_{i:04d}": 1 / 3 for i in range(600)}  # a row longer than a page
    logger = CSVLogger(tiny_tmpfs / "metrics.csv")
    logger.log(1, 0, "val", metrics)
    write_result(tiny_tmpfs, "running", 1.0)
    before = {p.name: p.read_bytes() for p in tiny_tmpfs.iterdir()}
    fill(tiny_tmpfs)
    with pytest.raises(WriteFailed, match="metrics.csv could not be written"):
        logger.log(2, 0, "val", metrics)
    with pytest.raises(WriteFailed, match="result.json could not be written"):
        write_result(tiny_tmpfs, "completed", 2.0)
    after = {p.name: p.read_bytes() for p in tiny_tmpfs.iterdir() if p.name != "filler"}
    assert after == before


def test_a_result_json_that_cannot_be_written_ends_the_command_in_one_line(tmp_path) -> None:
    # The command's path end to end: the "completed" record fails, then the "failed" one.
    cfg = make_config(*TINY)
    ckpt = tmp_path / "weights.pt"
    torch.save({"model": build_model(cfg, build_data(cfg)).state_dict()}, ckpt)
    run_dir = tmp_path / f"run-{uuid.uuid4().hex[:6]}"
    (run_dir / "result.json").mkdir(parents=True)  # no file can be put in its place
    result = run_app(run_dir, *TINY, "trainer=eval", f"ckpt={ckpt}")
    assert result.returncode == 1, result.output[-3000:]
    assert "Traceback" not in result.output and "During handling" not in result.output
    assert "result.json could not be written" in result.output
    assert not list(run_dir.glob(".*.tmp"))


def test_a_full_disk_at_pictures_and_predictions_is_one_line_and_leaves_no_partial_file(
        tmp_path, full_disk) -> None:
    from app.reporting.curves import draw_curves
    from app.reporting.grids import save_grid

    (tmp_path / "metrics.csv").write_text("step,epoch,split,loss,lr,acc\n1,0,train,2.3,0.1,\n"
                                          "2,0,val,2.2,,0.3\n")
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "curves.png").write_bytes(b"previous")
    with pytest.raises(WriteFailed) as error:
        draw_curves(tmp_path)
    _one_line(error.value, tmp_path / "plots" / "curves.png")
    assert (tmp_path / "plots" / "curves.png").read_bytes() == b"previous"
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["curves.png"]
    with pytest.raises(WriteFailed) as error:
        save_grid(torch.zeros(2, 1, 8, 8), [1, 2], None, "grid", tmp_path / "predictions.png")
    _one_line(error.value, tmp_path / "predictions.png")
    assert not list(tmp_path.glob("*predictions.png*"))


def test_a_run_file_is_on_disk_before_its_name_points_to_it(tmp_path, monkeypatch) -> None:
    """After a power loss the name holds the old file or the new one, never an empty one: the
    new content is fsynced before the rename, and the rename (its folder) after it."""
    import os

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("replace", None))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_result(tmp_path, "completed", 1.0)
    assert events == [("fsync", False), ("replace", None), ("fsync", True)]
    assert (tmp_path / "result.json").is_file()


@pytest.mark.parametrize("background", [False, True])
def test_a_full_disk_at_a_sharded_checkpoint_is_one_line_and_frees_its_space(
        tiny_tmpfs, background) -> None:
    """DCP's error (a CheckpointException, which is not an Exception) becomes the one line a
    checkpoint file gets; the partial checkpoint directory is removed, so the space is free
    again and a smaller checkpoint fits."""
    from app.checkpoint import sharded
    from app.errors import AppError

    writer = sharded.ShardedWriter(background=background, is_main=True)
    big = {"model": {"w": torch.zeros(2**20)}}  # 4 MB on a 1 MB file system
    with pytest.raises(AppError, match=r"step-00000001.pt could not be written \(.*"
                                       r"(No space|disk full).*the checkpoints already on disk "
                                       r"are intact"):
        writer.save(big, {"loop": {"step": 1}}, tiny_tmpfs / "step-00000001.pt", lambda: None)
        writer.wait()
    assert list(tiny_tmpfs.iterdir()) == []
    writer.save({"model": {"w": torch.zeros(16)}}, {"loop": {"step": 2}},
                tiny_tmpfs / "step-00000002.pt", lambda: None)
    writer.wait()
    assert sharded.is_sharded(tiny_tmpfs / "step-00000002.pt")


# A log file on a full disk: /dev/full fails every write with ENOSPC, as a full disk does, for
# that file alone. Before: a traceback on stderr for every record (thousands), exit status 0.
needs_dev_full = pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")


def _logs_on_a_full_disk(run_dir: Path, *names: str) -> None:
    (run_dir / "logs").mkdir(parents=True)
    for name in names:
        (run_dir / name).symlink_to("/dev/full")


def _app(run_dir: Path, *overrides: str, file_size_limit: int | None = None):
    def limit() -> None:  # writing past it fails with EFBIG, as a full disk fails a write
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.run([sys.executable, "-m", "app", f"hydra.run.dir={run_dir}", *TINY,
                           *overrides], cwd=REPO, capture_output=True, text=True, timeout=300,
                          preexec_fn=limit if file_size_limit else None)


def _last_line(proc) -> str:
    assert proc.returncode == WriteFailed.exit_code == 1, proc.stdout[-3000:] + proc.stderr
    assert proc.stderr == "" and "Traceback" not in proc.stdout
    return proc.stdout.splitlines()[-1].split("[app][ERROR] - ", 1)[1]


@needs_dev_full
def test_a_full_disk_at_train_log_stops_the_run_with_a_checkpoint_in_one_line(
        tmp_path) -> None:
    run_dir = tmp_path / "run"
    _logs_on_a_full_disk(run_dir, "train.log")
    assert _last_line(_app(run_dir)) == (
        f"{run_dir}/train.log could not be written (No space left on device): the run stopped "
        f"at step 1 with a checkpoint; free some space (or fix the mount), then run the same "
        f"command again with hydra.run.dir={run_dir} to resume")
    assert load_state(run_dir / "checkpoints" / "last.pt")["loop"]["step"] == 1
    # A job without a training loop ends as it would have, then says so.
    proc = _app(run_dir, "trainer=eval", f"ckpt={run_dir}/checkpoints/last.pt")
    assert _last_line(proc) == (f"{run_dir}/train.log could not be written (No space left on "
                                f"device): the job completed, its log is incomplete")
    assert (run_dir / "eval.json").is_file()


@needs_dev_full
def test_a_full_disk_at_train_log_and_at_the_stop_checkpoint_is_one_line(tmp_path) -> None:
    run_dir = tmp_path / "run"
    _logs_on_a_full_disk(run_dir, "train.log")
    proc = _app(run_dir, file_size_limit=32 * 1024)  # (a checkpoint is 87 kB)
    assert _last_line(proc) == (
        f"{run_dir}/train.log could not be written (No space left on device); checkpoint "
        f"{run_dir}/checkpoints/step-00000001.pt could not be written (File too large); the "
        f"checkpoints already on disk are intact")
    assert list((run_dir / "checkpoints").iterdir()) == []


@needs_dev_full
def test_a_full_disk_at_a_rank_log_stops_every_rank_with_a_checkpoint_in_one_line(
        tmp_path) -> None:
    run_dir = tmp_path / "run"
    _logs_on_a_full_disk(run_dir, "logs/rank1.log")
    line = _last_line(_app(run_dir, "devices=2"))
    step = int(re.search(r"at step (\d+) ", line)[1])  # (rank 0 hears of it a step late)
    assert line.startswith(
        f"rank 1 failed: WriteFailed: {run_dir}/logs/rank1.log could not be written (No space "
        f"left on device): the run stopped at step {step} with a checkpoint; free some space "
        f"(or fix the mount), then run the same command again with hydra.run.dir={run_dir} "
        f"to resume")
    assert load_state(run_dir / "checkpoints" / "last.pt")["loop"]["step"] == step
