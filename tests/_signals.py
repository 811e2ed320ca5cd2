"""A command run until its log has a few steps, then sent a signal (tests of stopping)."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path


def signal_after_steps(cmd: list[str], log: Path, sig: int, steps: int = 5,
                       timeout: float = 120) -> tuple[int, str, str]:
    """Start `cmd`, wait until `log` has `steps` lines, send `sig`; (exit code, out, err)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout
        while not (log.exists() and len(log.read_text().splitlines()) >= steps):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.1)
        p.send_signal(sig)
        out, err = p.communicate(timeout=timeout)
    finally:
        p.kill()
    return p.returncode, out, err
