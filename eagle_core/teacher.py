"""The teacher of TTT training: the target's distribution over the draft vocabulary and its full-vocabulary argmax,
computed from the target's last hidden states and lm_head without gradients, a block of rows at a time (no
[B, L, target vocab] logits tensor exists). `eagle_core.ttt` trains the draft against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle_core.ttt_ops import float_out_mm
from eagle_core.vocab import draft_ids_from_mapping


TARGET_BLOCK = 512  # rows of the target's head at a time: [rows, target vocab] logits, 100 MB at 49k float32
# On CUDA under autocast, the target's argmax is screened in float16 and re-checked in float32 among the
# ARGMAX_CANDIDATES highest float16 logits (a row where those may miss it: the whole row in float32).
ARGMAX_CANDIDATES = 8


@torch.no_grad()
def target_distribution(last_hidden, target_lm_head_weight, d2t):
    """The target's softmax over the draft vocab (renormalised) and its full-vocab argmax.

    last_hidden: [B, L, Ht] (after the target's final norm); target_lm_head_weight: [V, Ht]
    returns target_p [B, L, Vd] float32 and target_argmax [B, L] (target ids)
    Computed a block of rows at a time, so no [B, L, V] logits tensor exists at long L.
    A float32 head on CUDA under a bf16/fp16 autocast takes `low_precision_teacher` (a full-vocab float32 GEMM
    is ~15x slower there than a half-precision one); on a CPU it is no faster (measured: 2.7 against 2.3 CPU
    seconds for the SmolLM2 shape at 2 048 tokens), so the CPU keeps the float32 one.
    """
    w = target_lm_head_weight
    device = w.device.type
    low = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else torch.float32
    if device == "cuda" and w.dtype == torch.float32 and low in (torch.bfloat16, torch.float16):
        return low_precision_teacher(last_hidden, w, d2t, low)
    hidden = last_hidden.to(w.device, w.dtype).flatten(0, 1)
    rows = draft_ids_from_mapping(d2t).to(w.device)
    # Softmax restricted to a subset and renormalised == softmax of that subset's logits, in float32 whatever the
    # caller's autocast. The argmax is over the head's own dtype; a float32 head gives both from one product.
    w_rows = None if w.dtype == torch.float32 else w[rows].float()
    p_blocks, arg_blocks = [], []
    with torch.autocast(device_type=w.device.type, enabled=False):
        for h in hidden.split(TARGET_BLOCK):
            logits = F.linear(h, w)
            arg_blocks.append(logits.argmax(-1))
            p_blocks.append(torch.softmax(logits[:, rows] if w_rows is None else F.linear(h.float(), w_rows), dim=-1))
    shape = last_hidden.shape[:2]
    return torch.cat(p_blocks).view(*shape, -1), torch.cat(arg_blocks).view(shape)


@torch.no_grad()
def low_precision_teacher(last_hidden, w, d2t, low=torch.bfloat16):
    """`target_distribution` for a float32 head `w` under a `low` (bf16/fp16) autocast.

    Soft labels: the draft-vocab rows only, inputs rounded to `low`, float32 products and softmax (rounding the
    inputs moves a probability by ~1 %: what training in `low` accepts everywhere else).
    Argmax over the full vocabulary, equal to the float32 one: a float16 screen (10 mantissa bits: on SmolLM2's
    real features its rounding bound below ruled out all but the top 8 logits in 99.6 % of rows; bf16's did in
    27 %), then the float32 logits of its ARGMAX_CANDIDATES highest. |fp16 logit - float32 logit| <= delta =
    (2.5u + n 2^-23) ||h|| max_v ||w_v|| (the inputs' rounding, Cauchy-Schwarz, the float32 accumulation)
    + 2^-25 (||h||_1 + max_v ||w_v||_1) (subnormals) + 2u |logit| (the output's rounding), u = 2^-11. Where the
    lowest candidate plus its delta stays below the highest minus its delta, no other logit can be the largest;
    other rows (and any that overflow float16) are recomputed whole in float32 after all blocks (one host sync).
    """
    hidden = last_hidden.to(w.device).flatten(0, 1).float()
    rows = draft_ids_from_mapping(d2t).to(w.device)
    screen = torch.float16
    u = torch.finfo(screen).eps / 2
    w_norm, w_l1 = w.norm(dim=-1).max(), w.abs().sum(-1).max()
    p_blocks, arg_blocks, sure_blocks = [], [], []
    with torch.autocast(device_type=w.device.type, enabled=False):
        w_screen = w.to(screen)  # once per call
        w_rows = w[rows].to(low).t()  # [Ht, Vd]
        c = min(ARGMAX_CANDIDATES, w.shape[0])
        for h in hidden.split(TARGET_BLOCK):
            p_blocks.append(torch.softmax(float_out_mm(h.to(low), w_rows), dim=-1))
            top = F.linear(h.to(screen), w_screen).topk(c, dim=-1)  # [n, c], highest first
            values = top.values.float()
            bound = ((2.5 * u + h.shape[1] * 2.0 ** -23) * h.norm(dim=-1, keepdim=True) * w_norm
                     + 2.0 ** -25 * (h.abs().sum(-1, keepdim=True) + w_l1) + 2 * u * values.abs())
            # highest possible true logit of any non-candidate < lowest possible true logit of the top candidate
            sure = (values[:, -1] + bound[:, -1]) < (values[:, 0] - bound[:, 0])
            sure_blocks.append(sure & values.isfinite().all(-1))
            exact = torch.bmm(w[top.indices], h[:, :, None])[..., 0]  # [n, c] float32
            arg_blocks.append(top.indices.gather(1, exact.argmax(-1, keepdim=True))[:, 0])
        argmax, sure = torch.cat(arg_blocks), torch.cat(sure_blocks)
        if not bool(sure.all()):
            unsure = (~sure).nonzero()[:, 0]
            argmax[unsure] = torch.cat([F.linear(h, w).argmax(-1) for h in hidden[unsure].split(TARGET_BLOCK)])
    shape = last_hidden.shape[:2]
    return torch.cat(p_blocks).view(*shape, -1), argmax.view(shape)


def with_targets(batch: dict, target_lm_head_weight, d2t) -> dict:
    """The batch plus its precomputed target distribution (worth it when a batch is trained on repeatedly)."""
    return {**batch, "targets": target_distribution(batch["last_hidden"], target_lm_head_weight, d2t)}
