"""Draft checkpoints: our folder format (= the vLLM/SGLang EAGLE-3 layout) and the `speculators` export.

EAGLE-3 layout (what vLLM and SGLang load as `LlamaForCausalLMEagle3`):
    config.json        Llama fields of the draft layer + architectures, draft_vocab_size, target_hidden_size,
                       num_hidden_layers 1, eagle_config.eagle_aux_hidden_state_layer_ids; our full
                       DraftConfig rides along under "eagle3_pipeline" (engines ignore unknown keys)
    model.safetensors  fc, midlayer.*, norm, lm_head, d2t (int64), t2d (bool); embed_tokens only when the
                       draft does not share the target's (engines then take the target's)

speculators layout (`Eagle3Speculator`): the same tensors with `midlayer.` renamed `layers.0.`, and a config
with `speculators_model_type: eagle3`, `transformer_layer_config` and `speculators_config`.

Loading validates the draft against the target when one is given: aux layer ids, hidden sizes and vocab
that disagree fail loudly here instead of silently costing acceptance in serving.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle_core.draft import DraftConfig, Eagle3Draft
from eagle_core.vocab import check_vocab_mapping

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
OUR_KEY = "eagle3_pipeline"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class DraftTargetMismatch(ValueError):
    """A draft checkpoint does not fit the target it is being loaded for."""


# ---------------------------------------------------------------------------------------------------
# config.json


def _layer_fields(cfg: DraftConfig) -> dict:
    """The Llama fields describing the draft's single decoder layer."""
    fields = {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.target_vocab_size,
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }
    if cfg.rope_scaling:
        fields["rope_scaling"] = dict(cfg.rope_scaling)
    return fields


def eagle3_config_json(draft: Eagle3Draft, dtype: torch.dtype) -> dict:
    cfg = draft.config
    return {
        "architectures": [EAGLE3_ARCHITECTURE],
        **_layer_fields(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        # Our residual stream is the un-normalised hidden state; say so rather than rely on defaults.
        "norm_before_residual": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "use_aux_hidden_state": True},
        "torch_dtype": _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch.")),
        OUR_KEY: cfg.to_dict(),
    }


def speculators_config_json(draft: Eagle3Draft, dtype: torch.dtype, verifier: str | None,
                            speculative_tokens: int | None) -> dict:
    cfg = draft.config
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": _layer_fields(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        # vLLM assumes True for speculators checkpoints when the field is absent: it must be explicit.
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": speculative_tokens or cfg.ttt_steps}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier or cfg.extra.get("target", ""),
                         "architectures": ["LlamaForCausalLM"]},
        },
        "torch_dtype": _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch.")),
        OUR_KEY: cfg.to_dict(),
    }


def config_from_json(data: dict) -> DraftConfig:
    """DraftConfig from either layout; foreign checkpoints (no OUR_KEY block) are read from the HF fields."""
    if OUR_KEY in data:
        return DraftConfig.from_dict(data[OUR_KEY])
    layer = data.get("transformer_layer_config", data)
    aux = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or data.get("eagle_aux_hidden_state_layer_ids")
    if not aux:
        raise ValueError("checkpoint config has no eagle_aux_hidden_state_layer_ids: refusing to guess them")
    if data.get("norm_before_residual"):
        raise ValueError("norm_before_residual=True drafts are not supported by this Eagle3Draft")
    heads = layer["num_attention_heads"]
    return DraftConfig(
        hidden_size=layer["hidden_size"],
        intermediate_size=layer["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=layer.get("num_key_value_heads", heads),
        head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
        rms_norm_eps=layer["rms_norm_eps"],
        rope_theta=layer.get("rope_theta", 10000.0),
        rope_scaling=layer.get("rope_scaling"),
        max_position_embeddings=layer["max_position_embeddings"],
        target_hidden_size=data.get("target_hidden_size") or layer["hidden_size"],
        target_vocab_size=layer["vocab_size"],
        draft_vocab_size=data.get("draft_vocab_size") or layer["vocab_size"],
        aux_layer_ids=list(aux),
        hidden_act=layer.get("hidden_act", "silu"),
    )


# ---------------------------------------------------------------------------------------------------
# tensors


def _tensors_to_save(draft: Eagle3Draft, dtype: torch.dtype, include_embeddings: bool | None) -> dict:
    if include_embeddings is None:
        include_embeddings = not draft.config.embeds_from_target  # an own embedding exists nowhere else
    tensors = {}
    for name, t in draft.state_dict().items():
        if name == "embed_tokens.weight" and not include_embeddings:
            continue
        t = t.detach()
        tensors[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous().cpu()
    tensors["d2t"] = tensors["d2t"].to(torch.int64)
    tensors["t2d"] = tensors["t2d"].to(torch.bool)
    return tensors


def _write(folder, config: dict, tensors: dict) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return folder


def save_draft(draft: Eagle3Draft, folder, dtype: torch.dtype | None = None,
               include_embeddings: bool | None = None) -> Path:
    """Write `draft` as config.json + model.safetensors in the vLLM/SGLang EAGLE-3 layout."""
    dtype = dtype or draft.fc.weight.dtype
    return _write(folder, eagle3_config_json(draft, dtype), _tensors_to_save(draft, dtype, include_embeddings))


def export_speculators(draft: Eagle3Draft, folder, dtype: torch.dtype | None = None,
                       verifier: str | None = None, speculative_tokens: int | None = None,
                       include_embeddings: bool | None = None) -> Path:
    """Write `draft` in the `speculators` layout (Eagle3Speculator: `layers.0.*` keys)."""
    dtype = dtype or draft.fc.weight.dtype
    tensors = {name.replace("midlayer.", "layers.0.", 1): t
               for name, t in _tensors_to_save(draft, dtype, include_embeddings).items()}
    return _write(folder, speculators_config_json(draft, dtype, verifier, speculative_tokens), tensors)


# ---------------------------------------------------------------------------------------------------
# loading


def read_config(folder) -> tuple[dict, DraftConfig]:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a draft checkpoint folder")
    data = json.loads(path.read_text())
    return data, config_from_json(data)


def target_mismatches(config: DraftConfig, target) -> list[str]:
    """Every way `config` disagrees with `target` (a transformers model or its config)."""
    tc = getattr(target, "config", target)
    problems = []
    if config.target_hidden_size != tc.hidden_size:
        problems.append(f"target_hidden_size {config.target_hidden_size} != the target's hidden_size {tc.hidden_size}")
    if config.target_vocab_size != tc.vocab_size:
        problems.append(f"vocab: the draft maps into {config.target_vocab_size} target ids, "
                        f"the target has vocab_size {tc.vocab_size}")
    n = tc.num_hidden_layers
    bad = [i for i in config.aux_layer_ids if not 0 <= i < n]
    if bad:
        problems.append(f"aux_layer_ids {config.aux_layer_ids} out of range for a {n}-layer target "
                        f"(ids index output_hidden_states: 0..{n - 1})")
    if config.target_num_hidden_layers is not None and config.target_num_hidden_layers != n:
        problems.append(f"the draft was trained on a {config.target_num_hidden_layers}-layer target "
                        f"(aux_layer_ids {config.aux_layer_ids}); this target has {n} layers")
    return problems


def validate_against_target(config: DraftConfig, target, source: str = "draft") -> None:
    problems = target_mismatches(config, target)
    if problems:
        raise DraftTargetMismatch(f"{source} does not fit the target:\n  - " + "\n  - ".join(problems))


def _rename_speculators_keys(tensors: dict) -> dict:
    return {name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name: t
            for name, t in tensors.items()}


def load_draft(folder, target=None, device=None, dtype=None) -> Eagle3Draft:
    """Load a draft saved by `save_draft` or `export_speculators` (or a compatible EAGLE-3 checkpoint).

    With `target` (a transformers model) the checkpoint is validated against it and, when the draft
    shares the target's embeddings, they are attached. Without it such a draft has zero embeddings until
    `draft.set_target_embeddings(...)` is called (a warning says so).
    """
    data, config = read_config(folder)
    if target is not None:
        validate_against_target(config, target, source=f"draft checkpoint {folder}")
    tensors = load_file(str(Path(folder) / WEIGHTS_FILE))
    if "speculators_model_type" in data:
        tensors = _rename_speculators_keys(tensors)
    draft = Eagle3Draft(config)
    _load_tensors(draft, tensors, folder)
    check_vocab_mapping(draft.d2t, draft.t2d)
    if "embed_tokens.weight" not in tensors:
        _attach_target_embeddings(draft, target, folder)
    device = device or (target.get_input_embeddings().weight.device if target is not None else None)
    if device is not None or dtype is not None:
        draft.to(device=device, dtype=dtype)
    return draft


def _load_tensors(draft: Eagle3Draft, tensors: dict, folder) -> None:
    expected = set(draft.state_dict())
    missing = expected - set(tensors) - {"embed_tokens.weight"}
    unexpected = set(tensors) - expected
    if missing or unexpected:
        raise ValueError(f"checkpoint {folder} does not match the draft layout: "
                         f"missing={sorted(missing)} unexpected={sorted(unexpected)}")
    with torch.no_grad():
        for name, t in draft.state_dict().items():
            if name in tensors:
                if tensors[name].shape != t.shape:
                    raise ValueError(f"checkpoint {folder}: {name} has shape {tuple(tensors[name].shape)}, "
                                     f"the config implies {tuple(t.shape)}")
                t.copy_(tensors[name])


def _attach_target_embeddings(draft: Eagle3Draft, target, folder) -> None:
    if not draft.config.embeds_from_target:
        raise ValueError(f"checkpoint {folder} lacks embed_tokens.weight, and its hidden size differs from "
                         "the target's, so the target's embeddings cannot stand in")
    if target is None:
        warnings.warn(f"draft {folder} uses the target's token embeddings; load it with target=... or call "
                      "draft.set_target_embeddings(target.get_input_embeddings().weight)", stacklevel=3)
        with torch.no_grad():
            draft.embed_tokens.weight.zero_()
        return
    draft.set_target_embeddings(target.get_input_embeddings().weight)
