"""The acceptance signal's I/O, off the request path: the served version's reference tau (a registry tag), the
replica's MLflow serving run (window summaries, drift events) and the drift hook.

Everything that may block (MLflow over the network, a hook command) runs on one background thread fed by a
bounded queue: a request never waits for it. A report that fails (MLflow down, a hook that raises or times out)
or that finds the queue full is dropped, logged once per distinct error and counted (`on_drop`).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import shlex
import subprocess
import threading
import time
from typing import Callable

from pipelines.hooks import import_callable
from pipelines.registry import TAU_DTYPE_TAG, TAU_TAG
from pipelines.serve.acceptance import DriftEvent, WindowSummary

log = logging.getLogger(__name__)
HOOK_ENV = "EAGLE3_DRIFT_EVENT"
_CALLABLE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")  # package.module:function


def registered_name(source: str) -> str:
    """`models:/<name>@<alias>` or `models:/<name>/<N>` -> <name>."""
    from pipelines.storage import REGISTRY_PREFIX

    ref = source[len(REGISTRY_PREFIX):]
    return ref.split("@", 1)[0] if "@" in ref else ref.rpartition("/")[0]


def registry_version(source: str | None, version: str | None) -> tuple[str, str] | None:
    """(registered model, version) when the draft is a registry version, else None."""
    from pipelines.storage import is_registry_uri

    if not source or not is_registry_uri(source) or not version or not version.isdigit():
        return None
    return registered_name(source), version


def reference_tau(config, version: str | None, served_dtype: str | None = None,
                  tag_name: str = TAU_TAG) -> float | None:
    """What the drift rule compares with: `drift_reference_tau`, else the served registry version's `tau` tag,
    else None (no drift rule). A registry that does not answer also gives None (logged): serving goes on.

    A tau measured in another dtype than the replica's `served_dtype` (its TAU_DTYPE_TAG) is still the reference,
    with a warning: greedy tau moves with the dtype (bf16 flips near-ties), by more than a usual margin on a small
    target, so the rule may alert, or stay silent, for the dtype alone; `drift_reference_tau` sets one measured
    as the replica serves."""
    if not config.drift:
        return None
    if config.drift_reference_tau is not None:
        return float(config.drift_reference_tau)
    ref = registry_version(config.draft, version)
    if ref is None:
        return None
    try:
        from pipelines import tracking

        client = tracking.configure().tracking.MlflowClient()
        tags = client.get_model_version(*ref).tags or {}
        tag = tags.get(tag_name)  # our decoder's tree tau, or vLLM's acceptance length (the engine's own measure)
        measured_in = tags.get(TAU_DTYPE_TAG)
        if tag is not None and served_dtype and measured_in and measured_in != served_dtype:
            log.warning("the drift reference tau %s of %s version %s was measured in %s; this replica serves %s: "
                        "the drift rule compares across dtypes (set drift_reference_tau to one measured as served)",
                        tag, *ref, measured_in, served_dtype)
        return float(tag) if tag is not None else None
    except Exception as exc:  # noqa: BLE001 - no reference means no drift rule, never a failed replica
        log.warning("cannot read the evaluation tau of %s version %s; drift rule off for it", *ref, exc_info=exc)
        return None


def resolve_hook(spec: str | None, timeout_s: float) -> Callable[[dict], None] | None:
    """`package.module:function` -> that function; anything else -> a function that runs it as a command (no
    shell: the words shlex splits), the event as JSON on its stdin and in $EAGLE3_DRIFT_EVENT, killed past
    `timeout_s`, a non-zero exit raised. Resolved when the replica starts, so a typo stops it at once instead
    of surfacing at the first alert."""
    if not spec:
        return None
    if _CALLABLE.fullmatch(spec):
        return import_callable(spec, "drift_hook")
    argv = shlex.split(spec)
    if not argv:
        raise ValueError("drift_hook is an empty command")

    def run(event: dict) -> None:
        payload = json.dumps(event)
        subprocess.run(argv, input=payload.encode(), env={**os.environ, HOOK_ENV: payload}, timeout=timeout_s,
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    return run


class AcceptanceReporter:
    """One background thread: window summaries and drift events to the replica's MLflow serving run (one run per
    served version, tagged with the registered model, its version and the replica), and alerts to the hook (at
    most one call per `hook_cooldown_s`)."""

    def __init__(self, experiment: str, model: str | None, hook: Callable[[dict], None] | None = None,
                 hook_cooldown_s: float = 3600.0, on_drop: Callable[[int], None] | None = None,
                 tags: Callable[[], dict] | None = None, params: dict | None = None, max_queued: int = 256):
        self.experiment, self.model = experiment, model
        self.hook, self.hook_cooldown_s = hook, hook_cooldown_s
        self.on_drop = on_drop or (lambda n: None)
        self.tags = tags or (lambda: {})
        self.params = params or {}
        self.queue: queue.Queue = queue.Queue(max_queued)
        self.runs: dict[str | None, str] = {}  # served version -> its serving run id
        self.last_hook = float("-inf")
        self.hook_calls = 0
        self.last_error: str | None = None
        self.thread = threading.Thread(target=self._run, name="eagle3-acceptance-report", daemon=True)
        self.thread.start()

    def submit(self, item: WindowSummary | DriftEvent) -> None:
        """Queue a report; never blocks (a full queue drops it)."""
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            self.on_drop(1)

    def close(self, timeout_s: float = 10.0) -> None:
        """Report what is queued (for up to `timeout_s`), end the serving runs. Idempotent."""
        if not self.thread.is_alive():
            return
        try:
            self.queue.put(None, timeout=timeout_s)
        except queue.Full:  # the thread is stuck on a report: leave it (a daemon), the replica is going anyway
            return
        self.thread.join(timeout_s)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued report is handled (tests, shutdown); True when it was."""
        deadline = time.monotonic() + timeout_s
        while self.queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self.queue.unfinished_tasks

    # ---- the thread ----
    def _run(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    self._end_runs()
                    return
                self._handle(item)
            except Exception as exc:  # noqa: BLE001 - a report is dropped, never the replica
                self.on_drop(1)
                if repr(exc) != self.last_error:
                    log.warning("acceptance report dropped (%s)", type(item).__name__, exc_info=exc)
                self.last_error = repr(exc)
            finally:
                self.queue.task_done()

    def _handle(self, item) -> None:
        if isinstance(item, DriftEvent) and item.kind == "alert" and self.hook is not None:
            self._call_hook(item)  # before MLflow: an unreachable store must not hold the retraining back
        if not self.experiment or self.model is None:
            return
        from mlflow.entities import Metric

        client = self._client()
        run_id = self._run_id(client, item.version)
        now = int(time.time() * 1000)
        if isinstance(item, WindowSummary):
            client.log_batch(run_id, metrics=[Metric(k, v, now, item.index) for k, v in item.metrics().items()])
        else:
            value = 1.0 if item.kind == "alert" else 0.0
            client.log_batch(run_id, metrics=[Metric(f"drift_alert/{item.category}", value, now, 0),
                                              Metric(f"drift_window_tau/{item.category}", item.window_tau, now, 0)])
            client.set_tag(run_id, f"drift_alert.{item.category}", json.dumps(item.to_dict()))

    def _call_hook(self, event: DriftEvent) -> None:
        if time.monotonic() - self.last_hook < self.hook_cooldown_s:
            log.info("drift alert for %s: hook not called (called %.0f s ago, cooldown %.0f s)", event.category,
                     time.monotonic() - self.last_hook, self.hook_cooldown_s)
            return
        self.last_hook = time.monotonic()
        self.hook_calls += 1
        log.warning("drift alert for %s (window tau %.3f < %.3f): calling the drift hook", event.category,
                    event.window_tau, event.threshold)
        try:
            self.hook({**event.to_dict(), "model": self.model})
        except subprocess.CalledProcessError as exc:  # its stderr says why; the exception alone does not
            raise RuntimeError(f"drift hook exited {exc.returncode}: {(exc.stderr or b'').decode()[-500:]}") from exc

    def _client(self):
        from pipelines import tracking

        return tracking.configure().tracking.MlflowClient()

    def _run_id(self, client, version: str | None) -> str:
        if version not in self.runs:
            from pipelines import tracking

            experiment_id = tracking.ensure_experiment(self.experiment)
            tags = {"eagle3.serving": "true", "eagle3.registered_model": self.model,
                    "eagle3.model_version": str(version), **self.tags()}
            run = client.create_run(experiment_id, run_name=f"serve-{self.model}-v{version}", tags=tags)
            for key, value in self.params.items():
                client.log_param(run.info.run_id, key, value)
            self.runs[version] = run.info.run_id
        return self.runs[version]

    def _end_runs(self) -> None:
        if not self.runs:
            return
        client = self._client()
        for run_id in self.runs.values():
            client.set_terminated(run_id)
