"""Test-only fault injection: SIGKILL rank 0's training process once, right after a given optimiser step.

Not part of the job's configuration (nor its CLI or MLflow params). A test sets `EAGLE3_TRAIN_FAULT_AT_STEP`
in the driver's environment (`monkeypatch.setenv(FAULT_ENV, "4")`); `run_train` forwards it to the workers
(their environment is the cluster's, not the driver's) and the loop calls `maybe_fault` after every step.
Unset, nothing happens. A marker file per step in the run's storage folder makes each fault happen once only, so
the resumed run gets past the step (and a resumed run can be given a later step to die at).
"""

from __future__ import annotations

import os
import signal
import time

from pipelines.storage import commit_bytes, exists, join

FAULT_ENV = "EAGLE3_TRAIN_FAULT_AT_STEP"


def fault_step_from_env() -> int | None:
    value = os.environ.get(FAULT_ENV)
    return int(value) if value else None


def maybe_fault(at_step: int | None, step: int, rank: int, storage_dir: str) -> None:
    """SIGKILL this process if it is rank 0 right after `at_step`, once per (storage folder, step)."""
    if at_step is None or rank != 0 or step != at_step:
        return
    marker = join(storage_dir, f"fault_injected-{at_step}")
    if exists(marker):
        return
    commit_bytes(marker, str(step).encode())
    time.sleep(2.0)  # let the controller register the checkpoint reported just before
    os.kill(os.getpid(), signal.SIGKILL)
