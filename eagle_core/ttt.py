"""Training-time test (TTT): the EAGLE-3 loss, the efficient attention it needs, and a bare training loop.

Shapes: B batch, L sequence, H draft hidden, K `ttt_steps`, Vd `draft_vocab_size`.

What step k sees at column t (t = 0..L-1):
    step 0: hidden = fc(aux features of position t), token x[t+1], rotary position p(t)
    step k: hidden = the draft's own step-(k-1) output at column t, token x[t+k+1], position p(t) + k
            (P-EAGLE, `parallel_drafting`: hidden = fc(mask_hidden), token mask_token_id, position p(t) + k: what
            its mask slots hold when a round drafts every depth in one forward)
    it predicts x[t+k+2]: target = softmax of the target's logits at position t+k+1, restricted to the
    draft vocab and renormalised; the position counts when loss_mask[t+k+2] is set.
Attention of step k at column t: the step-0 keys of columns s <= t (causal, padding removed; in a packed row only
those of column t's conversation, `eagle_core.ttt_batch`) plus the keys that column t itself produced at steps 1..k
(diagonal blocks). So step k needs only the step-0 [L, L] block and k per-column dot products; the (K*L)^2 mask of
the naive formulation never exists. That attention and the draft head's loss run as blocked autograd functions
(`eagle_core.ttt_ops`) that keep no [L, L] or [L, draft vocab] tensor for the backward.
`eagle_core.ttt_naive.ttt_forward_naive` is that naive formulation, kept as the executable definition for tests and
benchmarks.

Loss = sum_k 0.8**k * mean over masked positions of soft cross-entropy(target, draft). Positions whose
target token is outside the draft vocab still count (the draft is penalised for not covering it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from eagle_core.draft import Eagle3Draft, repeat_kv
from eagle_core.recipe import REFERENCE
from eagle_core.teacher import target_distribution
from eagle_core.ttt_batch import check_batch, document_starts, step_counts, step_mask
from eagle_core.ttt_ops import block_first_keys, compute_dtype, soft_cross_entropy, ttt_attention


NOISE_KINDS = ("none", "uniform", "gaussian")


@dataclass
class HiddenNoise:
    """Noise on the target features during training (EAGLE-1's robustness trick); off by default."""
    kind: str = "none"  # "uniform": U(-scale, scale); "gaussian": N(0, scale^2)
    scale: float = 0.0

    def __post_init__(self):
        if self.kind not in NOISE_KINDS:
            raise ValueError(f"noise kind must be one of {NOISE_KINDS}, got {self.kind!r}")

    def apply(self, x):
        if self.kind == "none" or self.scale == 0:
            return x
        if self.kind == "uniform":
            return x + (torch.rand_like(x) * 2 - 1) * self.scale
        return x + torch.randn_like(x) * self.scale


@dataclass
class TTTOutput:
    loss: torch.Tensor  # scalar, differentiable: sum_k step_weight[k] * step_losses[k]
    step_losses: torch.Tensor  # [K] (detached)
    step_accuracies: torch.Tensor  # [K] top-1 of the draft (mapped to target ids) vs the target's argmax
    step_counts: torch.Tensor  # [K] number of loss positions per step
    logits: list[torch.Tensor] | None = None  # K x [B, L, Vd] when requested

    @property
    def accept_length(self) -> float:
        return simulated_accept_length(self.step_accuracies)

    def metrics(self) -> dict:
        out = {"loss": float(self.loss.detach()), "accept_length": self.accept_length}
        for k, (loss, acc) in enumerate(zip(self.step_losses.tolist(), self.step_accuracies.tolist())):
            out[f"loss_{k}"], out[f"acc_{k}"] = loss, acc
        return out


def simulated_accept_length(step_accuracies) -> float:
    """Expected tokens per target forward for a chain draft: 1 (bonus) + sum_k prod_{j<=k} acc_j.

    Step k's accuracy is measured with the true tokens fed back, i.e. conditional on steps < k being
    right, so the product is the probability that the first k+1 drafted tokens are all accepted.
    """
    accs = torch.as_tensor(step_accuracies, dtype=torch.float64)
    return float(1 + torch.cumprod(accs, 0).sum())


# ---------------------------------------------------------------------------------------------------
def positions_from_mask(attention_mask):
    # attention_mask: [B, L] (1 = real token) -> rotary positions [B, L] that skip left padding
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def step0_key_mask(attention_mask):
    """bool [B, 1, L, L]: column t sees columns s <= t that are real tokens, and always itself.

    "Always itself" keeps a fully padded row finite; its loss is masked anyway.
    """
    L = attention_mask.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=attention_mask.device).tril()
    valid = causal[None] & attention_mask.bool()[:, None, :]
    return (valid | torch.eye(L, dtype=torch.bool, device=attention_mask.device))[:, None]


def shift_tokens(input_ids, n):
    # input_ids: [B, L] -> [B, L] with x[t + n] at column t, id 0 past the end
    return F.pad(input_ids[:, n:], (0, n), value=0)


# ---------------------------------------------------------------------------------------------------
# efficient TTT


def ttt_forward(
    draft: Eagle3Draft,
    input_ids,
    loss_mask,
    aux_hidden,
    target_last_hidden,
    target_lm_head_weight,
    attention_mask=None,
    ttt_steps: int | None = None,
    step_decay: float = 0.8,
    noise: HiddenNoise | None = None,
    return_logits: bool = False,
    targets: tuple | None = None,
    step_denominators=None,
    position_ids=None,
) -> TTTOutput:
    """TTT loss over a padded or packed batch.

    input_ids, loss_mask, attention_mask: [B, L]; aux_hidden: [B, L, 3Ht]; target_last_hidden: [B, L, Ht]
    target_lm_head_weight: [V, Ht] (frozen; the target's distribution is computed here, without grad)
    targets: optional `target_distribution(...)` result, for callers that reuse a batch many times (the
    full-vocab target logits cost as much as the draft itself on a small draft)
    step_denominators: optional [K] divisors replacing this batch's own per-step position counts. Data
    parallel training passes (global count / world size), so the ranks' averaged gradients equal those of
    one process holding the whole global batch, whatever share of positions each rank holds
    position_ids: optional [B, L], a packed batch's (`eagle_core.ttt_batch`): rotary positions that restart at 0
    where a conversation starts; attention and the TTT steps then stay inside each conversation, and the loss
    equals that of the same conversations one per row. None: one conversation per row (padding skipped)
    """
    K = ttt_steps or draft.config.ttt_steps
    B, L = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    target_p, target_argmax = targets or target_distribution(target_last_hidden, target_lm_head_weight, draft.d2t)
    loss_mask = loss_mask.float() * attention_mask.float()  # float32: counts stay exact
    positions = positions_from_mask(attention_mask) if position_ids is None else position_ids
    starts = None if position_ids is None else document_starts(position_ids)  # [B, L]: each column's conversation
    first_keys = block_first_keys(starts, L)  # the step-0 keys each block of rows skips (packed rows only)
    key_valid = attention_mask.bool()
    n_rep = draft.num_heads // draft.num_kv_heads

    if draft.training and noise is not None:
        aux_hidden = noise.apply(aux_hidden)
    hidden = draft.fuse(aux_hidden)  # [B, L, H]
    # The head in the compute dtype, cast once for the K steps (its gradient still goes to the float32 weight).
    head_dtype = compute_dtype(hidden)
    head_low = draft.lm_head.weight.detach().to(head_dtype) if head_dtype != draft.lm_head.weight.dtype else None
    counted = counted_rows(loss_mask, attention_mask, K, starts)
    k0 = v0 = None
    diag_k, diag_v, results = [], [], []
    for k in range(K):
        ids = shift_tokens(input_ids, k + 1)
        if k and draft.config.parallel_drafting:  # P-EAGLE: deeper steps are mask slots, not the previous output
            hidden, ids = draft.mask_inputs(B, L)
        q, kk, vv, residual = draft.project_qkv(hidden, ids, positions + k)
        kk, vv = repeat_kv(kk, n_rep), repeat_kv(vv, n_rep)
        if k == 0:
            k0, v0 = kk, vv
        else:
            diag_k.append(kk)
            diag_v.append(vv)
        hidden = draft.finish_layer(ttt_attention(q, k0, v0, key_valid, diag_k, diag_v, starts, first_keys), residual)
        # Logits are materialised only on request: 7 x [B, L, 32000] float32 is gigabytes at long L.
        logits = draft.compute_logits(hidden) if return_logits else None
        results.append((logits, *step_head_loss(draft, hidden, k, target_p, target_argmax, counted[k], head_low)))
    return collect_steps(results, step_decay, return_logits, step_denominators)


def counted_rows(loss_mask, column_mask, steps: int, starts=None) -> list[tuple]:
    """Per step k < `steps`: (batch indices, column indices, count) of the columns that count (`step_mask`; `starts`:
    a packed batch's `document_starts`), all from one `nonzero` (one host sync per training step on CUDA, not one per
    TTT step)."""
    B, L = loss_mask.shape
    width = max(L - 2, 0)
    masks = torch.stack([F.pad(step_mask(loss_mask, column_mask, L, k, starts), (0, width - max(L - k - 2, 0)))
                         for k in range(steps)]) > 0  # [K, B, L-2]
    _, b, t = masks.nonzero(as_tuple=True)  # ordered by k, then b, then t: each step's (b, t) as before
    counts = masks.sum((1, 2))
    sizes = counts.tolist()
    return [(bk, tk, c.float()) for bk, tk, c in zip(b.split(sizes), t.split(sizes), counts)]


def step_head_loss(draft, hidden, k, target_p, target_argmax, counted, head_low=None):
    """`step_loss` of the draft's head on `hidden` [B, L, H], computed on the counted rows only (`counted`: one
    step of `counted_rows`) and without keeping their [rows, draft vocab] logits (`ttt_ops.soft_cross_entropy`).
    head_low: the head's weight in the compute dtype (cast once per training step), or None."""
    b, t, count = counted
    x = draft.head_input(hidden[b, t])  # [N, H]
    loss, hits = soft_cross_entropy(x, draft.lm_head.weight, target_p[b, t + k + 1], target_argmax[b, t + k + 1],
                                     draft.d2t, head_low)
    return loss, hits, count


def step_loss(draft, logits, k, target_p, target_argmax, loss_mask, column_mask=None):
    """Soft cross-entropy and top-1 hits of step k over its valid columns t < L-k-2.

    logits: [B, L, Vd]; target_p: [B, L, Vd]; target_argmax, loss_mask: [B, L]
    column_mask: optional [B, L] (the attention mask): a padded column holds no real feature, so it never
    counts, even when the token it would predict is a loss token (left padding)
    returns (summed loss, hits, count) as 0-d tensors
    """
    mask = step_mask(loss_mask, column_mask, logits.shape[1], k)
    n = mask.shape[1]
    logits = logits[:, :n]
    p = target_p[:, k + 1: k + 1 + n]  # the target's distribution for that token
    ce = -(p * torch.log_softmax(logits, dim=-1)).sum(-1)  # [B, n]
    with torch.no_grad():
        hits = (draft.draft_to_target(logits.argmax(-1)) == target_argmax[:, k + 1: k + 1 + n]).float()
    return (ce * mask).sum(), (hits * mask).sum(), mask.sum()


def collect_steps(results, step_decay, return_logits, step_denominators=None) -> TTTOutput:
    losses, accs, counts, total = [], [], [], 0.0
    for k, (_, loss_sum, hits, count) in enumerate(results):
        denom = count.clamp(min=1) if step_denominators is None else step_denominators[k].to(count)
        step = loss_sum / denom
        total = total + (step_decay ** k) * step
        losses.append(step.detach())
        accs.append((hits / denom).detach())
        counts.append(count.detach())
    return TTTOutput(
        loss=total,
        step_losses=torch.stack(losses),
        step_accuracies=torch.stack(accs),
        step_counts=torch.stack(counts),
        logits=[r[0] for r in results] if return_logits else None,
    )


# ---------------------------------------------------------------------------------------------------
# naive reference: rebuild every step's whole input sequence and attend with an explicit mask


# ---------------------------------------------------------------------------------------------------
# a bare single-process training loop (the Ray Train job wraps the same `train_step`)


@dataclass
class TrainConfig:  # the library's optimiser settings; lr and schedule floor are the reference recipe's
    lr: float = REFERENCE.lr
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 0
    total_steps: int = 1000
    min_lr_ratio: float = REFERENCE.min_lr_ratio
    max_grad_norm: float = 0.5
    step_decay: float = 0.8
    ttt_steps: int | None = None  # None = the draft config's
    noise: HiddenNoise = field(default_factory=HiddenNoise)


def trainable_parameters(draft):
    return [p for p in draft.parameters() if p.requires_grad]


def make_optimizer(draft, cfg: TrainConfig):
    """AdamW over the trainable weights (the frozen embeddings and a frozen lm_head are skipped)."""
    return torch.optim.AdamW(trainable_parameters(draft), lr=cfg.lr, betas=cfg.betas,
                             weight_decay=cfg.weight_decay)


def warmup_cosine(step: int, cfg: TrainConfig) -> float:
    """LR multiplier: linear warm-up, then cosine down to min_lr_ratio at total_steps."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(cfg.total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_scheduler(optimizer, cfg: TrainConfig):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, cfg))


def batch_to(batch: dict, device, non_blocking: bool = False) -> dict:
    """`batch` on `device` (non_blocking: an asynchronous copy from pinned host memory to a GPU)."""
    def move(v):
        if torch.is_tensor(v):
            return v.to(device, non_blocking=non_blocking)
        return tuple(move(x) for x in v) if isinstance(v, tuple) else v
    return {k: move(v) for k, v in batch.items()}


def train_step(draft, batch, target_lm_head_weight, optimizer, scheduler, cfg: TrainConfig, forward=None,
               prepare=None, gradient_sync=None) -> dict:
    """One optimisation step on a batch {input_ids, loss_mask, aux_hidden, last_hidden[, attention_mask, position_ids,
    targets, step_denominators]} (`eagle_core.ttt_batch`), or on a list of micro-batches (gradient accumulation).

    Micro-batches are forwarded and backwarded one after the other, their gradients summed, then one optimiser step:
    only one micro-batch's activations (and teacher, when `prepare` computes it) are alive at a time. Every
    micro-batch's losses are divided by the whole step's position counts (`step_denominators`; computed here over the
    micro-batches when they do not carry them), so the step equals the step on their union, up to float rounding.
    `prepare(micro_batch)` runs just before its forward (e.g. the move to the device and the teacher).

    `forward` (default `ttt_forward`, same signature) lets a distributed caller route the loss through its
    DDP/FSDP wrapper (gradient sync needs the wrapper's forward) and autocast; `gradient_sync(last)` is the
    wrapper's context for a backward (syncing gradients only for the last micro-batch). The step itself stays here.
    A micro-batch that does not fit the draft is refused first (`check_batch`), before the weights move.
    """
    micro = list(batch) if isinstance(batch, (list, tuple)) else [batch]
    if not micro:
        raise ValueError("train_step needs a batch")
    if len(micro) > 1 and any(b.get("step_denominators") is None for b in micro):
        K = cfg.ttt_steps or draft.config.ttt_steps
        counts = sum(step_counts(b, K).double().cpu() for b in micro).clamp(min=1).float()
        micro = [{**b, "step_denominators": counts} for b in micro]
    draft.train()
    optimizer.zero_grad(set_to_none=True)
    totals, tokens = None, 0  # the micro-batches' loss, step losses, accuracies and counts, summed
    for i, b in enumerate(micro):
        # counted before `prepare` moves it: on the host, where the loop's batches are, no device sync
        tokens += int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel()
        b = prepare(b) if prepare is not None else b
        check_batch(draft, b, target_lm_head_weight, contents=False)
        with gradient_sync(i == len(micro) - 1) if gradient_sync is not None else nullcontext():
            out = (forward or ttt_forward)(
                draft, b["input_ids"], b["loss_mask"], b["aux_hidden"], b["last_hidden"], target_lm_head_weight,
                attention_mask=b.get("attention_mask"), ttt_steps=cfg.ttt_steps, step_decay=cfg.step_decay,
                noise=cfg.noise, targets=b.get("targets"), step_denominators=b.get("step_denominators"),
                position_ids=b.get("position_ids"))
            out.loss.backward()
        part = (out.loss.detach(), out.step_losses, out.step_accuracies, out.step_counts)
        totals = part if totals is None else tuple(a + b for a, b in zip(totals, part))
        del out, b  # the micro-batch's graph and teacher go before the next one's
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable_parameters(draft), cfg.max_grad_norm)
    optimizer.step()
    scheduler.step()
    metrics = TTTOutput(*totals).metrics()
    metrics.update(grad_norm=float(grad_norm), lr=scheduler.get_last_lr()[0], tokens=tokens)
    return metrics


def train_state_dict(draft, optimizer, scheduler, step: int) -> dict:
    """What a resumed run needs: the draft's weights and vocab, AdamW moments, the schedule position, the step.

    Plain tensors and numbers only, so `torch.save` / `torch.load(..., weights_only=True)` round-trip it.
    The target's frozen embedding is left out (it comes with the target); a draft's own one is kept.
    """
    weights = {k: v for k, v in draft.state_dict().items()
               if k != "embed_tokens.weight" or draft.embed_tokens.weight.requires_grad}
    return {"draft": weights, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "step": int(step)}


def load_train_state(state: dict, draft, optimizer, scheduler) -> int:
    """Restore `train_state_dict` output into a freshly built draft/optimizer/scheduler; returns the step."""
    missing, unexpected = draft.load_state_dict(state["draft"], strict=False)
    missing = [k for k in missing if k != "embed_tokens.weight"]
    if missing or unexpected:
        raise ValueError(f"training state does not fit this draft: missing={missing} unexpected={unexpected}")
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"])


def train_draft_steps(draft, batches: Iterable[dict], target_lm_head_weight, cfg: TrainConfig,
                      optimizer=None, scheduler=None, on_step=None, start_step: int = 0) -> list[dict]:
    """Run steps `start_step`..`cfg.total_steps` (cycling `batches` if needed); returns per-step metrics.

    `on_step(step, metrics)` is where a caller logs or checkpoints (`train_state_dict`); return True from it
    to stop early. To resume, rebuild draft/optimizer/scheduler, `load_train_state`, and pass the step it
    returns as `start_step` (with the batches not yet seen).
    Every batch is checked (`check_batch`, contents too, where it is: on the CPU, no device sync) before a step uses
    it: a list or tuple all of them before the first step, another iterable each one before its own step.
    """
    optimizer = optimizer or make_optimizer(draft, cfg)
    scheduler = scheduler or make_scheduler(optimizer, cfg)
    device = draft.fc.weight.device
    checked = isinstance(batches, (list, tuple))
    if checked:
        for batch in batches:
            check_batch(draft, batch, target_lm_head_weight)
    history, step = [], start_step
    while step < cfg.total_steps:
        progressed = False
        for batch in batches:
            if not checked:
                check_batch(draft, batch, target_lm_head_weight)
            metrics = train_step(draft, batch_to(batch, device), target_lm_head_weight, optimizer, scheduler, cfg)
            history.append(metrics)
            step += 1
            progressed = True
            if (on_step and on_step(step, metrics)) or step >= cfg.total_steps:
                return history
        if not progressed:  # an exhausted one-shot iterator: stop where the data ends
            break
    return history
