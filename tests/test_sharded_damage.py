"""A damaged sharded checkpoint is recognised as damaged: every shard file, the index and
meta.pt have a checksum written with them (`checksums*.json`), compared when any reader reads
the checkpoint. `resume=auto` skips a damaged one in one line naming the file and resumes the
newest intact one; eval, export and `app.ckpt convert` refuse it in one line. A symbolic link
loop given as a checkpoint is named as such.

One FSDP run of 2 ranks (checkpoints at steps 5 and 10) is shared by the tests; each damages
its own copy of the checkpoints."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from app.checkpoint import sharded
from app.ckpt import main as ckpt_main
from app.errors import UserError
from conftest import TINY, run_app, run_job
from test_fsdp import FSDP, STEPS, _equal, _full, _log

pytestmark = pytest.mark.xdist_group("sharded_damage")  # (one worker makes the shared run)

RUN = [*STEPS, "devices=2", *FSDP, "trainer.max_steps=10"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run's checkpoints directory: step-00000005.pt, step-00000010.pt (last.pt)."""
    run = tmp_path_factory.mktemp("trained")
    run_job(run, *RUN)
    return run / "checkpoints"


def _copy(trained: Path, run_dir: Path) -> Path:
    """The shared run's checkpoints as a new run directory's (links kept as links)."""
    shutil.copytree(trained, run_dir / "checkpoints", symlinks=True)
    return run_dir / "checkpoints"


def _flip(file: Path, offset: int, length: int) -> None:
    """Invert `length` bytes of `file` from `offset`: the file keeps its size."""
    data = bytearray(file.read_bytes())
    data[offset:offset + length] = bytes(b ^ 0xFF for b in data[offset:offset + length])
    file.write_bytes(bytes(data))


def test_every_file_of_a_sharded_checkpoint_has_a_checksum(trained) -> None:
    import json

    step = trained / "step-00000010.pt"
    sums = {}
    for file in step.glob("checksums*.json"):
        sums.update(json.loads(file.read_text()))
    assert sorted(sums) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert all(value.startswith("crc32:") for value in sums.values())


@pytest.mark.parametrize("damage", ["header", "payload", "index"])
def test_resume_skips_a_damaged_sharded_checkpoint_for_the_intact_one(trained, tmp_path,
                                                                      damage) -> None:
    """Bytes flipped in the first 4 KB of rank 0's shard (its header), in the middle of rank
    1's (tensor data), in the middle of the index: before checksums, the first failed as "does
    not fit this run's model" and the second loaded without a word. Now the damaged step 10
    is never loaded: step 5 is resumed, and the run ends with step 10's intact weights."""
    checkpoints = _copy(trained, tmp_path / "run")
    step = checkpoints / "step-00000010.pt"
    name = {"header": "__0_0.distcp", "payload": "__1_0.distcp", "index": ".metadata"}[damage]
    size = (step / name).stat().st_size
    _flip(step / name, *((0, min(4096, size)) if damage == "header" else (size // 2, 64)))
    text = _log(run_job(tmp_path / "run", *RUN))
    skipped = [line for line in text.splitlines() if "skipping" in line]
    assert len(skipped) == 1, skipped  # (last.pt and step-00000010.pt: one checkpoint)
    assert f"skipping {checkpoints / 'last.pt'}: damaged: {name} does not match" in skipped[0]
    assert f"resumed from {checkpoints / 'step-00000005.pt'} at step 5" in text
    assert _equal(_full(checkpoints / "last.pt")["model"],
                  _full(trained / "step-00000010.pt")["model"])


def test_eval_export_and_convert_refuse_a_damaged_checkpoint_in_one_line(trained, tmp_path,
                                                                         capsys) -> None:
    damaged = tmp_path / "damaged.pt"
    shutil.copytree(trained / "step-00000010.pt", damaged)
    _flip(damaged / "__1_0.distcp", (damaged / "__1_0.distcp").stat().st_size // 2, 64)
    said = "damaged: __1_0.distcp does not match the checksum written with it"
    with pytest.raises(UserError, match=said) as refused:
        run_job(tmp_path / "export", *TINY, "trainer=export", f"ckpt={damaged}")
    assert "\n" not in str(refused.value)
    assert ckpt_main(["convert", str(damaged), str(tmp_path / "one.pt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err
    assert not (tmp_path / "one.pt").exists()
    result = run_app(tmp_path / "eval", *TINY, "trainer=eval", f"ckpt={damaged}")
    assert result.returncode == 2 and said in result.output
    assert result.output.strip().count("\n") == 0, result.output


def test_a_checkpoint_without_checksums_still_loads(trained, tmp_path) -> None:
    """One written before checkpoints had checksums: read as before, without a word."""
    checkpoints = _copy(trained, tmp_path / "run")
    for file in checkpoints.glob("*/checksums*.json"):
        file.unlink()
    text = _log(run_job(tmp_path / "run", *RUN, "trainer.max_steps=11"))
    assert f"resumed from {checkpoints / 'last.pt'} at step 10" in text
    assert "skipping" not in text and "checksum" not in text
    sharded.read_full(checkpoints / "step-00000005.pt")


def test_a_symbolic_link_loop_is_named_as_one(tmp_path, capsys) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    with pytest.raises(UserError, match=f"checkpoint {loop}: a symbolic link loop"):
        run_job(tmp_path / "eval", *TINY, "trainer=eval", f"ckpt={loop}")
    with pytest.raises(UserError, match=f"checkpoint {loop}: a symbolic link loop"):
        run_job(tmp_path / "resume", *TINY, f"resume={loop}")
    assert ckpt_main(["convert", str(loop), str(tmp_path / "out.pt")]) == 2
    assert "a symbolic link loop" in capsys.readouterr().err
