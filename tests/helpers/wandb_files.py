"""What a Weights & Biases offline run wrote (`RUN_DIR/wandb/offline-run-*/run-ID.wandb`):
the run id, the config and the logged history, read back from its record log (LevelDB's log
format: 32 KiB blocks of records with a 7-byte header; each record a protobuf `Record`)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK, HEADER = 32768, 7  # (the file begins with a 7-byte header too: ":W&B", magic, version)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _chunks(path: Path) -> Iterator[bytes]:
    raw, at, pending = path.read_bytes(), HEADER, b""
    while at + HEADER <= len(raw):
        left = BLOCK - at % BLOCK
        if left < HEADER:  # (a block's tail too short for a header is padding)
            at += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[at:at + HEADER])
        at += HEADER
        data, at = raw[at:at + length], at + length
        if kind == FULL:
            yield data
        elif kind == FIRST:
            pending = data
        elif kind == MIDDLE:
            pending += data
        elif kind == LAST:
            yield pending + data
        else:
            return  # zeros: the end of what was written


def offline_runs(run_dir: Path) -> list[dict]:
    """Each offline run under the run directory, in the order they ran: its id, its config
    and its history rows ({"_step": ..., "train/loss": ...})."""
    from wandb.proto import wandb_internal_pb2 as pb

    found = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        (log,) = folder.glob("run-*.wandb")
        run = {"id": None, "config": {}, "history": []}
        for data in _chunks(log):
            record = pb.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"] = record.run.run_id
                run["config"] |= {u.key: json.loads(u.value_json)
                                  for u in record.run.config.update}
            elif kind == "config":
                run["config"] |= {u.key: json.loads(u.value_json) for u in record.config.update}
            elif kind == "history":
                run["history"].append({(i.key or "/".join(i.nested_key)): json.loads(
                    i.value_json) for i in record.history.item})
        found.append(run)
    return found
