"""What a step and a held-out pass measure, reduced over all ranks (on the training device)."""

from __future__ import annotations

import torch

from eagle_core.teacher import with_targets
from eagle_core.ttt import simulated_accept_length
from pipelines.train.collectives import all_reduce


def weighted_loss(step_losses: list[float], step_decay: float) -> float:
    """The TTT objective's weighting of its per-step losses: step k weighs step_decay**k (see `ttt_forward`)."""
    return sum(step_decay ** k * v for k, v in enumerate(step_losses))


def global_step_metrics(local: dict, ttt_steps: int, world: int, device) -> dict:
    """Average the ranks' normalised pieces (sums of a global mean) and add the global derived metrics."""
    keys = ["loss"] + [f"loss_{k}" for k in range(ttt_steps)] + [f"acc_{k}" for k in range(ttt_steps)]
    t = all_reduce(torch.tensor([local[k] for k in keys] + [local["tokens"]], dtype=torch.float64), device).cpu()
    out = {k: float(v) / world for k, v in zip(keys, t[:-1])}
    out["tokens"] = float(t[-1])
    out["accept_length"] = simulated_accept_length([out[f"acc_{k}"] for k in range(ttt_steps)])
    out.update(lr=local["lr"], grad_norm=local["grad_norm"])
    return out


@torch.no_grad()
def evaluate(objective, draft, batches, head, ttt_steps: int, step_decay: float, device) -> dict:
    """Held-out per-step loss and accuracy, the weighted loss and the simulated acceptance length, over all ranks."""
    draft.eval()
    sums = torch.zeros(3, ttt_steps, dtype=torch.float64, device=device)
    for batch in batches:
        batch = with_targets(batch, head, draft.d2t)
        out = objective(batch["input_ids"], batch["loss_mask"], batch["aux_hidden"], batch["last_hidden"], head,
                        attention_mask=batch["attention_mask"], ttt_steps=ttt_steps, targets=batch["targets"],
                        position_ids=batch.get("position_ids"))
        counts = out.step_counts.double().to(device)
        sums += torch.stack([out.step_losses.double().to(device) * counts,
                             out.step_accuracies.double().to(device) * counts, counts])
    sums = all_reduce(sums, device).cpu()
    counts = sums[2].clamp(min=1)
    losses, accs = (sums[0] / counts).tolist(), (sums[1] / counts).tolist()
    metrics = {f"eval_loss_{k}": losses[k] for k in range(ttt_steps)}
    metrics.update({f"eval_acc_{k}": accs[k] for k in range(ttt_steps)})
    metrics["eval_loss"] = weighted_loss(losses, step_decay)
    metrics["eval_accept_length"] = simulated_accept_length(accs)
    metrics["eval_positions"] = float(sums[2][0])
    return metrics
