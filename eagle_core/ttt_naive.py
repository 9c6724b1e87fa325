"""TTT computed the slow and obvious way, kept as the executable definition that `eagle_core.ttt.ttt_forward` is
tested and benchmarked against: every step attends over the flattened (step, column) sequence through the full
(K*L)^2 mask, `naive_ttt_mask`."""

from __future__ import annotations

import torch

from eagle_core.teacher import target_distribution
from eagle_core.ttt import (TTTOutput, collect_steps, positions_from_mask, shift_tokens, step0_key_mask,
                            step_loss)


def naive_ttt_mask(attention_mask, steps: int):
    """bool [B, 1, steps*L, steps*L] over the flattened (step, column) sequence; the definition of TTT attention."""
    B, L = attention_mask.shape
    mask0 = step0_key_mask(attention_mask)[:, 0]  # [B, L, L]
    eye = torch.eye(L, dtype=torch.bool, device=attention_mask.device)
    full = torch.zeros(B, steps * L, steps * L, dtype=torch.bool, device=attention_mask.device)
    for j in range(steps):  # query step
        rows = slice(j * L, (j + 1) * L)
        full[:, rows, :L] = mask0
        for i in range(1, j + 1):  # own column at earlier (and the same) steps
            full[:, rows, i * L:(i + 1) * L] = eye
    return full[:, None]


def ttt_forward_naive(draft, input_ids, loss_mask, aux_hidden, target_last_hidden, target_lm_head_weight,
                      attention_mask=None, ttt_steps=None, step_decay=0.8, return_logits=False) -> TTTOutput:
    """Same contract as `ttt_forward`, computed the slow and obvious way: O((K*L)^2) attention.

    The loss itself is `step_loss`, checked position by position against its definition in the tests.
    """
    K = ttt_steps or draft.config.ttt_steps
    B, L = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    target_p, target_argmax = target_distribution(target_last_hidden, target_lm_head_weight, draft.d2t)
    loss_mask = loss_mask.float() * attention_mask.float()  # float32: counts stay exact
    positions = positions_from_mask(attention_mask)

    hiddens = [draft.fuse(aux_hidden)]  # step j's input hidden, [B, L, H] each
    results = []
    for k in range(K):
        seq_hidden = torch.cat(hiddens, dim=1)  # [B, (k+1)L, H]
        seq_ids = torch.cat([shift_tokens(input_ids, j + 1) if j == 0 or not draft.config.parallel_drafting
                             else draft.mask_inputs(B, L)[1] for j in range(k + 1)], dim=1)
        seq_pos = torch.cat([positions + j for j in range(k + 1)], dim=1)
        out, _ = draft(seq_hidden, seq_ids, seq_pos, attention_mask=naive_ttt_mask(attention_mask, k + 1))
        hidden = out[:, k * L:]
        hiddens.append(draft.mask_inputs(B, L)[0] if draft.config.parallel_drafting else hidden)
        logits = draft.compute_logits(hidden)
        # Logits are kept only on request: 7 x [B, L, 32000] float32 is gigabytes at long L.
        results.append((logits if return_logits else None,
                        *step_loss(draft, logits, k, target_p, target_argmax, loss_mask, attention_mask)))
    return collect_steps(results, step_decay, return_logits)
