"""Run files that a full disk must not leave half-written. A failed write (a full disk, a
quota, a read-only mount) removes what it had begun and becomes one line naming the file."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from app.errors import WriteFailed


def write_failed(path: Path, e: OSError) -> WriteFailed:
    reason = e.strerror or str(e) or type(e).__name__
    return WriteFailed(f"{path} could not be written ({reason}); its previous content is "
                       f"intact: free some space (or fix the mount) and run again")


def write_text_atomically(path: Path, text: str) -> None:
    write_bytes_atomically(path, text.encode())


def write_bytes_atomically(path: Path, data: bytes) -> None:
    """Write `data` aside and rename it into place: readers see the old file or the new one."""
    with written_aside(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        # On disk before the rename: after a power loss or a node crash the name holds
        # the old file or the new one, never an empty one (these files are small and rare).
        os.fsync(f.fileno())
    with suppress(OSError):  # (best effort: some file systems refuse a folder's fsync)
        sync_dir(path.parent)


def sync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def written_aside(path: Path, keep_suffix: bool = False) -> Iterator[Path]:
    """A temporary name beside `path` for a writer that takes a file name (torch's savers),
    renamed to `path` once the block has written it. `keep_suffix`: the temporary name ends as
    `path` does (torch.export's saver warns about a name without `.pt2`)."""
    # This process's own name: the launchers of a nodes=N run on a shared directory write the
    # same files and must not rename each other's.
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}" if keep_suffix else
                         f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise write_failed(path, e) from e
        raise


@contextmanager
def appending(path: Path) -> Iterator:
    """Append to `path`; if the append fails, cut the file back to its previous end, so a
    failed append leaves no partial line."""
    size = path.stat().st_size if path.exists() else 0
    try:
        with open(path, "a", newline="") as f:
            yield f
    except OSError as e:
        with suppress(OSError):  # (nothing more to do: a reader drops a partial last line)
            os.truncate(path, size)
        raise write_failed(path, e) from e
