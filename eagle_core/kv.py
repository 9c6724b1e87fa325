"""Ragged KV caches for batched speculative decoding.

Every sequence of a batch accepts its own number of tokens per round, so rows of one cache hold different
numbers of valid entries. The layout used here keeps that cheap and exact:

* row b's committed entries occupy slots `[0, lengths[b])`, and the entry in slot s is the token at
  position s (rotary positions equal slot indices for everything committed);
* a forward appends its S new entries at slots `[P, P+S)` for every row (P = the cache's current width)
  with whatever positions the caller chooses (tree depth, ragged catch-up), and the attention mask lets
  row b see only its slots `< lengths[b]` plus the new entries the caller's `new_mask` allows;
* `keep_new_` then moves the entries the caller keeps (the accepted path) down to
  `[lengths[b], lengths[b] + n_keep[b])` and drops the rest, so the tree part never survives a round.

Slots between `lengths[b]` and P are garbage for row b and are never attended to. The same functions
serve the target (a transformers `DynamicCache` of preallocated layers: a forward writes its entries by index
into a buffer with spare room, and `keep_new_` rewrites the buffer in place) and the
draft (a single `(k, v)` pair that the caller owns, as the draft contract requires).
"""

from __future__ import annotations

import functools
import inspect

import torch


def attention_bias(lengths: torch.Tensor, past_width: int, new_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive float mask [B, 1, S, P+S] (0 = may attend, dtype min = may not).

    lengths: [B] valid cached entries per row; new_mask: [B, S, S] bool, which new entries each new query
    sees (causal, or ancestor-only for a tree). An additive mask (rather than bool) is what both the SDPA
    and the eager attention of transformers accept; the finite minimum keeps a fully masked row finite.
    """
    allowed = attention_allowed(lengths, past_width, new_mask)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return bias.masked_fill_(~allowed, torch.finfo(dtype).min)


def attention_allowed(lengths: torch.Tensor, past_width: int, new_mask: torch.Tensor) -> torch.Tensor:
    """Bool mask [B, 1, S, P+S], True = may attend (the draft contract's format)."""
    b, s, _ = new_mask.shape
    past = torch.arange(past_width, device=new_mask.device)[None, :] < lengths[:, None]  # [B, P]
    past = past[:, None, :].expand(b, s, past_width)
    return torch.cat([past, new_mask], dim=-1)[:, None]


def causal_mask(valid: torch.Tensor) -> torch.Tensor:
    """[B, S, S] bool: causal among the new entries, restricted to each row's valid ones.

    valid: [B, S] bool (False = padding). A padding query still sees itself, so no row is fully masked.
    """
    s = valid.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=valid.device).tril_()
    eye = torch.eye(s, dtype=torch.bool, device=valid.device)
    return (causal[None] & valid[:, None, :]) | eye[None]


def keep_new_(t: torch.Tensor, lengths: torch.Tensor, past_width: int, keep: torch.Tensor,
              n_keep: torch.Tensor, new_width: int) -> torch.Tensor:
    """Move the kept new entries of every row down to its valid prefix; return the trimmed view.

    t: [B, heads, P+S, d] after a forward that appended S entries at slot P = past_width.
    keep: [B, K] (K <= S) indices into the new entries; row b keeps `keep[b, :n_keep[b]]`, in order.
    Destination slots are `lengths[b] + i` for every i < K: distinct within a row, so the scatter is
    deterministic; the i >= n_keep[b] writes land at or beyond the row's new length, i.e. in garbage.
    Only K entries per row are copied, never the whole cache.
    """
    if keep.device != t.device:  # a target spread over several devices (device_map): each layer's own
        keep, lengths, n_keep = keep.to(t.device), lengths.to(t.device), n_keep.to(t.device)
    b, h, _, d = t.shape
    k = keep.shape[1]
    src = t.gather(2, (past_width + keep)[:, None, :, None].expand(b, h, k, d))  # [B, heads, K, d]
    dst = lengths[:, None] + torch.arange(k, device=lengths.device)[None, :]  # [B, K]
    t.scatter_(2, dst[:, None, :, None].expand(b, h, k, d), src)
    return t[:, :, :new_width]


@functools.lru_cache(maxsize=None)
def preallocated_layer_class():
    """A transformers `DynamicLayer` whose keys/values are views of a buffer with room to spare: a forward writes
    its new entries by index (gpt-fast's `KVCache.update`) instead of concatenating a fresh copy of the whole
    cache. The buffer grows by half when full (amortised O(1) copies per entry); a layer whose tensors were replaced
    (`select_rows_`, `merge_`) starts a new buffer from them."""
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        _kbuf = _vbuf = None

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            width = self.keys.shape[-2] if self.keys.numel() else 0
            need = width + key_states.shape[-2]
            if not self._owns(need, key_states.shape[0]):
                cap = need + max(need // 2, 64)  # 1.5x: amortised O(1) copies, at most half the cache spare
                kbuf = key_states.new_empty((*key_states.shape[:2], cap, key_states.shape[-1]))
                vbuf = value_states.new_empty((*value_states.shape[:2], cap, value_states.shape[-1]))
                if width:
                    kbuf[:, :, :width], vbuf[:, :, :width] = self.keys, self.values
                self._kbuf, self._vbuf = kbuf, vbuf
            self._kbuf[:, :, width:need] = key_states
            self._vbuf[:, :, width:need] = value_states
            self.keys, self.values = self._kbuf[:, :, :need], self._vbuf[:, :, :need]
            return self.keys, self.values

        def _owns(self, need: int, batch: int) -> bool:
            """The current keys/values are the start of this layer's buffers, which have room for `need`."""
            if self._kbuf is None or self._kbuf.shape[-2] < need or self._kbuf.shape[0] != batch:
                return False
            if not self.keys.numel():
                return True
            return (self.keys.data_ptr() == self._kbuf.data_ptr() and self.values.data_ptr() == self._vbuf.data_ptr()
                    and self.keys.stride() == self._kbuf.stride())

    return PreallocatedLayer


class TargetKV:
    """The target's KV cache: a transformers `DynamicCache` of preallocated layers plus the valid length of every
    row."""

    def __init__(self, batch_size: int, device):
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.cache.layer_class_to_replicate = preallocated_layer_class()  # one layer per decoder layer, lazily
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]

    @property
    def width(self) -> int:
        return self.cache.get_seq_length()

    def keep_new_(self, past_width: int, keep: torch.Tensor, n_keep: torch.Tensor) -> None:
        """After a forward that appended S entries at `past_width`: keep `keep[b, :n_keep[b]]` of them."""
        new_lengths = self.lengths + n_keep
        width = int(new_lengths.max())
        for layer in self.cache.layers:
            layer.keys = keep_new_(layer.keys, self.lengths, past_width, keep, n_keep, width)
            layer.values = keep_new_(layer.values, self.lengths, past_width, keep, n_keep, width)
        self.lengths = new_lengths

    def select_rows_(self, rows: torch.Tensor) -> None:
        """Drop finished sequences: keep batch rows `rows` ([B'] long), and trim the unused tail."""
        self.lengths = self.lengths[rows]
        width = int(self.lengths.max()) if rows.numel() else 0
        for layer in self.cache.layers:
            at = rows.to(layer.keys.device)
            layer.keys = layer.keys[at, :, :width]
            layer.values = layer.values[at, :, :width]

    def merge_(self, other: "TargetKV") -> None:
        """Append `other`'s rows after this cache's rows (new sequences join the batch)."""
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys, mine.values = pad_cat(mine.keys, theirs.keys), pad_cat(mine.values, theirs.values)
        self.lengths = torch.cat([self.lengths, other.lengths])


class DraftKV:
    """The draft's KV cache for the accepted prefix: one `(k, v)` pair [B, kv_heads, P, d] plus lengths."""

    def __init__(self, batch_size: int, device):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)

    @property
    def width(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def past(self):
        return None if self.k is None else (self.k, self.v)

    def append_and_keep_(self, new_kv, keep: torch.Tensor, n_keep: torch.Tensor) -> None:
        """Append a forward's new (k, v) [B, kv, S, d], then keep `keep[b, :n_keep[b]]` of them."""
        past_width = self.width
        k, v = new_kv
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        new_lengths = self.lengths + n_keep
        width = int(new_lengths.max())
        self.k = keep_new_(k, self.lengths, past_width, keep, n_keep, width)
        self.v = keep_new_(v, self.lengths, past_width, keep, n_keep, width)
        self.lengths = new_lengths

    def select_rows_(self, rows: torch.Tensor) -> None:
        self.lengths = self.lengths[rows]
        width = int(self.lengths.max()) if rows.numel() else 0
        if self.k is not None:
            self.k, self.v = self.k[rows, :, :width], self.v[rows, :, :width]

    def merge_(self, other: "DraftKV") -> None:
        """Append `other`'s rows after this cache's rows (both hold at least one entry per row)."""
        self.k, self.v = pad_cat(self.k, other.k), pad_cat(self.v, other.v)
        self.lengths = torch.cat([self.lengths, other.lengths])


def pad_cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Concatenate two caches [B, heads, W, d] along the batch, right-padding the narrower one.

    The padding slots lie beyond every row's length, where the ragged layout never attends.
    """
    width = max(a.shape[2], b.shape[2])
    pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[2]))  # noqa: E731
    return torch.cat([pad(a), pad(b)], dim=0)


def _cache_kwarg(decoder) -> str:
    return _cache_kwarg_of(type(decoder))


@functools.lru_cache(maxsize=None)
def _cache_kwarg_of(decoder_type) -> str:
    # transformers >= 5.2x renamed `past_key_values` to `cache` (the old name warns); accept both.
    params = inspect.signature(decoder_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def target_forward(target, kv: TargetKV, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   new_mask: torch.Tensor, aux_layer_ids: list[int] | None = None):
    """One target forward of S new tokens on top of the ragged cache (prefill, decode step or tree).

    input_ids, position_ids: [B, S]; new_mask: [B, S, S] bool (which new entries each new token sees).
    Returns (hidden [B, S, H] after the final norm, aux [B, S, 3H] or None). The S entries are appended
    at slots [P, P+S); the caller then keeps the committed ones with `kv.keep_new_`. The lm_head is left
    to the caller, which usually needs logits at a few positions only.
    """
    from eagle_core.target import record_hidden_states

    decoder = target.model
    bias = attention_bias(kv.lengths, kv.width, new_mask, decoder.embed_tokens.weight.dtype)
    with record_hidden_states(target, aux_layer_ids or []) as rec:
        out = decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=bias, use_cache=True,
                      **{_cache_kwarg(decoder): kv.cache})
    aux = torch.cat(rec["aux"], dim=-1) if aux_layer_ids else None
    return out.last_hidden_state.to(kv.lengths.device), aux  # a device-mapped target ends on its last device


def lm_logits(target, hidden: torch.Tensor) -> torch.Tensor:
    """The target's lm_head on `hidden`, returned on hidden's device (a device-mapped head may live elsewhere)."""
    return target.get_output_embeddings()(hidden).to(hidden.device)
