"""The EAGLE-3 draft model for a Llama-family target.

Architecture (as SGLang and vLLM load `LlamaForCausalLMEagle3`):

    aux features [B, S, 3*H_t] --fc--> hidden [B, S, H]
    midlayer: cat(input_layernorm(embed(ids)), hidden_norm(hidden)) -> 2H -> q/k/v -> attention -> o_proj
              + residual(hidden) -> post_attention_layernorm -> MLP + residual      => out_hidden (pre-norm)
    norm(out_hidden) -> lm_head -> draft-vocab logits;  target_id = draft_id + d2t[draft_id]

The draft is stateless between calls: the caller owns the KV cache (inference) and the TTT loop owns its
own diagonal attention (`eagle_core.ttt`); both reuse `midlayer.project_qkv` / `midlayer.finish`, so the
projections exist once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

from eagle_core.target import default_aux_layer_ids

LM_HEAD_INITS = ("random", "target")


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    target_hidden_size: int
    target_vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int]
    ttt_steps: int = 7
    # HF-style rope scaling dict of the target (e.g. {"rope_type": "llama3", "factor": 8.0, ...}); None = plain.
    rope_scaling: dict | None = None
    hidden_act: str = "silu"
    # "random" (SpecForge) or "target" (speculators: the target's lm_head rows for the draft vocab).
    lm_head_init: str = "random"
    freeze_lm_head: bool = False
    target_num_hidden_layers: int | None = None  # only for validation against a target at load time
    extra: dict = field(default_factory=dict)  # free-form lineage (target name, training run, ...)

    def __post_init__(self):
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"EAGLE-3 fuses exactly 3 aux layers, got aux_layer_ids={self.aux_layer_ids}")
        if self.lm_head_init not in LM_HEAD_INITS:
            raise ValueError(f"lm_head_init must be one of {LM_HEAD_INITS}, got {self.lm_head_init!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.draft_vocab_size > self.target_vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} > target vocab {self.target_vocab_size}")
        if self.ttt_steps < 1:
            raise ValueError("ttt_steps must be >= 1")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown DraftConfig fields: {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int = 32000, aux_layer_ids=None, **overrides) -> "DraftConfig":
        """Derive the draft's shape from a transformers Llama-family config.

        `hidden_size=` in `overrides` makes a draft narrower/wider than the target (`fc` still takes 3*H_target);
        `head_dim` then follows the new hidden size unless given too.
        """
        tc = target_config
        n_layers = tc.num_hidden_layers
        rope_theta, rope_scaling = _rope_of(tc)
        values = dict(
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            rms_norm_eps=tc.rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=tc.max_position_embeddings,
            hidden_act=getattr(tc, "hidden_act", "silu"),
            target_hidden_size=tc.hidden_size,
            target_vocab_size=tc.vocab_size,
            draft_vocab_size=min(draft_vocab_size, tc.vocab_size),
            aux_layer_ids=list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(n_layers),
            target_num_hidden_layers=n_layers,
        )
        if "hidden_size" in overrides and "head_dim" not in overrides:
            overrides["head_dim"] = overrides["hidden_size"] // overrides.get(
                "num_attention_heads", values["num_attention_heads"])
        values.update(overrides)
        return cls(**values)

    def rope_config(self) -> LlamaConfig:
        """A minimal LlamaConfig so transformers' rotary embedding (incl. llama3/yarn scaling) is reused."""
        params = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling:
            scaling = dict(self.rope_scaling)
            scaling["rope_type"] = scaling.pop("type", None) or scaling.get("rope_type", "default")
            params.update(scaling)
        return LlamaConfig(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=params,
        )


def _rope_of(target_config) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a transformers 5 (`rope_parameters`) or 4.x (`rope_theta`) config."""
    params = getattr(target_config, "rope_parameters", None)
    if params:
        params = dict(params)
        theta = float(params.pop("rope_theta", getattr(target_config, "rope_theta", 10000.0)))
        rope_type = params.get("rope_type", params.get("type", "default"))
        return theta, (params if rope_type != "default" else None)
    theta = float(getattr(target_config, "rope_theta", 10000.0))
    scaling = getattr(target_config, "rope_scaling", None)
    return theta, (dict(scaling) if scaling else None)


class Eagle3Attention(nn.Module):
    """q/k/v from the 2H concatenation, o_proj back to H (no biases, as in the Llama draft the engines load)."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d
        self.q_proj = nn.Linear(2 * h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(LlamaConfig(hidden_size=h, intermediate_size=config.intermediate_size,
                                        hidden_act=config.hidden_act, mlp_bias=False))

    def project_qkv(self, embeds, hidden, cos, sin):
        # embeds, hidden: [B, S, H]; cos, sin: [B, S, head_dim]
        # -> q [B, heads, S, d], k, v [B, kv_heads, S, d] (q and k rotated)
        attn = self.self_attn
        b, s, _ = hidden.shape
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, S, 2H]
        q = attn.q_proj(x).view(b, s, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, s, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, s, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def finish(self, attn_out, residual):
        # attn_out: [B, heads, S, d] -> out_hidden [B, S, H]; the residual stream is the un-normed `hidden`.
        b, _, s, _ = attn_out.shape
        h = self.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, s, -1)) + residual
        return self.mlp(self.post_attention_layernorm(h)) + h


def _causal_with_past(s: int, p: int, device) -> torch.Tensor:
    # [S, P+S] bool: every cached entry, plus the new tokens causally.
    cols = torch.arange(p + s, device=device)
    rows = torch.arange(s, device=device)[:, None] + p
    return cols[None, :] <= rows


def attend(q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
    """Plain attention. q [B, h, S, d], k/v [B, kv, T, d]; mask bool broadcastable to [B, h, S, T] or None=causal."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Eagle3Draft(nn.Module):
    def __init__(self, config: DraftConfig, target_embed_weight: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.target_vocab_size, h)
        if target_embed_weight is not None:
            self.set_embeddings(target_embed_weight)
        # Frozen: the target's embedding when the hidden sizes match; with a narrower/wider draft it is a
        # fixed random table (nothing in the field trains it; exported then, since the engines cannot share it).
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * config.target_hidden_size, h, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(not config.freeze_lm_head)
        self.rotary_emb = LlamaRotaryEmbedding(config.rope_config())
        # Identity mapping until a vocab is set: draft id i is target id i.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.target_vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    # ---- set-up -------------------------------------------------------------------------------------------
    @property
    def shares_target_embeddings(self) -> bool:
        return self.config.hidden_size == self.config.target_hidden_size

    def set_embeddings(self, target_embed_weight: torch.Tensor) -> None:
        # target_embed_weight: [target_vocab, H]
        if tuple(target_embed_weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(f"target embedding {tuple(target_embed_weight.shape)} does not fit the draft's "
                             f"{tuple(self.embed_tokens.weight.shape)} (target_vocab_size / hidden_size)")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(target_embed_weight)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"vocab mapping shapes {tuple(d2t.shape)}, {tuple(t2d.shape)} do not match the "
                             f"draft's {tuple(self.d2t.shape)}, {tuple(self.t2d.shape)}")
        self.d2t.copy_(d2t.to(torch.long))
        self.t2d.copy_(t2d.to(torch.bool))

    def init_lm_head_from_target(self, target_lm_head_weight: torch.Tensor) -> None:
        """speculators-style init: the target's lm_head rows of the draft vocab ([target_vocab, H] in)."""
        if target_lm_head_weight.shape[1] != self.config.hidden_size:
            raise ValueError("lm_head_init='target' needs hidden_size == target_hidden_size")
        ids = self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))
        with torch.no_grad():
            self.lm_head.weight.copy_(target_lm_head_weight[ids.to(target_lm_head_weight.device)])

    # ---- the contract used by inference and training -----------------------------------------------------
    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        # aux_hidden: [B, S, 3*H_target] -> [B, S, H]
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def embed(self, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # input_ids: [B, S] target-vocab ids -> [B, S, H]
        return self.embed_tokens(input_ids).to(dtype)

    def rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor):
        return self.rotary_emb(hidden, position_ids)  # cos, sin: [B, S, head_dim]

    def forward(self, hidden, input_ids, position_ids, attention_mask=None, past_kv=None):
        # hidden: [B, S, H]; input_ids, position_ids: [B, S]; past_kv: None or (k, v) [B, kv, P, d]
        # attention_mask: None (causal among new, all of past) or bool [B, 1, S, P+S], True = may attend
        layer = self.midlayer
        cos, sin = self.rotary(hidden, position_ids)
        q, k, v = layer.project_qkv(self.embed(input_ids, hidden.dtype), hidden, cos, sin)
        new_kv = (k, v)
        s = hidden.shape[1]
        p = 0
        if past_kv is not None:
            p = past_kv[0].shape[2]
            k = torch.cat([past_kv[0], k], dim=2)
            v = torch.cat([past_kv[1], v], dim=2)
        if attention_mask is None and p > 0:
            attention_mask = _causal_with_past(s, p, hidden.device)
        out = layer.finish(attend(q, k, v, attention_mask), hidden)
        return out, new_kv

    def compute_logits(self, out_hidden: torch.Tensor) -> torch.Tensor:
        # out_hidden: [B, S, H] (pre-norm) -> [B, S, draft_vocab] float32
        return self.lm_head(self.norm(out_hidden)).float()

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # ---- bookkeeping --------------------------------------------------------------------------------------
    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.trainable_parameters())


def build_draft(target, draft_vocab_size: int = 32000, aux_layer_ids=None, d2t=None, t2d=None,
                **overrides) -> Eagle3Draft:
    """A draft for a loaded HF target: config from the target, frozen target embeddings, optional vocab.

    With `lm_head_init="target"` (in overrides) the lm_head starts from the target's rows for the draft vocab.
    """
    config = DraftConfig.from_target(target.config, draft_vocab_size, aux_layer_ids, **overrides)
    embed = target.get_input_embeddings().weight
    draft = Eagle3Draft(config, embed.detach() if config.hidden_size == config.target_hidden_size else None)
    draft.to(device=embed.device)
    if d2t is not None:
        draft.set_vocab(d2t.to(embed.device), t2d.to(embed.device))
    if config.lm_head_init == "target":
        draft.init_lm_head_from_target(target.get_output_embeddings().weight.detach())
    return draft


def init_draft_weights(draft: Eagle3Draft, std: float | None = None, seed: int | None = None) -> None:
    """Re-initialise the trainable linear layers (normal, std 1/sqrt(fan_in) by default)."""
    gen = None
    if seed is not None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
    for module in draft.modules():
        if isinstance(module, nn.Linear) and module.weight.requires_grad:
            s = std if std is not None else 1.0 / math.sqrt(module.in_features)
            w = torch.randn(module.weight.shape, generator=gen) * s
            with torch.no_grad():
                module.weight.copy_(w.to(module.weight))
