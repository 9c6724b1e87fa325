"""What the decoder needs to know about a target's family: each layer's attention kind, and what it refuses.

Our decoding (`eagle_core.kv.target_forward`) hands the target a ragged cache and its own attention masks, so it
must reproduce every masking rule the target's own forward applies, layer by layer, or its tokens silently differ
from the target's. The rules transformers applies (`transformers.masking_utils`), for a query at position p and a
key at position k <= p:

    full_attention     every earlier key
    sliding_attention  p - k < sliding_window                      (Gemma 2/3, Mistral/Qwen2 with a window, gpt-oss)
    chunked_attention  p // attention_chunk_size == k // chunk      (Llama 4)

Positions, not cache slots: a tree node's window is measured along its own path, so a verified tree scores every
node exactly as decoding it alone would. Attention sinks (gpt-oss) and logit soft-capping (Gemma 2) live inside
the target's own attention and lm_head code, which we call; the final soft-cap is applied by `lm_logits`.

Families whose layers are not attention over a KV cache (linear attention, state-space layers) and checkpoints
with a vision tower are refused by `check_supported` with one message naming the family and the feature, before
any weights load.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
ATTENTION_KINDS = (FULL, SLIDING, CHUNKED)

# model_type -> the feature our decoder lacks (families whose config has no `layer_types` to tell it).
_UNSUPPORTED_TYPES = {
    "mamba": "state-space (Mamba) layers",
    "mamba2": "state-space (Mamba-2) layers",
    "falcon_mamba": "state-space (Mamba) layers",
    "jamba": "state-space (Mamba) layers",
    "zamba": "state-space (Mamba) layers",
    "zamba2": "state-space (Mamba-2) layers",
    "bamba": "state-space (Mamba-2) layers",
    "falcon_h1": "state-space (Mamba-2) layers",
    "nemotron_h": "state-space (Mamba-2) layers",
    "granitemoehybrid": "state-space (Mamba-2) layers",
    "lfm2": "short-convolution layers",
    "lfm2_moe": "short-convolution layers",
    "recurrent_gemma": "recurrent (RG-LRU) layers",
    "rwkv": "recurrent (RWKV) layers",
    "xlstm": "recurrent (xLSTM) layers",
    "gemma3n": "AltUp and per-layer KV sharing",
    "minimax": "lightning (linear) attention layers",
}

_FAMILY_NAMES = {
    "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3-MoE",
    "gemma2": "Gemma 2", "gemma3_text": "Gemma 3", "gemma3": "Gemma 3", "llama4_text": "Llama 4",
    "llama4": "Llama 4", "gpt_oss": "gpt-oss", "phi3": "Phi-3", "olmo2": "OLMo-2", "granite": "Granite",
    "qwen3_next": "Qwen3-Next", "gemma3n": "Gemma 3n", "gemma3n_text": "Gemma 3n",
}


# Families whose RMSNorm scales by (1 + weight) rather than by weight.
_NORM_PLUS_ONE = {"gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "recurrent_gemma"}


def norm_scale(config, weight):
    """The per-channel scale the target's RMSNorm applies with `weight` (what our RMSNorm's weight must be to
    normalise alike): Gemma's norms scale by (1 + weight)."""
    return weight + 1 if getattr(config, "model_type", None) in _NORM_PLUS_ONE else weight


class UnsupportedTarget(ValueError):
    """The target's family has a feature our decoder does not reproduce; the message names both."""


def family_name(config) -> str:
    model_type = getattr(config, "model_type", None) or type(config).__name__
    return _FAMILY_NAMES.get(model_type, model_type)


def check_supported(config) -> None:
    """Raise `UnsupportedTarget` naming the family and the feature, for a config we cannot decode exactly.

    Called wherever a target is about to be used (`load_target`, `materialize_hf_folder` and so extraction,
    training and serving), so the refusal comes before any work instead of an IndexError deep in transformers."""
    name = family_name(config)
    model_type = getattr(config, "model_type", "")
    if model_type in _UNSUPPORTED_TYPES:
        raise UnsupportedTarget(f"{name}: {_UNSUPPORTED_TYPES[model_type]} are not supported by the decoder")
    if getattr(config, "vision_config", None) is not None or getattr(config, "text_config", None) is not None:
        raise UnsupportedTarget(f"{name}: checkpoints with a vision tower are not supported by the decoder; use the "
                                "text-only model (its text config and language-model weights)")
    kinds = sorted(set(getattr(config, "layer_types", None) or ()) - set(ATTENTION_KINDS))
    if kinds:
        raise UnsupportedTarget(f"{name}: layers of kind {', '.join(kinds)} are not supported by the decoder "
                                f"(supported: {', '.join(ATTENTION_KINDS)})")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedTarget(f"{name}: bidirectional attention (an encoder configuration) is not supported by the "
                                "decoder")


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention rule (see the module docstring): `span` is the window or the chunk size."""

    kind: str
    span: int | None = None


def layer_attention(config) -> list[LayerAttention]:
    """Each decoder layer's attention rule, as the target's own forward applies it.

    Configs with `layer_types` (Gemma 2/3, Qwen2, gpt-oss, Llama 4, ...) route one mask per kind; the others
    (Mistral, Phi-3, Qwen3-MoE) use one mask for every layer, a sliding one when `sliding_window` is set."""
    check_supported(config)
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None or getattr(config, "model_type", "") == "mistral":  # Mistral's forward ignores layer_types
        types = [SLIDING if window else FULL] * n
    out = []
    for kind in types[:n]:
        if kind == SLIDING and window:
            out.append(LayerAttention(SLIDING, int(window)))
        elif kind == CHUNKED:
            out.append(LayerAttention(CHUNKED, int(config.attention_chunk_size)))
        else:
            out.append(LayerAttention(FULL))
    return out


def temperature_tuning_limit(config) -> int | None:
    """Llama 4's no-RoPE layers scale queries by the cache length rather than the position
    (`attn_temperature_tuning`); the scale is 1 for the first `floor_scale - 1` tokens. Our ragged cache's width
    differs from positions (tree slots, ragged rows), so past that bound we would differ from the target: the
    decoder refuses to go there. None: no such bound."""
    if getattr(config, "attn_temperature_tuning", False) and getattr(config, "no_rope_layers", None) is not None:
        if not all(config.no_rope_layers):  # a 0 marks a layer without RoPE
            return int(config.floor_scale) - 1
    return None


def check_temperature_tuning(limit: int | None, tokens: int) -> None:
    """Raise `UnsupportedTarget` for a forward after which the cache would hold `tokens` entries past Llama 4's
    `temperature_tuning_limit` (None: no bound)."""
    if limit is not None and tokens > limit:
        raise UnsupportedTarget(f"Llama 4: attention temperature tuning scales queries by the cache length past "
                                f"{limit} tokens, which the ragged decoder does not reproduce")
