"""The EAGLE-3 draft model for a Llama-family target.

    aux features [B, S, 3*H_t] --fc--> hidden [B, S, H]
    midlayer: cat(input_layernorm(embed(ids)), hidden_norm(hidden)) -> 2H -> q/k/v -> attention -> o_proj
              + residual(hidden) -> post_attention_layernorm -> MLP + residual      => out_hidden (pre-norm)
    norm(out_hidden) -> lm_head -> draft-vocab logits;  target_id = draft_id + d2t[draft_id]

EAGLE 3.1 (`norm_before_fc`, `norm_output`): input_norm(aux) before fc; out_hidden is norm(...) (post-norm), fed to
the next step as it is and read by lm_head without a second norm.

Submodule and buffer names are exactly the export keys that vLLM and SGLang load for
`LlamaForCausalLMEagle3` (DESIGN.md "Export keys"), so `state_dict()` needs no renaming on export.

The draft is stateless between calls: `forward` takes the caller's KV cache and returns only the new
entries. Training-time test (eagle_core/ttt.py) reuses `project_qkv` / `finish_layer` with its own
attention, so both paths run the very same weights and rotary code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from eagle_core.recipe import REFERENCE
from eagle_core.rope import _rope_of, apply_rope, rotary_embedding

LM_HEAD_INITS = ("random", "target")
# The draft kinds a training job can build (`--draft-kind`): their DraftConfig switches.
DRAFT_KINDS = {"eagle3": {}, "eagle3.1": {"norm_before_fc": True, "norm_output": True},
               "p-eagle": {"parallel_drafting": True}}


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
    # The library's defaults are the reference recipe's (eagle_core/recipes/reference.toml); a job takes the
    # recipe of its target instead (eagle_core.recipe.resolve_recipe).
    draft_vocab_size: int = REFERENCE.draft_vocab_size
    aux_layer_ids: list[int] = field(default_factory=list)
    ttt_steps: int = REFERENCE.ttt_steps
    # The target's RoPE scaling ({"rope_type": "llama3" | "linear", ...}); None = plain RoPE.
    rope_scaling: dict | None = None
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    # "random": trainable lm_head (SpecForge). "target": the target's lm_head rows for the draft vocab
    # (speculators); needs hidden_size == target_hidden_size.
    lm_head_init: str = "random"
    # None = frozen exactly when initialised from the target (the speculators recipe).
    freeze_lm_head: bool | None = None
    # EAGLE 3.1 (vLLM reads the same two keys): an RMSNorm over the three fused target features before `fc`
    # (`input_norm`), and the step's hidden state normalised (`norm`) before it is fed to the next step (and to the
    # head, which then applies no second norm). False, False: EAGLE-3 as vLLM, SGLang and SpecForge run it.
    norm_before_fc: bool = False
    norm_output: bool = False
    # P-EAGLE (vLLM: `parallel_drafting`, `mask_token_id`, the `mask_hidden` tensor): a round's depths 2.. in one forward
    # over mask slots: the (frozen, target's) embedding of `mask_token_id` and a learned feature vector `mask_hidden`.
    parallel_drafting: bool = False
    mask_token_id: int | None = None  # None: 0 for a P-EAGLE draft (any id serves: mask_hidden marks the slot)
    target_num_hidden_layers: int | None = None  # lets a loader check aux_layer_ids against a target
    extra: dict = field(default_factory=dict)  # free-form lineage (target name, training run, ...)

    def __post_init__(self):
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"EAGLE-3 fuses exactly 3 aux layers, got aux_layer_ids={self.aux_layer_ids}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 < self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..{self.target_vocab_size}")
        if self.lm_head_init not in LM_HEAD_INITS:
            raise ValueError(f"lm_head_init must be one of {LM_HEAD_INITS}, got {self.lm_head_init!r}")
        if self.lm_head_init == "target" and self.hidden_size != self.target_hidden_size:
            raise ValueError("lm_head_init='target' needs hidden_size == target_hidden_size")
        if self.ttt_steps < 1:
            raise ValueError("ttt_steps must be >= 1")
        if self.parallel_drafting and self.mask_token_id is None:
            self.mask_token_id = 0
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.target_vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the target vocab")
        rotary_embedding(self)  # fail now on an unsupported rope_scaling, not at the first forward

    @property
    def embeds_from_target(self) -> bool:
        """The target's token embeddings fit (and are used, frozen) only when the hidden sizes agree."""
        return self.hidden_size == self.target_hidden_size

    @property
    def lm_head_frozen(self) -> bool:
        return self.lm_head_init == "target" if self.freeze_lm_head is None else self.freeze_lm_head

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:  # a typo here would otherwise silently build a different draft
            raise ValueError(f"unknown DraftConfig fields: {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int | None = None, aux_layer_ids=None, **overrides):
        """Derive the draft's shape from a transformers Llama-family config (or the target model itself).

        `draft_vocab_size` None: the default above, capped at the target's vocab; `aux_layer_ids` None: the
        target's default aux layers. `hidden_size=` in `overrides` makes a narrower/wider draft (`fc` still
        reads 3*H_target); `head_dim` then follows the new hidden size unless given too.
        """
        from eagle_core.target import resolve_aux_layer_ids

        tc = getattr(target_config, "config", target_config)
        rope_theta, rope_scaling = _rope_of(tc)
        heads = overrides.get("num_attention_heads", tc.num_attention_heads)
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
            target_hidden_size=tc.hidden_size,
            target_vocab_size=tc.vocab_size,
            draft_vocab_size=min(cls.draft_vocab_size if draft_vocab_size is None else draft_vocab_size, tc.vocab_size),
            aux_layer_ids=resolve_aux_layer_ids(aux_layer_ids, tc.num_hidden_layers),
            # The draft layer is a Llama layer in every engine (`LlamaForCausalLMEagle3`): SiLU, whatever the
            # target's activation (Gemma's GELU).
            hidden_act="silu",
            target_num_hidden_layers=tc.num_hidden_layers,
        )
        if "hidden_size" in overrides and "head_dim" not in overrides:
            overrides["head_dim"] = overrides["hidden_size"] // heads
        values.update(overrides)
        return cls(**values)


# ---------------------------------------------------------------------------------------------------
# building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # Normalise in float32 (a bf16 variance is too coarse), return in the input dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        if act != "silu":
            raise ValueError(f"only silu MLPs are supported (Llama family), got {act!r}")
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Projections only: q/k/v read the 2H concatenation [embeds ; hidden]; attention lives in the callers."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)


class MidLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)


def repeat_kv(x, n_rep: int):
    # x: [B, kv_heads, S, D] -> [B, kv_heads * n_rep, S, D] (grouped-query attention)
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def causal_mask_with_cache(s: int, total: int, device) -> torch.Tensor:
    """bool [1, 1, S, P+S]: every cached entry visible, causal among the S new tokens."""
    p = total - s
    rows = torch.arange(s, device=device)[:, None]
    cols = torch.arange(total, device=device)[None, :]
    return (cols <= rows + p)[None, None]


# ---------------------------------------------------------------------------------------------------
# the draft


class Eagle3Draft(nn.Module):
    def __init__(self, config: DraftConfig, target_embed_weight: torch.Tensor | None = None):
        super().__init__()
        cfg = self.config = config
        self.embed_tokens = nn.Embedding(cfg.target_vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        if cfg.norm_before_fc:  # EAGLE 3.1; vLLM's key is `input_norm.weight` too
            self.input_norm = RMSNorm(3 * cfg.target_hidden_size, cfg.rms_norm_eps)
        if cfg.parallel_drafting:  # P-EAGLE; vLLM's key is `mask_hidden` too
            self.mask_hidden = nn.Parameter(torch.empty(3 * cfg.target_hidden_size))
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # Identity mapping until a vocabulary is set: draft id i <-> target id i.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(cfg.target_vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        # Kept out of the submodules on purpose: `.to(bfloat16)` would round its frequencies (a 0.3 error in
        # cos at position 3000); they stay float32 and follow the device lazily.
        self.__dict__["_rotary"] = rotary_embedding(cfg)
        self._init_weights()
        if target_embed_weight is not None:
            self.set_target_embeddings(target_embed_weight)
        # Target embeddings are frozen; an own embedding (draft hidden != target hidden) trains.
        self.embed_tokens.weight.requires_grad_(not cfg.embeds_from_target)
        self.lm_head.weight.requires_grad_(not cfg.lm_head_frozen)

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    def _init_weights(self):
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=std)
        if self.config.parallel_drafting:
            nn.init.normal_(self.mask_hidden, mean=0.0, std=1.0)  # the scale of a target feature, not a weight's

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.trainable_parameters())

    # -- wiring to the target --------------------------------------------------------------------

    def set_target_embeddings(self, weight: torch.Tensor):
        """Share (no copy) the target's token embeddings [target_vocab, H]; frozen."""
        expected = (self.config.target_vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected or not self.config.embeds_from_target:
            raise ValueError(f"target embeddings {tuple(weight.shape)} do not fit this draft: expected "
                             f"{expected} and hidden_size == target_hidden_size")
        self.embed_tokens.weight = nn.Parameter(weight.detach(), requires_grad=False)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor):
        """Install a draft vocabulary (see eagle_core/vocab.py): target_id = i + d2t[i]."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"vocab mapping shapes {tuple(d2t.shape)}/{tuple(t2d.shape)} do not fit "
                             f"{tuple(self.d2t.shape)}/{tuple(self.t2d.shape)}")
        self.d2t.copy_(d2t.to(torch.long))
        self.t2d.copy_(t2d.to(torch.bool))

    def init_lm_head_from_target(self, target_lm_head_weight: torch.Tensor, target_norm_weight=None,
                                 target_config=None):
        """Copy the target's lm_head rows for the draft vocab (and its final norm, when given: its per-channel scale,
        `families.norm_scale`, which needs the target's config).

        Call after `set_vocab`: the rows picked depend on `d2t`.
        """
        if self.config.hidden_size != self.config.target_hidden_size:
            raise ValueError("lm_head rows from the target need hidden_size == target_hidden_size")
        rows = self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))
        with torch.no_grad():
            self.lm_head.weight.copy_(target_lm_head_weight.detach()[rows.to(target_lm_head_weight.device)])
            if target_norm_weight is not None:
                from eagle_core.families import norm_scale

                self.norm.weight.copy_(norm_scale(target_config, target_norm_weight.detach()))

    @classmethod
    def from_target(cls, target, config: DraftConfig | None = None, d2t=None, t2d=None, **config_kw):
        """A draft wired to `target` (a transformers Llama): shared frozen embeddings, vocab, lm_head init.

        `config_kw` goes to `DraftConfig.from_target` (draft_vocab_size, aux_layer_ids, lm_head_init, ...).
        """
        config = config or DraftConfig.from_target(target.config, **config_kw)
        embed = target.get_input_embeddings().weight
        draft = cls(config, embed if config.embeds_from_target else None)
        draft.to(device=embed.device)
        if d2t is not None:
            draft.set_vocab(d2t.to(embed.device), t2d.to(embed.device))
        if config.lm_head_init == "target":
            norm = getattr(getattr(target, "model", target), "norm", None)
            draft.init_lm_head_from_target(target.get_output_embeddings().weight,
                                           None if norm is None else norm.weight, target.config)
        return draft

    # -- the layer, split so that TTT can bring its own attention --------------------------------

    def fuse(self, aux_hidden):
        # aux_hidden: [B, S, 3 * target_hidden] -> [B, S, H]
        aux_hidden = aux_hidden.to(self.fc.weight.dtype)
        if self.config.norm_before_fc:
            aux_hidden = self.input_norm(aux_hidden)
        return self.fc(aux_hidden)

    def mask_inputs(self, b: int, s: int):
        """P-EAGLE's mask slots: (hidden [b, s, H] = fuse(mask_hidden), ids [b, s] = mask_token_id)."""
        hidden = self.fuse(self.mask_hidden).expand(b, s, -1)
        ids = torch.full((b, s), self.config.mask_token_id, dtype=torch.long, device=hidden.device)
        return hidden, ids

    def rope(self, position_ids, dtype):
        # position_ids: [B, S] -> cos, sin: [B, 1, S, head_dim], computed in float32 by transformers' rotary code
        rotary = self._rotary
        if rotary.inv_freq.device != position_ids.device:
            rotary.to(position_ids.device)
        cos, sin = rotary(torch.empty(0, dtype=dtype, device=position_ids.device), position_ids)
        return cos[:, None], sin[:, None]

    def project_qkv(self, hidden, input_ids, position_ids):
        """Norms, concat, q/k/v projections and RoPE.

        hidden: [B, S, H]; input_ids, position_ids: [B, S]
        returns q [B, heads, S, D], k and v [B, kv_heads, S, D] (q, k rotated), residual [B, S, H]
        """
        layer = self.midlayer
        b, s, _ = hidden.shape
        d = self.config.head_dim
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        x = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(hidden)), dim=-1)  # [B, S, 2H]
        attn = layer.self_attn
        q = attn.q_proj(x).view(b, s, self.num_heads, d).transpose(1, 2)
        k = attn.k_proj(x).view(b, s, self.num_kv_heads, d).transpose(1, 2)
        v = attn.v_proj(x).view(b, s, self.num_kv_heads, d).transpose(1, 2)
        cos, sin = self.rope(position_ids, q.dtype)
        # The residual stream is the un-normalised hidden state (vLLM/SGLang default layout).
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, hidden

    def finish_layer(self, attn_out, residual):
        """o_proj + residual, then the MLP block. attn_out: [B, heads, S, D] -> out_hidden [B, S, H]."""
        layer = self.midlayer
        b, _, s, _ = attn_out.shape
        h = residual + layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, s, -1))
        out = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(out) if self.config.norm_output else out  # EAGLE 3.1 feeds the post-norm state back

    def forward(self, hidden, input_ids, position_ids, attention_mask=None, past_kv=None):
        """One draft step over S new tokens.

        hidden: [B, S, H]; input_ids, position_ids: [B, S]
        past_kv: None; (k, v), each [B, kv_heads, P, D], already rotated; or a cache whose `update(k, v)` stores
            the new entries after its P and returns all P+S (`eagle_core.kv.DraftKV`, written by index)
        attention_mask: None (causal over the new tokens, all of the cache visible) or bool [B, 1, S, P+S]
        returns out_hidden [B, S, H] (pre-norm; post-norm with `norm_output`) and the new (k, v), each [B, kv_heads, S, D]
        """
        q, k, v, residual = self.project_qkv(hidden, input_ids, position_ids)
        keys, values = k, v
        if isinstance(past_kv, tuple):
            keys = torch.cat((past_kv[0].to(k.dtype), k), dim=2)
            values = torch.cat((past_kv[1].to(v.dtype), v), dim=2)
        elif past_kv is not None:
            keys, values = past_kv.update(k, v)
        if attention_mask is None:
            attention_mask = causal_mask_with_cache(q.shape[2], keys.shape[2], q.device)
        # SDPA's own grouped-query support reads each kv head for its query heads: no repeated copy of the cache per
        # call (the same values as repeat_kv, bit for bit; 1.8 vs 5.1 ms at 4 rows x 1000 cached).
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attention_mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.finish_layer(out, residual), (k, v)

    def head_input(self, out_hidden):
        """What lm_head reads of a step's out_hidden: its final norm (already applied with `norm_output`)."""
        return out_hidden if self.config.norm_output else self.norm(out_hidden)

    def compute_logits(self, out_hidden):
        # out_hidden: [B, S, H] -> [B, S, draft_vocab] in float32 (softmax/loss are done in float32)
        return self.lm_head(self.head_input(out_hidden)).float()

    def draft_to_target(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]

