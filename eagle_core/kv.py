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
serve the target (a transformers `DynamicCache` of preallocated layers) and the draft (`DraftKV`, its one
layer, passed to the draft forward as `past_kv`): a forward writes its entries by index into a buffer with
spare room (`write_at`), and `keep_new_` rewrites the buffer in place.
"""

from __future__ import annotations

import functools
import inspect

import torch

from eagle_core.attention import attention_allowed, forward_masks, layer_rules, our_attention, per_layer_masks


def kept_slots(lengths: torch.Tensor, past_width: int, keep: torch.Tensor) -> tuple:
    """Where the kept new entries move: (rows, src, dst), each [B, K], on keep's device.

    After a forward that appended S entries at slot P = past_width, row b keeps `keep[b, :n_keep[b]]` (K <= S
    indices into the new entries), in order: entry i moves from slot P + keep[b, i] to lengths[b] + i. The
    destinations are distinct within a row; those with i >= n_keep[b] land at or beyond the row's new length,
    i.e. in garbage, so every row moves K entries and no count is needed.
    """
    rows = torch.arange(keep.shape[0], device=keep.device)[:, None].expand_as(keep)
    dst = lengths.to(keep.device)[:, None] + torch.arange(keep.shape[1], device=keep.device)[None, :]
    return rows, past_width + keep, dst


def keep_plan(lengths: torch.Tensor, past_width: int, keep: torch.Tensor, n_keep: torch.Tensor) -> tuple:
    """(new lengths [B], new width, `kept_slots` or None) for keeping `keep[b, :n_keep[b]]` of the new entries.

    None: every row was full (lengths == past_width) and keeps a prefix of its new entries (a plain step; a round
    that accepted nothing or the first-ranked chain; the draft's catch-up, at batch 1), so they already sit where
    they belong and nothing moves. Measured on SmolLM2's 30 layers (2-core CPU, bf16 steps of ~25 ms): moving one
    entry onto itself cost 2.5 ms per step by gather and scatter, 0.45 ms by advanced indexing (`keep_new_`); not
    moving it, 0.13 ms. One host sync either way, for the new width."""
    new_lengths = lengths + n_keep
    slot = torch.arange(keep.shape[1], device=keep.device)[None, :]
    prefix = ((keep == slot) | (slot >= n_keep[:, None])).all()
    width, shortest, in_place = torch.stack([new_lengths.max(), lengths.min(), prefix.long()]).tolist()
    return new_lengths, width, None if in_place and shortest == past_width else kept_slots(lengths, past_width, keep)


def keep_new_(t: torch.Tensor, slots: tuple, new_width: int) -> torch.Tensor:
    """Move the kept new entries of every row of t [B, heads, P+S, d] down to its valid prefix (`kept_slots`)
    and return the trimmed view. Only K entries per row are copied, never the whole cache: one advanced-index
    read and write per tensor (4x cheaper on CPUs than a gather and scatter through expanded indices, whose
    setup dominates at these sizes)."""
    rows, src, dst = slots
    if rows.device != t.device:  # a target spread over several devices (device_map): each layer's own
        rows, src, dst = rows.to(t.device), src.to(t.device), dst.to(t.device)
    t[rows, :, dst] = t[rows, :, src]  # the right side is read before anything is written
    return t[:, :, :new_width]


def write_at(buf: torch.Tensor | None, width: int, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write `new` [B, heads, S, d] at slots [width, width + S) of a cache buffer (gpt-fast's `KVCache.update`).

    buf: None or [B, heads, capacity, d] whose first `width` slots are kept. When it is missing or too small, a
    new buffer with half again the room it needs is allocated and those slots are copied over (amortised O(1)
    copies per entry, at most a third of the buffer spare). Returns (buffer, view of its slots [0, width + S)).
    """
    need = width + new.shape[-2]
    if buf is None or buf.shape[-2] < need or buf.shape[0] != new.shape[0]:
        grown = new.new_empty((*new.shape[:2], need + max(need // 2, 64), new.shape[-1]))
        if width:
            grown[:, :, :width] = buf[:, :, :width]
        buf = grown
    buf[:, :, width:need] = new
    return buf, buf[:, :, :need]


def _is_start_of(view: torch.Tensor, buf: torch.Tensor | None) -> bool:
    """`view` is the first slots of `buf` (not a tensor that replaced it: `select_rows_`, `merge_`)."""
    return (buf is not None and view.numel() > 0 and view.data_ptr() == buf.data_ptr()
            and view.stride() == buf.stride() and view.shape[0] == buf.shape[0])


@functools.lru_cache(maxsize=None)
def preallocated_layer_class():
    """A transformers `DynamicLayer` whose keys/values are views of a buffer with room to spare: a forward writes
    its new entries by index (`write_at`) instead of concatenating a fresh copy of the whole cache. A layer whose
    tensors were replaced (`select_rows_`, `merge_`) starts a new buffer from them."""
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        _kbuf = _vbuf = None

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            width = self.keys.shape[-2] if self.keys.numel() else 0
            if not (_is_start_of(self.keys, self._kbuf) and _is_start_of(self.values, self._vbuf)):
                self._kbuf, self._vbuf = (self.keys, self.values) if width else (None, None)
            self._kbuf, self.keys = write_at(self._kbuf, width, key_states)
            self._vbuf, self.values = write_at(self._vbuf, width, value_states)
            return self.keys, self.values

    return PreallocatedLayer


class TargetKV:
    """The target's KV cache: a transformers `DynamicCache` of preallocated layers plus the valid length of every
    row; optionally (`features`, off by default) the features of the committed tokens, kept by the same `keep_new_`
    that keeps their cache entries (`eagle_core.capture.CommittedFeatures`)."""

    def __init__(self, batch_size: int, device, features=None):
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.cache.layer_class_to_replicate = preallocated_layer_class()  # one layer per decoder layer, lazily
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]
        self.features = features  # CommittedFeatures or None

    @property
    def width(self) -> int:
        return self.cache.get_seq_length()

    def keep_new_(self, past_width: int, keep: torch.Tensor, n_keep: torch.Tensor) -> None:
        """After a forward that appended S entries at `past_width`: keep `keep[b, :n_keep[b]]` of them (moved
        only where they do not already sit in place: `keep_plan`)."""
        new_lengths, width, slots = keep_plan(self.lengths, past_width, keep, n_keep)
        if self.features is not None:  # the kept entries are committed tokens: so are their features
            self.features.keep_(keep, n_keep)
        for layer in self.cache.layers:
            if slots is None:
                layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]
            else:
                layer.keys = keep_new_(layer.keys, slots, width)
                layer.values = keep_new_(layer.values, slots, width)
        self.lengths = new_lengths

    def truncate_(self, width: int) -> None:
        """Forget every slot from `width` on (rows' lengths capped at it); the layers stay views of their buffers,
        so the next forward writes in place again (the timing loops roll a cache back with this)."""
        self.lengths = self.lengths.clamp(max=width)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]

    def select_rows_(self, rows: torch.Tensor) -> None:
        """Drop finished sequences: keep batch rows `rows` ([B'] long), and trim the unused tail."""
        self.lengths = self.lengths[rows]
        width = int(self.lengths.max()) if rows.numel() else 0
        if self.features is not None:
            self.features.select_rows_(rows.tolist())
        for layer in self.cache.layers:
            at = rows.to(layer.keys.device)
            layer.keys = layer.keys[at, :, :width]
            layer.values = layer.values[at, :, :width]

    def merge_(self, other: "TargetKV") -> None:
        """Append `other`'s rows after this cache's rows (new sequences join the batch).

        Every new tensor is built before any is assigned: a merge that fails (out of memory, a mismatch) leaves
        this cache exactly as it was, so only the joining rows fail, not the running ones."""
        if len(self.cache.layers) != len(other.cache.layers):
            raise ValueError(f"cannot merge a {len(other.cache.layers)}-layer cache into a "
                             f"{len(self.cache.layers)}-layer one")
        if (self.features is None) != (other.features is None):
            raise ValueError("cannot merge a cache that captures features with one that does not")
        merged = [(pad_cat(mine.keys, theirs.keys), pad_cat(mine.values, theirs.values))
                  for mine, theirs in zip(self.cache.layers, other.cache.layers)]
        lengths = torch.cat([self.lengths, other.lengths])
        for layer, (keys, values) in zip(self.cache.layers, merged):
            layer.keys, layer.values = keys, values
        self.lengths = lengths
        if self.features is not None:
            self.features.merge_(other.features)


class DraftKV:
    """The draft's KV cache: one layer's keys and values [B, kv_heads, width, d] plus every row's valid length.

    Laid out like the target's (rows' committed entries in slots [0, lengths[b]), the rest garbage) and, like
    it, views of buffers with room to spare written by index: the draft forward appends its entries through
    `update` (the cache is its `past_kv`), `keep_new_` keeps the committed ones in place, and `truncate_` drops
    what a tree's levels appended. No call copies the cache, except `select_rows_` / `merge_`.
    """

    def __init__(self, batch_size: int, device):
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        self.width = 0  # slots in use, for every row
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)

    @property
    def k(self) -> torch.Tensor | None:
        return None if self._kbuf is None else self._kbuf[:, :, :self.width]

    @property
    def v(self) -> torch.Tensor | None:
        return None if self._vbuf is None else self._vbuf[:, :, :self.width]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a forward's new (k, v) [B, kv, S, d] at slots [width, width + S); return the whole cache."""
        self._kbuf, keys = write_at(self._kbuf, self.width, k)
        self._vbuf, values = write_at(self._vbuf, self.width, v)
        self.width += k.shape[2]
        return keys, values

    def attention_mask(self, past_width: int, new_mask: torch.Tensor) -> torch.Tensor:
        """Bool [B, 1, S, width] for a draft forward whose new_mask [B, S, E] covers the E entries from slot
        `past_width` on once it has written (a tree's earlier levels, then its own S): `attention_allowed`."""
        return attention_allowed(self.lengths, past_width, new_mask)

    def keep_new_(self, past_width: int, keep: torch.Tensor, n_keep: torch.Tensor) -> None:
        """After a forward that appended S entries at `past_width`: keep `keep[b, :n_keep[b]]` of them."""
        new_lengths, width, slots = keep_plan(self.lengths, past_width, keep, n_keep)
        if slots is not None:
            keep_new_(self.k, slots, width)  # in place, in the buffers
            keep_new_(self.v, slots, width)
        self.width, self.lengths = width, new_lengths

    def truncate_(self, width: int) -> None:
        """Forget every slot from `width` on (a tree's entries, appended past the committed ones)."""
        self.width = width

    def select_rows_(self, rows: torch.Tensor) -> None:
        self.lengths = self.lengths[rows]
        width = int(self.lengths.max()) if rows.numel() else 0
        if self._kbuf is not None:
            self._kbuf, self._vbuf = self._kbuf[rows, :, :width], self._vbuf[rows, :, :width]
            self.width = width

    def merge_(self, other: "DraftKV") -> None:
        """Append `other`'s rows after this cache's rows (both hold at least one entry per row). The new tensors
        are built before any is assigned, so a failed merge leaves this cache as it was."""
        kbuf, vbuf = pad_cat(self.k, other.k), pad_cat(self.v, other.v)
        lengths = torch.cat([self.lengths, other.lengths])
        self._kbuf, self._vbuf, self.width, self.lengths = kbuf, vbuf, kbuf.shape[2], lengths


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
    to the caller, which usually needs logits at a few positions only. A cache that captures features
    (`kv.features`) also gets this forward's, for `keep_new_` to keep (its layers recorded too where the caller's
    `aux_layer_ids` lack them).
    """
    from eagle_core.families import check_temperature_tuning
    from eagle_core.capture import record_hidden_states

    if not isinstance(kv, TargetKV):  # a static cache (`eagle_core.static_kv.StaticKV`) owns its forward
        return kv.forward(input_ids, position_ids, new_mask, aux_layer_ids)
    decoder = target.model
    check_temperature_tuning(layer_rules(target.config)[2], kv.width + input_ids.shape[1])
    bias, masks, rules = forward_masks(target.config, attention_allowed(kv.lengths, kv.width, new_mask), position_ids,
                                       decoder.embed_tokens.weight.dtype)
    recorded = list(aux_layer_ids or [])
    if kv.features is not None:  # the capture's layers too, each hooked once
        recorded += [j for j in kv.features.aux_layer_ids if j not in recorded]
    with record_hidden_states(target, recorded) as rec, our_attention(decoder), \
            per_layer_masks(decoder, rules, masks):
        out = decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=bias, use_cache=True,
                      **{_cache_kwarg(decoder): kv.cache})
    hidden = out.last_hidden_state.to(kv.lengths.device)  # a device-mapped target ends on its last device
    aux = torch.cat(rec["aux"][:len(aux_layer_ids)], dim=-1) if aux_layer_ids else None
    if kv.features is not None:
        layer = dict(zip(recorded, rec["aux"]))
        kv.features.record_(hidden, torch.cat([layer[j] for j in kv.features.aux_layer_ids], dim=-1))
    return hidden, aux


def lm_logits(target, hidden: torch.Tensor) -> torch.Tensor:
    """The target's lm_head on `hidden`, on hidden's device (a device-mapped head may live elsewhere), in float32
    at least.

    A bf16/fp16 head's logits are upcast as transformers' `generate` does: the same values (exact in float32),
    so the same argmax, and on CPUs an argmax over 16 rows of a 49k vocab costs ~0.5 ms in float32 against
    ~2 ms in bf16; sampling filters and softmaxes in float32 too. float64 (the exactness tests) stays."""
    logits = target.get_output_embeddings()(hidden)
    config = target.config
    # What the target's own causal-LM forward does after its lm_head (the sampling distribution depends on it):
    if getattr(config, "logits_scaling", None) not in (None, 1, 1.0):  # Granite divides
        logits = logits / config.logits_scaling
    if getattr(config, "logit_scale", None) not in (None, 1, 1.0):  # Cohere multiplies
        logits = logits * config.logit_scale
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:  # Gemma 2: tanh soft-capping
        logits = torch.tanh(logits / cap) * cap
    return logits.to(device=hidden.device, dtype=torch.promote_types(logits.dtype, torch.float32))
