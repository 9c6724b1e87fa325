"""The static decoding path: the target's forward and steps, and the draft's loop, on caches allocated once.

Why (issue 39): on a GPU today's decode step (`eagle_core.kv`) is bound by Python and kernel launches, not by
memory: its cache views change shape every forward, buffers are reallocated, each round reads lengths back to the
host, and masks and capture hooks are registered per call. Here the target's cache, `StaticKV`, owns what a target
forward needs between rounds, and every step is a function of device tensors of fixed shapes that `torch.compile`
traces whole (`StaticConfig.compile`):

* per decoder layer, keys and values [rows, kv_heads, capacity, head_dim], allocated once and zero-filled, and
  every row's length, a device tensor [rows] (rows [0, batch) in use), changed in place: the layout, the row and
  width buckets and the keeps are `eagle_core.static_rows`' (`StaticRows`), shared with the draft's cache;
* the forward (`forward`): embeddings, rotary, the decoder layers each with its own kind's mask, the aux layers
  kept on the way, the final norm; no hooks, nothing registered per call;
* the steps: `plain_step`, and `verify` (tree forward, acceptance, keep of the path) on the tree padded to its
  `WIDTH_BUCKETS` width.

The draft's cache, `StaticDraftKV`, has the same layout and runs the whole draft loop of a round as one step
(`draft_tree`).

What does not fit falls back to the eager caches (`to_eager`, `eagle_core.decoding.DecodingState`). Families: every
family of the decoder's matrix (`STATIC_FAMILIES`: Llama's loop plus Granite's embedding multiplier and Gemma 3's
rotary per layer type); others, and targets spread over several devices, raise `UnsupportedTarget` and keep the
eager path.
"""

from __future__ import annotations

import inspect
import logging

import torch

from eagle_core.attention import layer_rules, our_attention, to_bias, within_span
from eagle_core.families import UnsupportedTarget, check_temperature_tuning, family_name
from eagle_core.kv import DraftKV, TargetKV, lm_logits
from eagle_core.static_rows import StaticConfig, StaticRows, first_rows, pad_rows, verify_width
from eagle_core.tree import Tree, TreeConfig, _grow
from eagle_core.verify import Acceptance, SamplingConfig, accept, sample_next, seed_tensor

# Model types whose decoder forward `StaticKV._forward` reproduces (tests/test_static_cache.py holds each against the
# eager path): embeddings -> rotary(position_ids) -> layers(mask of the layer's kind, position embeddings, cache) ->
# final norm, with the few steps some families add around their layers (`StaticKV.__init__`): Granite's embedding
# multiplier; Gemma 3's rotary per layer type. What the rest add lives in modules the loop calls: Gemma's scaled
# embeddings (sqrt(hidden) in the embedding's dtype) in its embedding, Gemma 2's attention soft-cap in its
# attention (eager: transformers gives it no SDPA), Granite's residual and attention multipliers in its layers,
# Llama 4's no-RoPE and qk-norm in its attention, the logit scaling and final soft-cap in `lm_logits`. Llama 4's
# temperature tuning is 1 below its bound, which the static cache keeps to as the eager one does (`no_room`).
STATIC_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "phi3", "olmo2", "gpt_oss", "gemma2",
                             "gemma3_text", "granite", "llama4_text"})

log = logging.getLogger(__name__)


def padded_tree(tree: Tree, width: int, rows: int | None = None) -> Tree:
    """`tree` [B, N] as the verify step sees it: width - N padding nodes after its own (token 0 at depth 0, parent
    the root, each seeing the committed prefix and itself only), its draft size the width and nothing else (no
    score, no context chain), so trees of one width trace alike. A padding node is never accepted (depth 0 never
    deepens a path: the root, first, wins the tie), so never kept, and no real node sees one; `forward_tokens`
    clamps a context chain's NO_TOKEN slots as before, and acceptance still reads them as unacceptable. `rows`:
    padding rows after the batch's (`pad_rows`; default none)."""
    b, n = tree.tokens.shape
    rows = rows or b
    zeros = tree.tokens.new_zeros(b, max(width - n, 0))
    ancestors = torch.zeros(b, width, width, dtype=torch.bool, device=tree.tokens.device)
    ancestors[:, :n, :n] = tree.ancestors
    ancestors[:, n:, n:] = torch.eye(width - n, dtype=torch.bool, device=tree.tokens.device)
    return Tree(tokens=pad_rows(torch.cat([tree.tokens, zeros], 1), rows),
                parents=pad_rows(torch.cat([tree.parents, zeros], 1), rows),
                depth=pad_rows(torch.cat([tree.depth, zeros], 1), rows), ancestors=pad_rows(ancestors, rows),
                rank=pad_rows(torch.cat([tree.rank, zeros], 1), rows), draft_size=width)


def _padded_seeds(seeds, rows: int, device) -> torch.Tensor | None:
    return None if seeds is None else pad_rows(seed_tensor(seeds, device), rows)


class StaticKV(StaticRows):
    """The target's static KV cache and its forward (module docstring). Offers `TargetKV`'s interface (`lengths`,
    `width`, `keep_new_`, `truncate_`, `select_rows_`, `merge_`), so `eagle_core.decoding` runs on either."""

    def __init__(self, target, batch_size: int, config: StaticConfig | None = None):
        config = config or StaticConfig()
        tc = target.config
        if getattr(tc, "model_type", None) not in STATIC_FAMILIES:
            raise UnsupportedTarget(f"{family_name(tc)}: the static decoding path does not reproduce this family's "
                                    "forward; it decodes eagerly")
        if len({p.device for p in target.parameters()}) != 1:
            raise UnsupportedTarget("a target spread over several devices decodes eagerly (static path: one device)")
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        shape = (max(batch_size, config.rows), tc.num_key_value_heads, config.capacity, head_dim)
        super().__init__(tc.num_hidden_layers, shape, target.get_input_embeddings().weight, batch_size, config)
        self.target = target
        self.rules, _, self.tuning_limit = layer_rules(tc)
        self.kinds = tuple(dict.fromkeys(self.rules))  # the distinct rules, in layer order
        # What a family's decoder forward adds around its layers (the rest lives in the modules `_forward` calls):
        # Granite multiplies its embeddings; Gemma 3 rotates each layer type by its own rotary embedding.
        decoder = target.model
        self.embedding_multiplier = getattr(decoder, "embedding_multiplier", None)
        rotary_args = inspect.signature(decoder.rotary_emb.forward).parameters
        self.rotary_types = tuple(tc.layer_types[: tc.num_hidden_layers]) if "layer_type" in rotary_args else None
        # The name a decoder layer takes its cache by: `past_key_values` up to transformers 5.19 (what vLLM 0.32's
        # pin allows), `cache` in later releases; the layer forwards it to the attention's cache update either way.
        layer_args = inspect.signature(type(decoder.layers[0]).forward).parameters
        self.cache_keyword = "cache" if "cache" in layer_args else "past_key_values"
        self._plain = self._compiled(self._plain_step, "plain step")
        self._verify = self._compiled(self._verify_step, "verify step")

    def to_eager(self, reason: str | None = None) -> TargetKV:
        """The same rows and entries in a growing `TargetKV`, where decoding goes on eagerly: what the static
        cache cannot hold (a longer context, a wider tree, more rows) falls back there. `reason`: logged, once per
        cache that falls back. The eager cache is as wide as its longest row, as a growing one always is between
        steps (the host's `width` is only a bound): the bounds it checks (Llama 4's) are met where they are today."""
        if reason:
            log.warning("static decoding falls back to eager: %s", reason)
        kv = TargetKV(self.batch, self._lengths.device)
        width = int(self.lengths.max()) if self.batch else 0
        for i, (keys, values) in enumerate(zip(self.keys, self.values)):  # `write_at` copies them
            kv.cache.update(keys[: self.batch, :, :width], values[: self.batch, :, :width], i)
        kv.lengths = self.lengths.clone()
        return kv

    def no_room(self, n_new: int) -> str | None:
        """`StaticRows.no_room`, and Llama 4's temperature-tuning bound: its no-RoPE layers scale queries by the
        cache length (`get_seq_length`), by exactly 1 below the bound, past which the eager path refuses
        (`check_temperature_tuning`); `DecodingState` hands the batch to it there, so it refuses at today's token."""
        if self.tuning_limit is not None and self.width + n_new > self.tuning_limit:
            return (f"{n_new} new entries past the {self.width} slots in use go past Llama 4's temperature-tuning "
                    f"bound ({self.tuning_limit} tokens)")
        return super().no_room(n_new)

    def _reserve(self, n_new: int) -> None:
        check_temperature_tuning(self.tuning_limit, self.width + n_new)  # the eager path's refusal, called directly
        super()._reserve(n_new)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The transformers cache call of Llama 4's no-RoPE layers: their temperature tuning scales the queries at
        positions get_seq_length() + [0, S) by 1 + attn_scale * log1p((position + 1) // floor_scale), exactly 1
        for every position below `temperature_tuning_limit`, to which `_reserve` holds every forward: 0 gives the
        same scale and one traced graph."""
        return 0

    @torch.no_grad()  # decoding: no autograd graph through the buffers, whatever the caller's mode
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, new_mask: torch.Tensor,
                aux_layer_ids: list[int] | None = None):
        """`eagle_core.kv.target_forward` on this cache: (hidden [B, S, H] after the final norm, aux [B, S, 3H] or
        None); the S entries are written at each row's slots [lengths[b], lengths[b] + S)."""
        self._reserve(input_ids.shape[1])
        with our_attention(self.target.model):
            return self._forward(input_ids, position_ids, new_mask, tuple(aux_layer_ids or ()))

    @torch.no_grad()  # decoding: no autograd graph through the buffers, whatever the caller's mode
    def plain_step(self, token: torch.Tensor, sampling: SamplingConfig, seeds=None,
                   aux_layer_ids: list[int] | None = None):
        """`eagle_core.decoding.plain_step` on this cache: token [B] -> (next token [B], aux [B, 1, 3H] or None),
        through the compiled step when `StaticConfig.compile` is set."""
        self._reserve(1)
        with self._padded_rows() as (b, rows), our_attention(self.target.model):
            out, aux = self._plain(pad_rows(token, rows), sampling, _padded_seeds(seeds, rows, token.device),
                                   tuple(aux_layer_ids or ()))
        self.width += 1
        return out[:b], None if aux is None else aux[:b]

    @torch.no_grad()  # decoding: no autograd graph through the buffers, whatever the caller's mode
    def verify(self, tree, sampling: SamplingConfig, seeds, aux_layer_ids: list[int] | None,
               levels: int) -> tuple[Acceptance, torch.Tensor | None]:
        """One tree round's target work in one step: the forward over the flattened tree, acceptance (on every
        node's logits: `accept`) and the keep of the accepted path. levels: at least the tree's depth + 1, at most
        its size (the accepted path's width, known on the host: nothing is read back from the device). The tree is
        padded to its `WIDTH_BUCKETS` width and the batch to its `ROW_BUCKETS` rows (`padded_tree`). Returns
        (acceptance, aux [B, N, 3H] or None)."""
        n = tree.size
        self._reserve(verify_width(n))
        with self._padded_rows() as (b, rows), our_attention(self.target.model):
            padded = padded_tree(tree, verify_width(n), rows)
            acc, aux = self._verify(padded, sampling, _padded_seeds(seeds, rows, tree.tokens.device),
                                    tuple(aux_layer_ids or ()), levels)
        self.width += levels
        return first_rows(acc, b), None if aux is None else aux[:b, :n]

    # ---- device work: tensors of fixed shapes only (what a compiled step traces) --------------------------------

    def _plain_step(self, token, sampling, seeds, aux_layer_ids):
        b = token.shape[0]
        lengths = self._lengths[:b]
        ones = torch.ones(b, 1, 1, dtype=torch.bool, device=token.device)
        hidden, aux = self._forward(token[:, None], lengths[:, None], ones, aux_layer_ids)
        positions = lengths + 1  # where the next token is drawn
        lengths += 1  # the step's entry was written at slot lengths[b]: it is kept where it is
        return sample_next(lm_logits(self.target, hidden[:, 0]), sampling, seeds, positions), aux

    def _verify_step(self, tree, sampling, seeds, aux_layer_ids, levels: int):
        lengths = self._lengths[: tree.tokens.shape[0]]
        root_positions = lengths.clone()  # the keep below moves the lengths
        hidden, aux = self._forward(tree.forward_tokens(), lengths[:, None] + tree.depth, tree.ancestors,
                                    aux_layer_ids)
        acc = accept(tree, lm_logits(self.target, hidden), sampling, seeds, root_positions, levels)
        self._keep(acc.path, acc.accept_length + 1)
        return acc, aux

    def _forward(self, input_ids, position_ids, new_mask, aux_layer_ids: tuple):
        decoder, types = self.target.model, self.rotary_types
        hidden = decoder.embed_tokens(input_ids)
        if self.embedding_multiplier is not None:
            hidden = hidden * self.embedding_multiplier
        masks = self._masks(position_ids, new_mask, hidden.dtype)
        if types is None:
            rotary = decoder.rotary_emb(hidden, position_ids)
        else:
            rotary = {t: decoder.rotary_emb(hidden, position_ids, t) for t in dict.fromkeys(types)}
        kept = {0: hidden}  # aux id j: the output of decoder layer j - 1 (0: the embeddings)
        for i, layer in enumerate(decoder.layers[: self.target.config.num_hidden_layers]):
            hidden = layer(hidden, attention_mask=masks[self.rules[i]],
                           position_embeddings=rotary if types is None else rotary[types[i]],
                           position_ids=position_ids, use_cache=True, **{self.cache_keyword: self})
            if i + 1 in aux_layer_ids:
                kept[i + 1] = hidden
        aux = torch.cat([kept[j] for j in aux_layer_ids], dim=-1) if aux_layer_ids else None
        return decoder.norm(hidden), aux

    def _masks(self, position_ids: torch.Tensor, new_mask: torch.Tensor, dtype) -> dict:
        """{rule: additive mask [B, 1, S, attend_width]}: `_allowed`, within each query's window or chunk
        (committed slot s is position s, new entry j is position_ids[b, j])."""
        allowed, committed, j = self._allowed(new_mask)
        slot = torch.arange(self.attend_width, device=position_ids.device)[None, :]
        key_pos = torch.where(committed, slot, position_ids.gather(1, j))  # [B, W]
        masks = {}
        for rule in self.kinds:
            inside = within_span(rule, position_ids, key_pos)
            masks[rule] = to_bias((allowed if inside is None else allowed & inside)[:, None], dtype)
        return masks

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """The transformers cache call inside each attention: `_write` (the forward's entries at every row's slots
        [lengths[b], lengths[b] + S)), the slots attention reads back."""
        return self._write(layer_idx, key_states, value_states)


class StaticDraftKV(StaticRows):
    """The draft's cache on the static layout (`DraftKV`'s interface, one layer): a forward's entries are written
    past the row's committed and pending ones (`update`, the draft forward's `past_kv`), a tree's levels stay
    pending until `truncate_` drops them, `keep_new_` keeps the committed ones in place."""

    def __init__(self, draft, batch_size: int, config: StaticConfig | None = None):
        config = config or StaticConfig()
        dc = draft.config
        shape = (max(batch_size, config.rows), dc.num_key_value_heads, config.capacity, dc.head_dim)
        super().__init__(1, shape, draft.get_parameter("fc.weight"), batch_size, config)
        self.reserved = False  # while `draft_tree` runs: the levels' slots were chosen once, on the host
        self._grow = self._compiled(_grow, "draft loop")

    def draft_tree(self, draft, root_hidden: torch.Tensor, root: torch.Tensor, tree: TreeConfig) -> Tree:
        """`eagle_core.tree.draft_tree` on this cache, the whole loop (levels, top-k, rerank, ancestor matrix) one
        step of fixed shapes: the slots of every level are reserved here, so nothing in it reads the host's
        bookkeeping or the device; compiled where `StaticConfig.compile` says; on the batch's `ROW_BUCKETS` rows
        (`_padded_rows`). The levels are dropped after."""
        self._reserve((tree.depth - 1) * tree.top_k)
        self.reserved = True
        try:
            with torch.no_grad(), self._padded_rows() as (b, rows):
                grown = self._grow(draft, self, pad_rows(root_hidden, rows), pad_rows(root, rows), tree, 0)
            return first_rows(grown, b)
        finally:
            self.reserved, self.pending = False, 0

    def attention_mask(self, past_width, new_mask: torch.Tensor) -> torch.Tensor:
        """Bool [B, 1, S, attend_width] for a draft forward whose new_mask [B, S, E] covers the E entries past the
        committed ones once it has written (the pending ones, then its own S); `past_width` is `DraftKV`'s and
        unused. Chooses the slots the forward's `update` returns, unless `draft_tree` chose them for every level."""
        if not self.reserved:
            self._reserve(new_mask.shape[-1])
        return self._allowed(new_mask)[0][:, None]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._write(0, k, v)
        self.pending += k.shape[2]
        return keys, values

    def to_eager(self) -> DraftKV:
        """The same rows and entries in a growing `DraftKV` (`StaticKV.to_eager`'s, for the draft)."""
        dkv = DraftKV(self.batch, self._lengths.device)
        dkv.update(self.keys[0][: self.batch, :, : self.width], self.values[0][: self.batch, :, : self.width])
        dkv.lengths = self.lengths.clone()
        return dkv
