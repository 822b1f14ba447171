"""A sharded checkpoint's index (DCP's `.metadata`, a pickle) is read by app's own reader
before DCP unpickles it: a crafted index runs nothing, and the pickles some Python releases
write still read."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from app.checkpoint import checksums, sharded
from app.ckpt import convert
from app.errors import UserError
from conftest import TINY, run_job
from test_fsdp import FSDP, STEPS


def test_a_crafted_index_is_refused_before_it_runs_anything(tmp_path) -> None:
    """DCP reads its index with plain pickle: app reads it first with a reader that builds
    only an index's classes (a checkpoint file is read with weights_only alike)."""
    import pickle

    from app.checkpoint import layout

    run = run_job(tmp_path / "run", *STEPS, "trainer.max_steps=5", *FSDP).run_dir
    evil = tmp_path / "evil.pt"
    shutil.copytree(run / "checkpoints" / "last.pt", evil)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (evil / ".metadata").write_bytes(pickle.dumps(Payload()))
    # (Whoever crafts an index can write its checksum too: the reader refuses it still.)
    checksums.write_checksums(evil, [".metadata", "meta.pt"], checksums.CHECKSUMS)
    with pytest.raises(UserError, match=r"refused: its index \(.metadata\) names "
                                        r"(posix|os)\.system.*nothing was run"):
        layout.load(evil)
    with pytest.raises(UserError, match="refused"):
        convert(evil, tmp_path / "out.pt")
    with pytest.raises(UserError, match="refused"):
        run_job(tmp_path / "eval", *TINY, "trainer=eval", f"ckpt={evil}")
    assert not marker.exists()


def test_an_index_whose_enums_python_pickled_by_name_reads(tmp_path) -> None:
    """Some Python releases (3.11.2, Debian 12's) pickle an Enum member as getattr(its class,
    its name); DCP's index holds one (a tensor's memory format). The index reader builds such
    a member, and only that: another getattr is still refused."""
    import enum
    import io
    import pathlib
    import pickle

    from torch.distributed.checkpoint.metadata import (
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    class Other:
        pass

    class ByName(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, enum.Enum):
                return getattr, (type(obj), obj.name)
            if obj is Other:  # (a getattr of a class the reader builds, but no enum's)
                return getattr, (pathlib.PosixPath, "cwd")
            return NotImplemented

    def index(value, folder: Path) -> Path:
        folder.mkdir()
        data = io.BytesIO()
        ByName(data, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
        assert b"getattr" in data.getvalue()  # (the pickle is the one under test)
        (folder / ".metadata").write_bytes(data.getvalue())
        return folder

    meta = Metadata({"w": TensorStorageMetadata(
        TensorProperties(dtype=torch.float32, memory_format=torch.channels_last),
        torch.Size([2, 3]), [])})
    read = sharded.read_index(index(meta, tmp_path / "by-name.pt"))
    assert read.state_dict_metadata["w"].properties.memory_format == torch.channels_last
    with pytest.raises(UserError, match=r"names builtins\.getattr.*nothing was run"):
        sharded.read_index(index([Other], tmp_path / "other.pt"))
