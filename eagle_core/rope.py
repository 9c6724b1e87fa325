"""The draft's RoPE: the target's theta and scaling read from its config, transformers' own rotary embedding for
the draft's head size, and its application to queries and keys (`eagle_core.draft` and TTT use these)."""

from __future__ import annotations

import torch


def _rope_of(target_config) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a transformers 5 (`rope_parameters`) or 4.x (`rope_theta`) config."""
    params = getattr(target_config, "rope_parameters", None)
    if params and isinstance(next(iter(params.values())), dict):
        # one RoPE per layer kind (Gemma 3: local layers 10k, global 1M): the draft attends over the whole
        # context like the global layers, so it takes theirs
        params = params.get("full_attention") or next(iter(params.values()))
    if params:
        params = dict(params)
        theta = float(params.pop("rope_theta", getattr(target_config, "rope_theta", 10000.0)))
    else:
        theta = float(getattr(target_config, "rope_theta", 10000.0))
        params = dict(getattr(target_config, "rope_scaling", None) or {})
    kind = params.get("rope_type", params.get("type", "default"))
    return theta, (params if kind != "default" else None)


def rotary_embedding(cfg):
    """transformers' own rotary embedding for the draft's head size and the target's RoPE (default, linear,
    dynamic/NTK, yarn, longrope, llama3: whatever transformers implements, with its attention scaling and its
    sequence-length-dependent updates), so the draft rotates exactly as a Llama layer with this config would in
    transformers, vLLM and SGLang. An unknown `rope_type` fails here, when the config is built."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling = dict(cfg.rope_scaling or {})
    scaling["rope_type"] = scaling.pop("type", None) or scaling.get("rope_type", "default")
    config = LlamaConfig(hidden_size=cfg.num_attention_heads * cfg.head_dim, head_dim=cfg.head_dim,
                         num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                         max_position_embeddings=cfg.max_position_embeddings,
                         rope_parameters={**scaling, "rope_theta": cfg.rope_theta})
    try:
        return LlamaRotaryEmbedding(config)
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"unsupported rope_scaling {cfg.rope_scaling!r}: {e}") from e


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    # x: [B, heads, S, D]; cos/sin: [B, 1, S, D]
    return x * cos + rotate_half(x) * sin
