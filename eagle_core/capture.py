"""Multi-layer feature capture from a loaded target: the aux layers' outputs and the final hidden state.

Aux layer ids follow transformers' `output_hidden_states` convention (`eagle_core.target.resolve_aux_layer_ids`):
id 0 is the embedding output, id j >= 1 the output of decoder layer j-1. `capture_features` records only the
requested layers through forward hooks, so a 30-layer target never materialises 31 hidden-state tensors;
`record_hidden_states` serves any forward (prefill, KV-cached decode, tree verification).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from eagle_core.target import resolve_aux_layer_ids


@dataclass
class TargetFeatures:
    aux_hidden: torch.Tensor  # [B, S, 3H]: the aux layers concatenated in `aux_layer_ids` order
    last_hidden: torch.Tensor  # [B, S, H]: after the final norm (what lm_head sees)
    logits: torch.Tensor | None = None  # [B, S, V] when requested


def _decoder(model: nn.Module) -> nn.Module:
    inner = getattr(model, "model", model)
    if not hasattr(inner, "layers") or not hasattr(inner, "norm"):
        raise TypeError(f"{type(model).__name__} is not a Llama-family decoder (no .model.layers / .model.norm)")
    return inner


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


@contextlib.contextmanager
def record_hidden_states(model: nn.Module, aux_layer_ids: list[int]):
    """Forward hooks that record the aux layers' outputs and the final-norm output of the next forward.

    Yields a dict filled during the forward: {"aux": [tensor per id], "last": tensor}.
    Works with any forward of the model (prefill, KV-cached decode, tree verification).
    """
    decoder = _decoder(model)
    n = len(decoder.layers)
    for j in aux_layer_ids:
        if not 0 <= j < n:
            raise ValueError(f"aux layer id {j} out of range for a {n}-layer target (valid: 0..{n - 1})")
    record: dict = {"aux": [None] * len(aux_layer_ids), "last": None}
    handles = []
    home = decoder.embed_tokens.weight.device  # a target split over devices (device_map) is gathered here

    def keep(slot):
        def hook(_module, _inputs, output):
            record["aux"][slot] = _first(output).to(home)
        return hook

    for slot, j in enumerate(aux_layer_ids):
        module = decoder.embed_tokens if j == 0 else decoder.layers[j - 1]
        handles.append(module.register_forward_hook(keep(slot)))

    def keep_last(_module, _inputs, output):
        record["last"] = _first(output).to(home)

    handles.append(decoder.norm.register_forward_hook(keep_last))
    try:
        yield record
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def capture_features(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    aux_layer_ids: list[int] | None = None,
    return_logits: bool = False,
) -> TargetFeatures:
    """One target forward returning the aux features (3H) and the final hidden state (H)."""
    aux_layer_ids = resolve_aux_layer_ids(aux_layer_ids, model.config.num_hidden_layers)
    with record_hidden_states(model, aux_layer_ids) as rec:
        if return_logits:
            out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            logits = out.logits
        else:
            # Skip the lm_head: extraction only needs hidden states.
            _decoder(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            logits = None
    return TargetFeatures(aux_hidden=torch.cat(rec["aux"], dim=-1), last_hidden=rec["last"], logits=logits)
