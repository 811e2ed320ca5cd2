"""A command run until its log has a few steps, then sent a signal (tests of stopping)."""
from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def signal_after_steps(cmd: list[str], log: Path, sig: int, steps: int = 5,
                       timeout: float = 120,
                       to: Callable[[int], list[int]] | None = None) -> tuple[int, str, str]:
    """Start `cmd`, wait until `log` has `steps` lines, send `sig` (to the processes
    `to(pid)` names; default: the command's); (exit code, out, err)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout
        while not (log.exists() and len(log.read_text().splitlines()) >= steps):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.1)
        pids = to(p.pid) if to is not None else [p.pid]
        assert pids, "no process to signal"  # (else the command runs on to the timeout)
        for pid in pids:
            os.kill(pid, sig)
        out, err = p.communicate(timeout=timeout)
    finally:
        p.kill()
    return p.returncode, out, err


def mpi_ranks(pid: int) -> list[int]:
    """The ranks `mpiexec` (`pid`) started: hydra's proxy's children."""
    return [rank for proxy in _children(pid) for rank in _children(proxy)]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]
