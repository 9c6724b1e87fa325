"""What a run reports: progress lines (rank 0), per-step metrics to MLflow (rank 0), and the driver's plots.

Progress lines go through the `pipelines.train` logger, never `print`: in a Ray Train worker `print` is
patched to log through the root logger *and*, whenever `sys.stdout` is wrapped (it is in Ray workers), to
print as well, so every printed line reached the driver twice. The root logger Ray Train configures on its
workers (level INFO, console handler) emits each logged line once.
"""

from __future__ import annotations

import logging
import os
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
    """Per-step metrics to the MLflow run, from rank 0 only (other ranks hold a no-op)."""

    def __init__(self, tracking_uri: str | None, run_id: str | None, active: bool):
        self.client = None
        if active and run_id:
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
            from mlflow.tracking import MlflowClient

            self.client, self.run_id = MlflowClient(tracking_uri), run_id

    def log(self, metrics: dict, step: int) -> None:
        if self.client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])


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
