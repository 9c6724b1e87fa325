"""A Llama-style decoder layer as one function on the packed kernels, while our decoder runs the target (issue 55).

Why: at batch 1 on a CPU a decode step is bound by Python as much as by its products. A profile of our auto decoding
of SmolLM2 (bf16, this CPU, packed kernels) put ~45 % of the time outside the ops: per layer twelve module calls
(`nn.Module.__call__` and its attribute look-ups), the sibling bookkeeping of four linears, rotary's ten ops.
`layer_forward` does what transformers' `LlamaDecoderLayer.forward` does, in the same order and the same float ops
(so the same values: every fp32 output stays transformers' greedy), calling the kernels directly: the norms on
`rms_norm_forward`, q/k/v in one packed product and gate/up in another (the `SIBLINGS` packs), the rotary of the
queries and keys in one pass over both, the cache's `update` and the attention function transformers would call.

Taken only by a layer whose own forward, MLP's, rotary function's, attention's and norms' are transformers ones this
function reproduces, word for word (their sources' hashes, `REPRODUCED` and `ATTENTIONS`: Llama's, so SmolLM's, and
Mistral's, Qwen2's and Qwen3's, which differ from Llama's in their attention only; not Gemma's, Phi-3's, OLMo-2's,
Granite's or a mixture of experts), with exactly `nn.Linear` projections, and only at a call in eval mode with no hook
on any of its submodules, no autograd and the weights' dtype; else the layer runs its own forward. Installed and
removed with the packs (`packed_linears`): transformers' own forward and `generate` never run it.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import torch
import torch.nn.functional as F

from eagle_core.packed_linear import (_llama_rms_norm, _packed, _plain_only, _run, _Siblings, rms_norm_forward,
                                      source_hash)

# The sources `layer_forward` reproduces, by hash (`source_hash`): transformers 5.19's Llama decoder layer, MLP,
# rotary function and rotate_half, which Mistral, Qwen2 and Qwen3 share word for word, and the attentions of the four,
# each with what it does beyond Llama's: the sliding window it passes the attention function (read from the config or
# from the module) and Qwen3's RMSNorm of every query and key head before the rotary. A release that changes any of
# them (or an older one) drops the fast path, its layers run their own forward, until `layer_forward` is checked
# against the new text and the hashes updated.
REPRODUCED = {"layer": "75d1d62e173e8c57", "mlp": "03df2d7685cf8446", "rotary": "ea234325c15de475",
              "rotate_half": "f714a4b1160c694e"}


@dataclasses.dataclass(frozen=True)
class AttentionKind:
    family: str
    window: str | None = None  # the sliding_window argument: None (Llama's passes none), "config" or "module"
    qk_norm: bool = False  # q_norm and k_norm over each head before the rotary


ATTENTIONS = {"dc6807936ef6103d": AttentionKind("llama"), "98e841a5cfbac696": AttentionKind("mistral", "config"),
              "3d7ae1485294d0c8": AttentionKind("qwen2", "module"),
              "6c8fb032ff374243": AttentionKind("qwen3", "module", qk_norm=True)}


@functools.cache
def _attention_kind(layer_cls: type, attention_cls: type, mlp_cls: type) -> AttentionKind | None:
    module = sys.modules.get(attention_cls.__module__)
    shared = {"layer": source_hash(layer_cls.forward), "mlp": source_hash(mlp_cls.forward),
              "rotary": source_hash(getattr(module, "apply_rotary_pos_emb", None)),
              "rotate_half": source_hash(getattr(module, "rotate_half", None))}
    return ATTENTIONS.get(source_hash(attention_cls.forward)) if shared == REPRODUCED else None


class LayerPlan:
    """What `layer_forward` needs of one layer, found once: its attention's kind, its submodules, its q/k/v and gate/up
    sibling groups (whose stacked packs it runs), the head counts. `LayerPlan.of(layer)` is None where the layer is
    none of the reproduced ones (module docstring)."""

    def __init__(self, layer, kind: AttentionKind, groups: dict):
        from transformers.activations import SiLUActivation
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama.modeling_llama import eager_attention_forward

        self.kind = kind
        self.attn, self.mlp = layer.self_attn, layer.mlp
        self.norms = (layer.input_layernorm, layer.post_attention_layernorm)
        a, m = self.attn, self.mlp
        self.qk_norms = (a.q_norm, a.k_norm) if kind.qk_norm else ()
        self.qkv, self.o = [a.q_proj, a.k_proj, a.v_proj], a.o_proj
        self.gate_up, self.down = [m.gate_proj, m.up_proj], m.down_proj
        self.head_dim = a.head_dim
        self.heads = a.q_proj.out_features // a.head_dim
        self.kv_heads = a.k_proj.out_features // a.head_dim
        self.act = F.silu if type(m.act_fn) in (SiLUActivation, torch.nn.SiLU) else m.act_fn
        self.attention_functions, self.eager_attention = ALL_ATTENTION_FUNCTIONS, eager_attention_forward
        modules = (a, m, *self.norms, *self.qk_norms, *self.qkv, self.o, *self.gate_up, self.down, m.act_fn)
        # every hook table a call of these modules would consult (each module's, and torch's global ones): the tables
        # themselves, whose emptiness is checked per call in one pass
        self.hooks = tuple(t for x in modules for t in (x._forward_hooks, x._forward_pre_hooks)) + tuple(
            getattr(torch.nn.modules.module, name) for name in ("_global_forward_hooks", "_global_forward_pre_hooks"))
        # the groups `packed_linear` made for these siblings (one pack each, shared with a fallback to the layer's own
        # forward), or groups of their own where siblings are not fused
        self.qkv_key, self.gate_up_key = (groups[g[0]][0] if g[0] in groups else _Siblings(g)
                                          for g in (self.qkv, self.gate_up))

    def window_kwargs(self) -> dict:
        """The sliding window the family's attention passes its attention function, read as it reads it."""
        if self.kind.window == "config":
            return {"sliding_window": getattr(self.attn.config, "sliding_window", None)}
        return {"sliding_window": self.attn.sliding_window} if self.kind.window == "module" else {}

    @staticmethod
    def of(layer, groups: dict | None = None) -> "LayerPlan | None":
        """groups: `packed_linear._sibling_groups` of the model (linear -> (its group, its place)), if made."""
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        kind = None if attn is None or mlp is None else _attention_kind(type(layer), type(attn), type(mlp))
        if kind is None:
            return None
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if not all(type(x) is torch.nn.Linear for x in linears):
            return None
        if len({(x.weight.dtype, x.weight.device) for x in linears}) != 1 or \
                len({x.bias is None for x in linears[:3]}) != 1 or len({x.bias is None for x in linears[4:6]}) != 1:
            return None
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [attn.q_norm, attn.k_norm] if kind.qk_norm else []
        if not all(_llama_rms_norm(type(n)) for n in norms):
            return None
        return LayerPlan(layer, kind, groups or {})

    def hooked(self) -> bool:
        return any(self.hooks)


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
    qk = qkv[..., : (h + kvh) * d].view(*input_shape, h + kvh, d)
    if plan.qk_norms:  # Qwen3: each query and key head normalised (over its head_dim) before the rotary
        qk = torch.cat([rms_norm_forward(plan.qk_norms[0], qk[..., :h, :]),
                        rms_norm_forward(plan.qk_norms[1], qk[..., h:, :])], dim=-2)
    qk = qk.transpose(1, 2)
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
                       scaling=attn.scaling, position_ids=position_ids, use_cache=use_cache, **plan.window_kwargs(),
                       **kwargs)
    out = out.reshape(*input_shape, -1).contiguous()
    hidden_states = residual + _run(*_packed(plan.o, [plan.o]), out)
    residual = hidden_states
    x = rms_norm_forward(plan.norms[1], hidden_states)
    gate, up = _run(*_packed(plan.gate_up_key, plan.gate_up), x).chunk(2, dim=-1)
    return residual + _run(*_packed(plan.down, [plan.down]), plan.act(gate) * up)
