"""`python -m app.ckpt convert SRC DST`: a single-file checkpoint to a sharded one (a directory
that `distributed.strategy=fsdp` resumes on any number of ranks), or a sharded one to a
single file (one file to copy, or to resume under `ddp`). Everything the checkpoint holds is
kept; the tensors are read whole, in this one process."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from app.errors import UserError


def convert(source: Path, target: Path) -> str:
    """Write `source` in the other layout at `target`; returns what was done, in words."""
    from app.checkpoint import io, layout, sharded

    if target.exists() or target.is_symlink():
        raise UserError(f"{target} exists: give a new path (nothing is overwritten)")
    state = layout.load(source)  # checked; a sharded one read whole
    if sharded.is_sharded(source):
        io.save(state, target)
        return f"{source} (sharded) -> {target} (one file)"
    names, dropped = state.get("param_names"), ""
    if "optimizer" in state and names is not None:
        state["optimizer"] = sharded.optimizer_by_names(state["optimizer"], names)
    elif "optimizer" in state:
        # (A file written before checkpoints named their parameters: the optimizer's state
        # is numbered, and only the model that wrote it could name the numbers.)
        del state["optimizer"]
        dropped = ("; without the optimizer's state, which this older file does not name "
                   "(use it as ckpt=: weights for a new schedule, evaluation, export)")
    writer = sharded.ShardedWriter(background=False, is_main=True)
    writer.save(*sharded.split(state), target, then=lambda: None)
    return f"{source} (one file) -> {target} (sharded){dropped}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.ckpt", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    conv = commands.add_parser("convert", help="a checkpoint file <-> a sharded checkpoint")
    conv.add_argument("source", type=Path, help="a checkpoint: a .pt file or a sharded directory")
    conv.add_argument("target", type=Path, help="the new checkpoint's path (must not exist)")
    args = parser.parse_args(argv)
    try:
        print(convert(args.source, args.target))
    except UserError as e:
        print(f"python -m app.ckpt: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
