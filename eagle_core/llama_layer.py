"""A Llama decoder layer as one function on the packed kernels, while our decoder runs the target (issue 55).

Why: at batch 1 on a CPU a decode step is bound by Python as much as by its products. A profile of our auto decoding
of SmolLM2 (bf16, this CPU, packed kernels) put ~45 % of the time outside the ops: per layer twelve module calls
(`nn.Module.__call__` and its attribute look-ups), the sibling bookkeeping of four linears, rotary's ten ops.
`layer_forward` does what transformers' `LlamaDecoderLayer.forward` does, in the same order and the same float ops
(so the same values: every fp32 output stays transformers' greedy), calling the kernels directly: the norms on
`rms_norm_forward`, q/k/v in one packed product and gate/up in another (the `SIBLINGS` packs), the rotary of the
queries and keys in one pass over both, the cache's `update` and the attention function transformers would call.

Taken only by a layer whose own forward, attention's, MLP's, rotary function's and norms' are the transformers Llama
ones this function reproduces, word for word (their sources' hashes, `REPRODUCED`: Llama's, so SmolLM's; of the
decoder's other families none today: Mistral's and Qwen2's attention pass a sliding window, Qwen3's adds q/k norms,
Gemma's scales its norms), with exactly `nn.Linear` projections, and only at a call in eval mode with no hook on any
of its submodules, no autograd and the weights' dtype; else the layer runs its own forward. Installed and removed with
the packs (`packed_linears`): transformers' own forward and `generate` never run it.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from eagle_core.packed_linear import _llama_rms_norm, _packed, _plain_only, _run, rms_norm_forward, source_hash

# The sources `layer_forward` reproduces, by hash: transformers 5.19's Llama decoder layer, attention, MLP, rotary
# function and rotate_half. A release that changes any of them (or an older one) drops the fast path, its layers run
# their own forward, until `layer_forward` is checked against the new text and the hashes updated.
REPRODUCED = {"layer": "75d1d62e173e8c57", "attention": "dc6807936ef6103d", "mlp": "03df2d7685cf8446",
              "rotary": "ea234325c15de475", "rotate_half": "f714a4b1160c694e"}


@functools.cache
def _llama_classes(layer_cls: type, attention_cls: type, mlp_cls: type) -> bool:
    module = sys.modules.get(attention_cls.__module__)
    return {"layer": source_hash(layer_cls.forward), "attention": source_hash(attention_cls.forward),
            "mlp": source_hash(mlp_cls.forward), "rotary": source_hash(getattr(module, "apply_rotary_pos_emb", None)),
            "rotate_half": source_hash(getattr(module, "rotate_half", None))} == REPRODUCED


class LayerPlan:
    """What `layer_forward` needs of one layer, found once: its submodules, the pack keys of its q/k/v and gate/up,
    the head counts. `LayerPlan.of(layer)` is None where the layer is not Llama's (module docstring)."""

    def __init__(self, layer):
        from transformers.activations import SiLUActivation
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama.modeling_llama import eager_attention_forward

        self.attn, self.mlp = layer.self_attn, layer.mlp
        self.norms = (layer.input_layernorm, layer.post_attention_layernorm)
        a, m = self.attn, self.mlp
        self.qkv, self.o = [a.q_proj, a.k_proj, a.v_proj], a.o_proj
        self.gate_up, self.down = [m.gate_proj, m.up_proj], m.down_proj
        self.head_dim = a.head_dim
        self.heads = a.q_proj.out_features // a.head_dim
        self.kv_heads = a.k_proj.out_features // a.head_dim
        self.act = F.silu if type(m.act_fn) in (SiLUActivation, torch.nn.SiLU) else m.act_fn
        self.attention_functions, self.eager_attention = ALL_ATTENTION_FUNCTIONS, eager_attention_forward
        modules = (a, m, *self.norms, *self.qkv, self.o, *self.gate_up, self.down, m.act_fn)
        # every hook table a call of these modules would consult (each module's, and torch's global ones): the tables
        # themselves, whose emptiness is checked per call in one pass
        self.hooks = tuple(t for x in modules for t in (x._forward_hooks, x._forward_pre_hooks)) + tuple(
            getattr(torch.nn.modules.module, name) for name in ("_global_forward_hooks", "_global_forward_pre_hooks"))
        self.qkv_key, self.gate_up_key = _PackKey(), _PackKey()  # what the stacked packs are kept under

    @staticmethod
    def of(layer) -> "LayerPlan | None":
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not _llama_classes(type(layer), type(attn), type(mlp)):
            return None
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if not all(type(x) is torch.nn.Linear for x in linears):
            return None
        if len({(x.weight.dtype, x.weight.device) for x in linears}) != 1 or \
                len({x.bias is None for x in linears[:3]}) != 1 or len({x.bias is None for x in linears[4:6]}) != 1:
            return None
        if not all(_llama_rms_norm(type(n)) for n in (layer.input_layernorm, layer.post_attention_layernorm)):
            return None
        return LayerPlan(layer)

    def hooked(self) -> bool:
        return any(self.hooks)


class _PackKey:
    """A weak-referenceable key for a stacked pack in `packed_linear._PACKS`."""


def layer_forward(layer, plan: LayerPlan, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  position_ids=None, past_key_values=None, use_cache=False, position_embeddings=None, **kwargs):
    """transformers' `LlamaDecoderLayer.forward(hidden_states, ...)` on the packed kernels (module docstring)."""
    if _plain_only(plan.o, hidden_states) or plan.hooked() or position_embeddings is None or layer.training:
        return type(layer).forward(layer, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                   past_key_values=past_key_values, use_cache=use_cache,
                                   position_embeddings=position_embeddings, **kwargs)
    attn, d, h, kvh = plan.attn, plan.head_dim, plan.heads, plan.kv_heads
    input_shape = hidden_states.shape[:-1]
    residual = hidden_states
    x = rms_norm_forward(plan.norms[0], hidden_states)
    qkv = _run(*_packed(plan.qkv_key, plan.qkv), x)  # [..., (h + 2 kvh) d]
    # rotary of the queries and keys in one pass: per element the float ops of `apply_rotary_pos_emb`
    qk = qkv[..., : (h + kvh) * d].view(*input_shape, h + kvh, d).transpose(1, 2)
    value_states = qkv[..., (h + kvh) * d:].view(*input_shape, kvh, d).transpose(1, 2)
    cos, sin = position_embeddings
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = d // 2
    qk = (qk * cos) + (torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin)
    query_states, key_states = qk[:, :h], qk[:, h:]
    if past_key_values is not None:
        key_states, value_states = past_key_values.update(key_states, value_states, attn.layer_idx)
    attention = plan.attention_functions.get_interface(attn.config._attn_implementation, plan.eager_attention)
    out, _ = attention(attn, query_states, key_states, value_states, attention_mask, dropout=0.0,
                       scaling=attn.scaling, position_ids=position_ids, use_cache=use_cache, **kwargs)
    out = out.reshape(*input_shape, -1).contiguous()
    hidden_states = residual + _run(*_packed(plan.o, [plan.o]), out)
    residual = hidden_states
    x = rms_norm_forward(plan.norms[1], hidden_states)
    gate, up = _run(*_packed(plan.gate_up_key, plan.gate_up), x).chunk(2, dim=-1)
    return residual + _run(*_packed(plan.down, [plan.down]), plan.act(gate) * up)
