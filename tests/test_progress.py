"""The progress bar in a terminal: log records on lines of their own, progress on any terminal.

The terminal is the subject, so the run is a real `python -m app` on a pseudo-terminal whose
size the test sets, and the test reads the raw bytes a terminal would get.
"""

from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import sys
import termios

from conftest import REPO

SHORT = ["model.channels=[8,16]", "trainer.max_steps=3", "trainer.log_every_n_steps=1"]
RECORD = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\]\[")  # a log record's start


def run_on_terminal(run_dir, rows: int, cols: int, *overrides: str) -> str:
    """Everything `python -m app` writes to a terminal of rows x cols, as the terminal gets it."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", f"hydra.run.dir={run_dir}", *SHORT, *overrides],
        cwd=REPO, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every process holding the terminal has closed it
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=300) == 0, out.decode(errors="replace")[-3000:]
    return out.decode(errors="replace")


def test_log_records_start_their_own_line_under_a_progress_bar(tmp_path) -> None:
    out = run_on_terminal(tmp_path / "run", 24, 100)
    assert "3/3 [" in out  # the bar was drawn ...
    starts = [m.start() for m in RECORD.finditer(out)]
    assert any("val loss" in out[s:s + 120] for s in starts)  # ... and records came during it
    glued = [out[max(0, s - 60):s + 60] for s in starts if s > 0 and out[s - 1] not in "\r\n"]
    assert not glued, f"log records written onto the bar's line: {glued}"


def test_a_terminal_without_a_size_still_shows_progress(tmp_path) -> None:
    # 0 x 0: what a terminal that reports no size gives (`stty rows 0 cols 0` makes one).
    out = run_on_terminal(tmp_path / "run", 0, 0)
    assert "3/3 [" in out, out[-2000:]
