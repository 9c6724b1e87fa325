"""A real `mlflow server` on 127.0.0.1 that a test can stop, freeze and start again (same port, same data)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from process_helpers import free_port, kill_session, wait_until


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2)
        return True
    except Exception:
        return False


class MlflowServer:
    """`mlflow server` on 127.0.0.1 over a SQLite file; stop() and start() keep the port and the data."""

    def __init__(self, folder: Path):
        self.folder, self.port = folder, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
        env.pop("MLFLOW_TRACKING_URI", None)
        self.process = subprocess.Popen(
            [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{self.folder / 'mlflow.db'}",
             "--artifacts-destination", str(self.folder / "artifacts")],
            env=env, cwd=self.folder, start_new_session=True, stdout=subprocess.DEVNULL,
            stderr=open(self.folder / "server.log", "a"))
        wait_until(lambda: _answers(f"{self.uri}/health"), "the MLflow server", timeout=180)

    def stop(self) -> None:
        if self.process is not None:
            with_signal(self.process, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            kill_session(self.process.pid)
            self.process = None

    def pause(self) -> None:
        """Freeze every process of the server: connections are accepted by the kernel, never answered."""
        with_signal(self.process, signal.SIGSTOP)

    def resume(self) -> None:
        with_signal(self.process, signal.SIGCONT)


def with_signal(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
