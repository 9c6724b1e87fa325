"""Ports and processes for tests that start real servers and clusters on this machine."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid` (never `ray stop`: that would stop other clusters too)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    os.kill(int(entry.name), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def wait_until(check, what: str, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, f"{what} did not come up in {timeout:.0f} s"
        time.sleep(1)
