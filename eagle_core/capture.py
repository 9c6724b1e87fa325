"""Multi-layer feature capture from a loaded target: the aux layers' outputs and the final hidden state.

Aux layer ids follow transformers' `output_hidden_states` convention (`eagle_core.target.resolve_aux_layer_ids`):
id 0 is the embedding output, id j >= 1 the output of decoder layer j-1. `capture_features` records only the
requested layers through forward hooks, so a 30-layer target never materialises 31 hidden-state tensors;
`record_hidden_states` serves any forward (prefill, KV-cached decode, tree verification). `CommittedFeatures`
(opt-in, held by the target's cache) keeps those of the tokens decoding commits: what an extraction of the served
conversation would compute, from the forwards decoding runs anyway.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

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


class RowFeatures(NamedTuple):
    """One row's features of consecutive committed tokens, as an extraction stores them."""

    aux_hidden: torch.Tensor  # [n, 3H] the aux layers concatenated, in the target's dtype
    last_hidden: torch.Tensor  # [n, H] after the final norm


class CommittedFeatures:
    """Opt-in capture while decoding: per row, the features (aux layers + last hidden state) of every committed
    token that has gone through a target forward, in order; the same positions of the same sequence as an
    extraction's forward over prompt + answer (`capture_features`), up to the order floating-point sums run in.

    It lives with the target's cache (`eagle_core.kv.TargetKV(features=...)`), the home of the forward: every
    `target_forward` hands it the new entries' features (`record_`), and the cache's `keep_new_` keeps those of the
    entries it keeps (`keep_`): the prompt at prefill, the root at a plain step, the root and the accepted nodes of
    a verified tree. Nothing else runs: the features come from forwards decoding runs anyway (the aux layers the
    draft needs, plus the capture's own layers where they differ: one more hook each).

    A committed token's features come with the forward that processes it: a round's bonus token (the next root)
    gets its features from the next round, so a row that finishes leaves its last token without them.
    Rows follow the cache's `select_rows_` / `merge_`; `take` hands out (and forgets) what rows gathered so far.
    """

    def __init__(self, aux_layer_ids: list[int], batch_size: int):
        self.aux_layer_ids = list(aux_layer_ids)
        self.rows: list[list[RowFeatures]] = [[] for _ in range(batch_size)]  # per row: chunks in position order
        self._new: tuple[torch.Tensor, torch.Tensor] | None = None  # the last forward's (hidden, aux) [B, S, ...]

    def record_(self, hidden: torch.Tensor, aux: torch.Tensor) -> None:
        """The features of a forward's S new entries: hidden [B, S, H], aux [B, S, 3H]."""
        self._new = (hidden, aux)

    def keep_(self, keep: torch.Tensor, n_keep: torch.Tensor) -> None:
        """The cache kept `keep[b, :n_keep[b]]` of the last forward's new entries (indices into them, in order):
        those are committed tokens, appended to each row's features. One host read of n_keep."""
        if self._new is None:  # a forward whose features were taken already, or none recorded
            return
        hidden, aux = self._new
        self._new = None
        index = keep.to(aux.device)[:, :, None]
        kept_aux = aux.gather(1, index.expand(-1, -1, aux.shape[-1]))  # [B, K, 3H]
        kept_last = hidden.gather(1, index.expand(-1, -1, hidden.shape[-1]))  # [B, K, H]
        for b, n in enumerate(n_keep.tolist()):
            if n:
                self.rows[b].append(RowFeatures(kept_aux[b, :n], kept_last[b, :n]))

    def select_rows_(self, rows: list[int]) -> None:
        self.rows = [self.rows[i] for i in rows]
        self._new = None

    def merge_(self, other: "CommittedFeatures") -> None:
        if other.aux_layer_ids != self.aux_layer_ids:
            raise ValueError(f"cannot merge rows capturing aux layers {other.aux_layer_ids} into rows capturing "
                             f"{self.aux_layer_ids}")
        self.rows = self.rows + other.rows
        self._new = None

    def held(self) -> list[int]:
        """Tokens whose features each row holds (not taken yet)."""
        return [sum(len(c.aux_hidden) for c in chunks) for chunks in self.rows]

    def take(self, rows: list[int] | None = None) -> list[RowFeatures | None]:
        """The features each of `rows` (default: every row) gathered since its last take, concatenated in
        position order (None where a row gathered none); they are forgotten here."""
        out = []
        for b in range(len(self.rows)) if rows is None else rows:
            chunks, self.rows[b] = self.rows[b], []
            out.append(RowFeatures(torch.cat([c.aux_hidden for c in chunks]), torch.cat([c.last_hidden for c in chunks]))
                       if chunks else None)
        return out
