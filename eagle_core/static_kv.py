"""The static decoding path: KV caches allocated once and written by index, and the steps that run on them.

Why (issue 39): on a GPU today's decode step (`eagle_core.kv`) is bound by Python and kernel launches, not by
memory: its cache views change shape every forward, buffers are reallocated, each round reads lengths back to the
host, and masks and capture hooks are registered per call. Here the target's cache, `StaticKV`, owns what a target
forward needs between rounds, and every step is a function of device tensors of fixed shapes that `torch.compile`
traces whole (`StaticConfig.compile`):

* per decoder layer, keys and values [rows, kv_heads, capacity, head_dim], allocated once and zero-filled;
* every row's length, a device tensor [rows] (rows [0, batch) in use), changed in place;
* the forward (`forward`): embeddings, rotary, the decoder layers each with its own kind's mask, the aux layers
  kept on the way, the final norm; no hooks, nothing registered per call;
* the steps: `plain_step`, and `verify` (tree forward, acceptance, keep of the path) on the tree padded to its
  `WIDTH_BUCKETS` width.

Every step (and the draft loop) runs on the batch's `ROW_BUCKETS` rows (`step_rows`: at most the rows allocated):
padding rows are spare rows, emptied (length 0) before the step and fed copies of the last real row's inputs, so
they write only slots [0, S) of their own rows, which no row owns, and what they compute is cut off. Rows leaving
and joining within one bucket change no shape a compiled step sees.

The draft's cache, `StaticDraftKV`, has the same layout (both share `StaticRows`) and runs the whole draft loop of a
round as one step (`draft_tree`).

Layout: row b's committed entries occupy slots [0, lengths[b]) and slot s holds position s (as in `eagle_core.kv`).
A forward of S new tokens writes them at slots [lengths[b], lengths[b] + S) of each row (a scatter: rows write at
their own slots; a draft tree's later levels after its earlier ones) with the positions the caller gives;
`keep_new_` moves the kept ones down to [lengths[b], lengths[b] + n_keep[b]) in place and adds n_keep to the
lengths. A plain step's one entry already sits where it is kept: the step only adds 1. Nothing is reallocated:
every buffer keeps the `data_ptr()` of its allocation across rounds, row selections (`select_rows_`) and merges
(`merge_`).

Attention reads the first `attend_width` slots of every buffer: a multiple of `bucket` at least the host's bound on
the longest row plus what the forward adds, so a compiled step sees the same shapes until the bucket changes. Slots
a row does not own are masked out, so what they hold changes no token (the tests write garbage there); it must only
be finite (a NaN times a zero weight is NaN), which zero-filled buffers written with the model's own keys are.

The host keeps a few ints per cache (`width`: an upper bound on the longest row, advanced by what a keep may add,
its K; `pending`; `attend_width`), never read from the device. What does not fit falls back to the eager caches
(`to_eager`, `eagle_core.decoding.DecodingState`). Families: every family of the decoder's matrix
(`STATIC_FAMILIES`: Llama's loop plus Granite's embedding multiplier and Gemma 3's rotary per layer type); others,
and targets spread over several devices, raise `UnsupportedTarget` and keep the eager path.
"""

from __future__ import annotations

import inspect
import logging
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Callable

import torch

from eagle_core.attention import layer_rules, our_attention, to_bias, within_span
from eagle_core.families import UnsupportedTarget, check_temperature_tuning, family_name
from eagle_core.kv import DraftKV, TargetKV, lm_logits
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

# A verified tree is padded to the first of these node counts it fits: trees of one bucket share one compiled verify
# step (a context chain's length, a draft's size vary from round to round). `DecodingState` hands a wider verify to
# the eager cache; called directly, a wider one runs at its own width.
WIDTH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64)
# A batch's compiled steps run on the first of these row counts it fits (at most the rows allocated): rows leaving
# and joining inside one bucket change no shape the steps see. `DecodingState` hands a larger batch to the eager cache.
ROW_BUCKETS = (1, 2, 4, 8, 16)


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    return next((w for w in buckets if w >= n), n)


def verify_width(n: int) -> int:
    """The node count a tree of n nodes is verified at: its `WIDTH_BUCKETS` width, or n past the widest (>= n)."""
    return _bucket(n, WIDTH_BUCKETS)


def step_rows(n: int, allocated: int) -> int:
    """The rows the steps of a batch of n rows run on: its `ROW_BUCKETS` bucket, at most the `allocated` rows of
    its buffers (>= n), or n past the largest bucket."""
    return min(_bucket(n, ROW_BUCKETS), max(n, allocated))


def pad_rows(x: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """x [B, ...] with rows - B padding rows after its own, copies of its last (valid ids, finite values: what a
    padding row computes is never read back); None stays None."""
    if x is None or x.shape[0] == rows:
        return x
    return torch.cat([x, x[-1:].expand(rows - x.shape[0], *x.shape[1:])])


def _first_rows(out, b: int):
    """A step's output (a `Tree`, an `Acceptance`) with its tensors cut to the batch's b real rows."""
    return replace(out, **{f.name: getattr(out, f.name)[:b] for f in fields(out)
                           if isinstance(getattr(out, f.name), torch.Tensor)})


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


class CacheFull(RuntimeError):
    """A forward would write past the cache's capacity (slots per row) or a merge past its rows."""


@dataclass
class StaticConfig:
    capacity: int = 2048  # slots per row: prompt, answer and one verify's tree
    rows: int = 0  # batch rows allocated (0: the prefill's batch); merges fill the spare ones
    bucket: int = 64  # attention reads a multiple of this many slots: one compiled shape per bucket
    # Wraps the plain step, the verify step and the draft loop once each (e.g. `lambda f: torch.compile(f,
    # fullgraph=True)`); None: eager.
    compile: Callable | None = None


class StaticRows:
    """Preallocated cache tensors of one or more layers and every row's length, changed in place only: what the
    target's `StaticKV` and the draft's `StaticDraftKV` share (writes, keeps, rows leaving and joining).

    `pending` (host): entries written past the committed ones since the last keep (a draft tree's levels); row
    b's pending entry e sits at slot lengths[b] + e."""

    def __init__(self, layers: int, shape: tuple, weight: torch.Tensor, batch_size: int, config: StaticConfig):
        self.keys = [torch.zeros(shape, dtype=weight.dtype, device=weight.device) for _ in range(layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self._lengths = torch.zeros(shape[0], dtype=torch.long, device=weight.device)  # [rows]
        for t in self.buffers():  # a compiled step may rely on their addresses (CUDA graphs read and write them)
            torch._dynamo.mark_static_address(t)
        self.batch, self.config = batch_size, config
        self.width = 0  # host: upper bound on every row's length
        self.pending = 0
        self.attend_width = 0  # slots the current forward's attention reads

    @property
    def lengths(self) -> torch.Tensor:
        """[B] the rows' lengths: a view of the cache's own tensor, changed in place by every keep (inside a step,
        `_padded_rows`, the bucket's rows)."""
        return self._lengths[: self.batch]

    @contextmanager
    def _padded_rows(self):
        """While a step runs on the batch's row bucket (`step_rows`): the cache acts as a batch of that many rows,
        the padding ones (spare rows [batch, bucket)) emptied first (length 0), so that they see and write only
        slots [0, S) of their own rows, which no row owns. Yields (the batch's rows, the bucket's)."""
        b = self.batch
        rows = step_rows(b, self._lengths.shape[0])
        self._lengths[b:rows] = 0
        self.batch = rows
        try:
            yield b, rows
        finally:
            self.batch = b

    def buffers(self) -> list[torch.Tensor]:
        return [*self.keys, *self.values, self._lengths]

    def _compiled(self, step: Callable, name: str) -> Callable:
        """`step` through `StaticConfig.compile` (as is without one). When compiling or capturing it fails (out of
        memory in a CUDA graph's capture, an op the compiler cannot take), this cache runs `step` uncompiled from
        then on, with the same tokens: the rows' lengths are put back as they were before the failed call (a
        capture's warm-up may have run the step), the call is repeated, and one log line says why."""
        if self.config.compile is None:
            return step
        compiled = [self.config.compile(step)]

        def run(*args):
            if compiled[0] is step:
                return step(*args)
            lengths = self._lengths.clone()
            try:
                return compiled[0](*args)
            except CacheFull:
                raise
            except Exception as err:  # noqa: BLE001 - any failure of the compiler or the capture: run it eagerly
                self._lengths.copy_(lengths)
                compiled[0] = step
                log.warning("static decoding runs its %s uncompiled: compiling or capturing it failed (%s)", name,
                            f"{type(err).__name__}: {err}"[:300])
                return step(*args)
        return run

    def no_room(self, n_new: int) -> str | None:
        """Why n_new entries past the committed ones do not fit (a forward would raise `CacheFull`), or None."""
        if self.width + n_new > self.config.capacity:
            return (f"{n_new} new entries past the {self.width} slots in use exceed its {self.config.capacity} "
                    "(StaticConfig.capacity)")
        return None

    def can_merge(self, other) -> bool:
        """Whether `merge_(other)` fits: a cache of the same kind and layers, into the spare rows and slots."""
        return (type(other) is type(self) and len(other.keys) == len(self.keys)
                and self.batch + other.batch <= self._lengths.shape[0] and other.width <= self.config.capacity)

    def _reserve(self, n_new: int) -> None:
        """Before a forward that leaves n_new entries past the committed ones: check the room, choose the slots
        attention reads (the bucket)."""
        need, capacity, bucket = self.width + n_new, self.config.capacity, self.config.bucket
        if need > capacity:
            raise CacheFull(f"{n_new} new entries need up to {need} slots per row; the static cache has "
                            f"{capacity} (StaticConfig.capacity)")
        self.attend_width = min(capacity, -(-need // bucket) * bucket)

    def _allowed(self, new_mask: torch.Tensor) -> tuple:
        """(allowed [B, S, W], committed [B, W], e [B, W]) over the W = attend_width slots: row b's query i sees its
        committed slots (< lengths[b]) and the entries past them that new_mask [B, S, E] allows (entry e at slot
        lengths[b] + e); e is each slot's entry index, clamped into [0, E)."""
        b, s, n = new_mask.shape
        slot = torch.arange(self.attend_width, device=new_mask.device)[None, :]  # [1, W]
        rel = slot - self._lengths[:b, None]  # [B, W]: e for the new entries, < 0 for the committed ones
        committed = rel < 0
        e = rel.clamp(0, n - 1)
        is_new = ~committed & (rel < n)
        allowed = committed[:, None, :] | (is_new[:, None, :] & new_mask.gather(2, e[:, None, :].expand(b, s, -1)))
        return allowed, committed, e

    def _write(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Write (k, v) [B, kv, S, d] at every row's slots lengths[b] + pending + [0, S); return the slots attention
        reads, [B, kv, attend_width, d]."""
        b, _, s, _ = key_states.shape
        slots = self._lengths[:b, None] + self.pending + torch.arange(s, device=key_states.device)  # [B, S]
        index = slots[:, None, :, None].expand_as(key_states)
        keys, values = self.keys[layer][:b], self.values[layer][:b]
        keys.scatter_(2, index, key_states)
        values.scatter_(2, index, value_states)
        return keys[:, :, : self.attend_width], values[:, :, : self.attend_width]

    def keep_new_(self, past_width, keep: torch.Tensor, n_keep: torch.Tensor) -> None:
        """After a forward of S entries: keep `keep[b, :n_keep[b]]` of them (indices into the new entries), moved
        in order to slots [lengths[b], lengths[b] + n_keep[b]). `past_width` is the growing caches' and unused: rows
        wrote at their own lengths. Every row moves K = keep.shape[1] entries (those past n_keep land in its
        garbage), read before any is written."""
        self._keep(keep, n_keep)
        self.width += keep.shape[1]
        self.pending = 0

    def _keep(self, keep: torch.Tensor, n_keep: torch.Tensor) -> None:
        b, k = keep.shape
        lengths = self._lengths[:b]
        src = lengths[:, None] + keep  # [B, K]
        dst = lengths[:, None] + torch.arange(k, device=keep.device)
        for buf in (*self.keys, *self.values):
            rows = buf[:b]
            shape = (b, buf.shape[1], k, buf.shape[3])
            moved = rows.gather(2, src[:, None, :, None].expand(shape))
            rows.scatter_(2, dst[:, None, :, None].expand(shape), moved)
        lengths += n_keep

    def truncate_(self, width: int) -> None:
        """Forget every slot from `width` on (rows' lengths capped at it) and the pending entries (they lie past
        the lengths already)."""
        self.lengths.clamp_(max=width)
        self.width, self.pending = min(self.width, width), 0

    def select_rows_(self, rows: torch.Tensor) -> None:
        """Keep batch rows `rows` ([B'] long, in order): moved to rows [0, B') of the same buffers."""
        n, w = rows.numel(), self.width
        for buf in (*self.keys, *self.values):
            buf[:n, :, :w] = buf[rows, :, :w]  # the right side is a new tensor: read before anything is written
        self._lengths[:n] = self._lengths[rows]
        self.batch = n

    def merge_(self, other: "StaticRows") -> None:
        """Append `other`'s rows after this cache's rows, into its spare rows (`StaticConfig.rows`). Checked before
        anything is copied: a merge that cannot fit leaves this cache as it was."""
        if not self.can_merge(other):
            raise CacheFull(f"merging {other.batch} rows of up to {other.width} slots into a static cache of "
                            f"{self._lengths.shape[0]} rows ({self.batch} in use) and {self.config.capacity} slots")
        n, m, w = self.batch, other.batch, other.width
        for mine, theirs in zip((*self.keys, *self.values), (*other.keys, *other.values)):
            mine[n: n + m, :, :w] = theirs[:m, :, :w]
        self._lengths[n: n + m] = other.lengths
        self.batch, self.width = n + m, max(self.width, w)


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
        return _first_rows(acc, b), None if aux is None else aux[:b, :n]

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
                           position_ids=position_ids, cache=self, use_cache=True)
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
            return _first_rows(grown, b)
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
