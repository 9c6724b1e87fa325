"""The target's attention in decoding: masks over the ragged cache, per layer kind, and the SDPA call on CPUs.

`attention_allowed` / `causal_mask` say which cached and new entries each new query sees (`eagle_core.kv`'s
layout); `forward_masks` turns that into one additive mask per attention kind the target's layers use (full,
sliding window, chunk: `eagle_core.families`), and `per_layer_masks` hands each layer its own. `our_attention`
routes a forward's SDPA calls through `_transformers_attention`, which skips transformers' repeated KV heads (CPUs:
SDPA's grouped-query support; CUDA: the query heads folded over their kv head).
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch


def to_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive float mask of a bool one (0 = may attend, dtype min = may not): what both the SDPA and the eager
    attention of transformers accept; the finite minimum keeps a fully masked row finite."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return bias.masked_fill_(~allowed, torch.finfo(dtype).min)


def restrict_to_span(allowed: torch.Tensor, rule, position_ids: torch.Tensor) -> torch.Tensor:
    """`allowed` [B, 1, S, P+S] narrowed to a sliding window or a chunk (`families.LayerAttention`).

    Committed slot s holds the token at position s; the S new entries are at `position_ids` [B, S], a tree's
    nodes at their depth along their own path, so a node's window counts the positions of its own ancestors."""
    past = allowed.shape[-1] - position_ids.shape[1]
    slots = torch.arange(past, device=position_ids.device)[None].expand(position_ids.shape[0], past)
    inside = within_span(rule, position_ids, torch.cat([slots, position_ids], dim=1))
    return allowed if inside is None else allowed & inside[:, None]


def within_span(rule, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor | None:
    """[B, S, K] bool: which keys (at positions key_pos [B, K]) lie inside the window or the chunk of each query (at
    query_pos [B, S]) under `rule`; None for full attention (every key)."""
    from eagle_core.families import CHUNKED, SLIDING

    query_pos, key_pos = query_pos[:, :, None], key_pos[:, None, :]
    if rule.kind == SLIDING:
        return query_pos - key_pos < rule.span
    if rule.kind == CHUNKED:
        return torch.div(query_pos, rule.span, rounding_mode="floor") == torch.div(key_pos, rule.span,
                                                                                  rounding_mode="floor")
    return None


_RULES: dict = {}  # id(config) -> (weak reference to it, `_layer_rules`): transformers configs are unhashable


def layer_rules(config) -> tuple:
    """(rules per layer, the most common rule, temperature-tuning bound) of a target config (`eagle_core.families`),
    computed once per config object."""
    from eagle_core.families import layer_attention, temperature_tuning_limit

    ref, rules = _RULES.get(id(config), (None, None))
    if ref is None or ref() is not config:
        per_layer = tuple(layer_attention(config))
        rules = per_layer, max(set(per_layer), key=per_layer.count), temperature_tuning_limit(config)
        _RULES[id(config)] = (weakref.ref(config), rules)
    return rules


@contextlib.contextmanager
def per_layer_masks(decoder, rules, masks: dict):
    """Within it, every decoder layer whose rule differs from the one the whole forward was given attends with its
    own mask: a pre-hook swaps the `attention_mask` the model passes the layer. One mechanism for every family,
    whether its forward routes one mask per layer kind (Gemma, Qwen2, gpt-oss, Llama 4) or one mask for all."""
    handles = []

    def swap(mask):
        def hook(_module, args, kwargs):
            if "attention_mask" not in kwargs:
                raise TypeError(f"{type(_module).__name__} takes its attention mask positionally; the decoder cannot "
                                "give its layers their own masks")
            kwargs["attention_mask"] = mask
            return args, kwargs
        return hook

    try:
        for layer, rule in zip(decoder.layers, rules) if masks else ():  # one kind for every layer: nothing to swap
            if rule in masks:
                handles.append(layer.register_forward_pre_hook(swap(masks[rule]), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


def use_gqa_sdpa(query: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """Whether `_transformers_attention` calls SDPA with `enable_gqa` itself: a CPU query [B, H, S, D] of 2+ tokens
    with a mask (a tree's verify, a ragged catch-up, a prefill).

    There transformers' SDPA path copies the whole cache per layer to repeat the kv heads (it passes `enable_gqa`
    only without a mask, for CUDA's sake); SDPA's own grouped-query support on a CPU gives the same values bit for
    bit, in float32 and bfloat16, without the copy. Measured with torch 2.13 (one SmolLM2 layer's attention, 17
    queries over 400 cached, 2-core avx512_bf16 EPYC): 0.23 vs 0.30 ms bf16, 0.30 vs 0.41 ms fp32; a whole bf16
    verify forward of 17 tokens 97 vs 115 ms against the two-matmul attention this replaced (docs/DESIGN.md 4).
    One query keeps transformers' path (it folds the query heads into the kv heads itself); GPUs keep it too
    (CUDA's fused kernels take no mask with `enable_gqa`)."""
    return query.device.type == "cpu" and query.shape[2] > 1 and attention_mask is not None


# Devices where 2+ new queries with a mask attend with the query heads folded over their kv head (`folded_gqa_sdpa`)
# instead of transformers' repeated kv heads (CPUs take SDPA's own grouped-query path first: `use_gqa_sdpa`);
# bench.gpu times a verify with and without it.
GQA_FOLD_DEVICES = frozenset({"cuda"})


def folds_gqa(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """Whether `_transformers_attention` calls `folded_gqa_sdpa`: a CUDA query [B, H, S, D] of 2+ tokens (a verify,
    a catch-up, a prefill) with a mask shared by the heads, over fewer kv heads than query heads. transformers
    repeats the kv heads there (CUDA's fused kernels take no mask with `enable_gqa`): a verify then reads every
    layer's cache H / Hkv times (4x for Llama-3.1-8B)."""
    return (query.device.type in GQA_FOLD_DEVICES and query.shape[2] > 1 and attention_mask is not None
            and attention_mask.shape[1] == 1 and query.shape[1] != key.shape[1])


def folded_gqa_sdpa(query, key, value, attention_mask, scale=None, dropout: float = 0.0) -> torch.Tensor:
    """SDPA of query [B, H, S, D] over key, value [B, Hkv, W, D] under a mask [B, 1, S, W] (bool or additive),
    with each kv head's G = H / Hkv query heads folded into its query rows ([B, Hkv, G*S, D], the mask repeated over
    the G): one attention per kv head, so the cache is read once, as a mask-taking fused kernel needs, instead of
    copied G times. Query head h reads kv head h // G, as transformers' `repeat_kv` pairs them; each head's softmax
    and weighted sum are those of the unfolded call. Returns [B, H, S, D]."""
    b, h, s, d = query.shape
    kv_heads = key.shape[1]
    g = h // kv_heads
    mask = attention_mask[:, :, None].expand(b, 1, g, s, attention_mask.shape[-1]).reshape(b, 1, g * s, -1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(b, kv_heads, g * s, d), key, value, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out.reshape(b, h, s, d)


def _transformers_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' SDPA attention (its attention-interface signature), without the repeated kv heads where
    `use_gqa_sdpa` (CPUs: SDPA's own grouped-query support) or `folds_gqa` (CUDA: the query heads folded) says so."""
    if use_gqa_sdpa(query, attention_mask):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask[:, :, :, : key.shape[-2]],
            dropout_p=dropout, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None
    if folds_gqa(query, key, attention_mask):
        out = folded_gqa_sdpa(query, key, value, attention_mask[:, :, :, : key.shape[-2]], scaling, dropout)
        return out.transpose(1, 2).contiguous(), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


GQA_SDPA_ATTENTION = "eagle3_gqa_sdpa"


@functools.lru_cache(maxsize=None)
def _register_attention() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(GQA_SDPA_ATTENTION, _transformers_attention)
    return GQA_SDPA_ATTENTION


@contextlib.contextmanager
def our_attention(decoder):
    """Within it, a decoder loaded with SDPA attends through `_transformers_attention` (`target_forward` only:
    `model.generate` keeps transformers' own kernels, the benchmark's baseline)."""
    config = decoder.config
    if config._attn_implementation != "sdpa":  # flash-attention, eager, ...: the user's choice stands
        yield
        return
    config._attn_implementation = _register_attention()
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


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


def forward_masks(config, allowed: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple:
    """(the mask the forward gets, {rule: mask} of the other layers' kinds, rules per layer): every layer attends with
    its own kind's mask (full, sliding window, chunk); the forward gets the most common one, the other layers theirs
    through `per_layer_masks`."""
    rules, common, _ = layer_rules(config)
    masks = {rule: to_bias(restrict_to_span(allowed, rule, position_ids), dtype) for rule in set(rules)}
    return masks.pop(common), masks, rules
