"""Ports and processes for tests that start real servers and clusters on this machine."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

# The suite's Ray settings (tests/conftest.py exports them before any cluster starts; the two-node test gives them to
# its `ray start` processes). Each is about CPU on two shared cores, none about behaviour under test. Every Ray
# worker process costs ~1.5-2 CPU-s to start:
# - no prestarted workers: the raylet otherwise starts a new idle worker for every one an actor takes, and most are
#   never used (a Ray Train run of test_train.py's tiny job: 38 -> 32 CPU-s with the next setting);
# - no preemption watcher: an actor per Ray Train run that polls for node drains (none happen here);
# - Ray Train's controller polls its workers every 0.5 s, not 2 s: it takes one report per poll, so a short run
#   otherwise ends ~5 s after its last step.
# - idle workers are kept (up to 16 per node, for 10 minutes) rather than killed after 1 s above one per CPU: a
#   test's next Ray Data or Train stage then reuses them instead of starting new ones (~220 MB each while idle).
# test_train.py alone, the first three: 203 -> 160 s, 261 -> 225 CPU-s; the last, A/B interleaved twice:
# 138 -> 126 s, 192 -> 170 CPU-s.
TEST_RAY_ENV = {"RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0",
                "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
                "RAY_num_workers_soft_limit": "16", "RAY_idle_worker_killing_time_threshold_ms": "600000"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accepts(port: int) -> bool:
    """Whether something listens on 127.0.0.1:`port`."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


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


def vllm_children() -> set[int]:
    """This process's descendants that are vLLM's (its engine cores and workers name themselves VLLM::...)."""
    import psutil

    found = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if "VLLM" in " ".join(proc.cmdline() or [proc.name()]):
                found.add(proc.pid)
        except psutil.Error:  # ended (or a zombie) since the listing
            continue
    return found
