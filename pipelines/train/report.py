"""What a run reports: progress lines (rank 0), per-step metrics to MLflow (rank 0), and the driver's plots.

Progress lines go through the `pipelines.train` logger, never `print`: in a Ray Train worker `print` is
patched to log through the root logger *and*, whenever `sys.stdout` is wrapped (it is in Ray workers), to
print as well, so every printed line reached the driver twice. The root logger Ray Train configures on its
workers (level INFO, console handler) emits each logged line once.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("pipelines.train")


def log_step(step: int, total_steps: int, metrics: dict) -> None:
    log.info("[train] step %d/%d loss %.4f acc_0 %.3f %.0f tok/s", step, total_steps, metrics["loss"],
             metrics["acc_0"], metrics["tokens_per_s"])


def log_held_out(step: int, metrics: dict, ttt_steps: int) -> None:
    accs = [round(metrics[f"eval_acc_{k}"], 3) for k in range(ttt_steps)]
    wait = f" (epoch's data wait {metrics['epoch_data_wait_s']:.1f}s)" if "epoch_data_wait_s" in metrics else ""
    log.info("[train] step %d held-out: acc %s accept_length %.3f%s", step, accs, metrics["eval_accept_length"], wait)


class RankZeroLogger:
    """Per-step metrics to the MLflow run, from rank 0 only (other ranks hold a no-op).

    A tracking server that is down or slow never stalls or ends training: `log` only queues; a background thread
    sends the queue in batches (MLflow's limit of 1000 metrics a call) and, when a send fails, keeps the batch and
    retries it with a growing pause (1 s doubling to `max_backoff_s`), so metrics logged during an outage arrive,
    in order, once the server is back. `close()` sends what is left, waiting up to `flush_timeout_s`. Beyond
    `max_pending` queued metrics the oldest are dropped and counted (a bounded memory for a long outage)."""

    BATCH = 1000

    def __init__(self, tracking_uri: str | None, run_id: str | None, active: bool, flush_timeout_s: float = 900.0,
                 max_backoff_s: float = 60.0, max_pending: int = 1_000_000):
        self.client = None
        self.flush_timeout_s, self.max_backoff_s, self.max_pending = flush_timeout_s, max_backoff_s, max_pending
        self.pending: collections.deque = collections.deque()
        self.cond = threading.Condition()
        self.closing, self.dropped, self.failures = False, 0, 0
        self.sender: threading.Thread | None = None
        if active and run_id:
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
            from mlflow.tracking import MlflowClient

            self.client, self.run_id = MlflowClient(tracking_uri), run_id
            self.sender = threading.Thread(target=self._send_loop, name="mlflow-metrics", daemon=True)
            self.sender.start()

    def log(self, metrics: dict, step: int) -> None:
        if self.client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        with self.cond:
            self.pending.extend(Metric(k, float(v), now, step) for k, v in metrics.items())
            while len(self.pending) > self.max_pending:
                self.pending.popleft()
                self.dropped += 1
            self.cond.notify()

    def _send_loop(self) -> None:
        backoff = 1.0
        while True:
            with self.cond:
                while not self.pending and not self.closing:
                    self.cond.wait()
                if not self.pending:
                    return
                batch = [self.pending[i] for i in range(min(self.BATCH, len(self.pending)))]
            try:
                self.client.log_batch(self.run_id, metrics=batch)
            except Exception as err:  # noqa: BLE001 - an outage: keep the batch, retry later
                self.failures += 1
                if self.failures == 1 or self.failures % 10 == 0:
                    log.warning("[train] MLflow unreachable (%s: %s); %d metrics queued, retrying in %.0f s",
                                type(err).__name__, str(err)[:200], len(self.pending), backoff)
                with self.cond:
                    self.cond.wait(timeout=backoff)  # close() wakes it: the flush retries at once
                backoff = min(backoff * 2, self.max_backoff_s)
                continue
            if self.failures:
                log.info("[train] MLflow reachable again; sending the queued metrics")
                self.failures = 0
            backoff = 1.0
            sent = {id(m) for m in batch}
            with self.cond:  # the batch is still at the left, unless `log` dropped some of it (max_pending)
                while self.pending and id(self.pending[0]) in sent:
                    self.pending.popleft()

    def close(self, timeout_s: float | None = None) -> None:
        """Send every queued metric, waiting up to `timeout_s` (default flush_timeout_s) for the server; report
        what could not be sent."""
        if self.sender is None:
            return
        timeout_s = self.flush_timeout_s if timeout_s is None else timeout_s
        with self.cond:
            self.closing = True
            self.cond.notify()
        self.sender.join(timeout=timeout_s)
        lost = len(self.pending) + self.dropped
        if lost:
            log.error("[train] %d metrics were not sent to MLflow run %s (server unreachable for %.0f s)", lost,
                      self.run_id, timeout_s)
        self.sender = None


def _history(client, run_id: str, key: str) -> tuple[list[int], list[float]]:
    points = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
    return [m.step for m in points], [m.value for m in points]


def plot_losses(client, run_id: str, ttt_steps: int, path: Path) -> Path:
    """loss_curves.png: the train loss per step, per TTT step, and the held-out loss."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key in ["loss"] + [f"loss_{k}" for k in range(ttt_steps)]:
        steps, values = _history(client, run_id, key)
        if steps:
            ax.plot(steps, values, label=key, linewidth=2 if key == "loss" else 0.8)
    steps, values = _history(client, run_id, "eval_loss")
    if steps:
        ax.plot(steps, values, "ko--", label="held-out loss")
    ax.set(xlabel="optimiser step", ylabel="TTT loss", title="EAGLE-3 TTT training loss")
    ax.legend(fontsize=7, ncol=2)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_acceptance(client, run_id: str, ttt_steps: int, path: Path) -> Path:
    """acceptance_per_position.png: the last held-out accuracy per draft position, and its running product."""
    import matplotlib.pyplot as plt

    accs = [_history(client, run_id, f"eval_acc_{k}")[1] for k in range(ttt_steps)]
    accs = [a[-1] if a else 0.0 for a in accs]
    cumulative = torch.cumprod(torch.tensor(accs, dtype=torch.float64), 0).tolist()
    fig, ax = plt.subplots(figsize=(7, 4))
    x = torch.arange(ttt_steps).float()
    ax.bar((x - 0.2).tolist(), accs, width=0.4, label="per-position accuracy (earlier positions right)")
    ax.bar((x + 0.2).tolist(), cumulative, width=0.4, label="P(first k+1 drafted tokens accepted)")
    ax.set(xlabel="draft position k", ylabel="held-out rate", ylim=(0, 1),
           title=f"held-out acceptance per position (simulated accept length {1 + sum(cumulative):.2f})")
    ax.set_xticks(range(ttt_steps))
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def write_plots(client, run_id: str, ttt_steps: int, folder: Path) -> list[Path]:
    """loss_curves.png and acceptance_per_position.png in `folder`."""
    import matplotlib

    matplotlib.use("Agg")
    return [plot_losses(client, run_id, ttt_steps, folder / "loss_curves.png"),
            plot_acceptance(client, run_id, ttt_steps, folder / "acceptance_per_position.png")]
