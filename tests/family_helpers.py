"""Tiny random-weight targets of every model family the decoder claims or refuses (imported by test_families).

Each is a few layers of width 64 with the family's distinctive features switched on at a scale a CPU test can
pass: sliding windows of 8 and chunks of 8 tokens (prompts and answers run past several of them), Gemma 2's
soft-capping, gpt-oss's sinks and yarn RoPE, mixture-of-experts layers.
"""

from __future__ import annotations

import torch

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = 8


def _config(name: str):
    import transformers as T

    c = dict(COMMON)
    if name == "llama":
        return T.LlamaConfig(**c)
    if name == "mistral":
        return T.MistralConfig(**c, sliding_window=None)
    if name == "mistral-window":
        return T.MistralConfig(**c, sliding_window=WINDOW)
    if name == "qwen2":
        return T.Qwen2Config(**c, use_sliding_window=False)
    if name == "qwen2-window":  # layers from max_window_layers on slide: a mix of full and sliding layers
        return T.Qwen2Config(**c, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if name == "qwen3":
        return T.Qwen3Config(**c)
    if name == "qwen3-moe":
        return T.Qwen3MoeConfig(**c, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                decoder_sparse_step=1)
    if name == "gemma2":
        return T.Gemma2Config(**c, sliding_window=WINDOW, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                              query_pre_attn_scalar=16)
    if name == "gemma3":
        return T.Gemma3TextConfig(**c, sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=16)
    if name == "llama4":
        return T.Llama4TextConfig(**c, attention_chunk_size=WINDOW, num_local_experts=2, num_experts_per_tok=1,
                                  intermediate_size_mlp=128, interleave_moe_layer_step=2, no_rope_layer_interval=2)
    if name == "gpt-oss":
        return T.GptOssConfig(**c, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2)
    if name == "phi3":
        c.pop("head_dim")
        return T.Phi3Config(**c)
    if name == "olmo2":
        return T.Olmo2Config(**c)
    if name == "granite":
        return T.GraniteConfig(**c, logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5,
                               attention_multiplier=0.25)
    if name == "qwen3-next":
        return T.Qwen3NextConfig(**c, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                 linear_value_head_dim=16)
    raise KeyError(name)


SUPPORTED = ["llama", "mistral", "mistral-window", "qwen2", "qwen2-window", "qwen3", "qwen3-moe", "gemma2", "gemma3",
             "llama4", "gpt-oss", "phi3", "olmo2", "granite"]
WINDOWED = ["mistral-window", "qwen2-window", "gemma2", "gemma3", "llama4", "gpt-oss"]
REFUSED = {"qwen3-next": "Qwen3-Next: layers of kind linear_attention are not supported by the decoder"}


def tiny_family_model(name: str, seed: int = 0, dtype=torch.float32):
    """A random-weight causal LM of the family `name` (eval mode, no grad), sdpa where the family supports it."""
    from transformers import AutoModelForCausalLM

    config = _config(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    model.generation_config.pad_token_id = COMMON["pad_token_id"]
    model.generation_config.eos_token_id = None  # decode the full length: the test compares every token
    return model


def damp(model, eps: float):
    """Scale every decoder layer's update of the residual stream by eps (a forward hook, family-independent):
    the damped target mostly repeats its input, so an echo draft gets multi-token acceptance, while attention
    (and its window) still moves the logits. HF's `generate` and our decoder both run the hooked model."""
    def hook(_module, args, kwargs, output):
        before = args[0] if args else kwargs["hidden_states"]
        out = output[0] if isinstance(output, tuple) else output
        out = before + eps * (out - before)
        return (out, *output[1:]) if isinstance(output, tuple) else out

    for layer in model.model.layers:
        layer.register_forward_hook(hook, with_kwargs=True)
    return model
