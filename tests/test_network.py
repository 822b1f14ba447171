"""Network hygiene: what a run listens on."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
from pathlib import Path

from conftest import REPO, TINY, still_alive, wait_for_rows, worker_pids


def _listening(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that one of `pids` holds."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            parts = line.split()
            if parts[3] != "0A" or parts[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = parts[1].rsplit(":", 1)
            raw = bytes.fromhex(address)
            # /proc shows each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((str(ipaddress.ip_address(raw)), int(port, 16)))
    return found


def _start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "app", f"hydra.run.dir={run_dir}", *TINY,
                             "trainer.max_epochs=400", *overrides], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait()


def test_a_one_machine_run_listens_on_the_loopback_only(tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "devices=2")
    try:
        wait_for_rows(run_dir, 5)
        workers = worker_pids(run_dir)
        sockets = _listening([proc.pid, *workers])
    finally:
        _stop(proc)
    # The launcher died by SIGKILL: its workers (children of the forkserver) must follow it.
    assert len(workers) == 2 and not still_alive(workers)
    assert sockets, "no listening socket found: the rendezvous store should be one"
    assert all(ipaddress.ip_address(a).is_loopback for a, _ in sockets), sockets


def test_a_multi_machine_run_listens_where_dist_url_says(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"dist_url=tcp://127.0.0.1:{port}"
    machines = [_start(tmp_path / "run", "devices=1", "nodes=2", f"machine_rank={r}", url)
                for r in (0, 1)]
    try:
        wait_for_rows(tmp_path / "run", 5)
        workers = worker_pids(tmp_path / "run")
        sockets = _listening([*(p.pid for p in machines), *workers])
    finally:
        _stop(*machines)
    assert len(workers) == 2 and not still_alive(workers)
    log = (tmp_path / "run" / "train.log").read_text()  # (before, 45 s of silence)
    assert f"waiting for the other 1 machine(s) to join at tcp://127.0.0.1:{port}" in log, log
    assert "every machine has joined: 2 ranks" in log, log
    assert ("127.0.0.1", port) in sockets, sockets
    assert all(ipaddress.ip_address(a).is_loopback for a, _ in sockets), sockets
