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

Aux layer ids across engines: `eagle_core/engine_ids.py` (the rule and its tables); the EAGLE-3 folder holds
both keys, each in the convention of the engines that read it.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle_core.draft import DraftConfig, Eagle3Draft
from eagle_core.engine_ids import (AUX_ID_RULE, CONVENTIONS, KEY_CONVENTIONS, check_ids_for_engine, from_engine_ids,
                                   to_engine_ids)
from eagle_core.target import local_folder
from eagle_core.vocab import check_vocab_mapping

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
OUR_KEY = "eagle3_pipeline"
EXPORT_KEY = "eagle3_pipeline_export"  # marker: our ids and the convention of each aux-id key
# Short target names that no engine can resolve, mapped to the hub model they were made from.
RESOLVABLE_VERIFIERS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
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


def _dtype_name(dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def eagle3_config_from(cfg: DraftConfig, dtype_name: str) -> dict:
    """The EAGLE-3 config.json of a draft described by `cfg`: one folder that vLLM, SGLang and SpecForge read."""
    ours = [int(i) for i in cfg.aux_layer_ids]
    return {
        "architectures": [EAGLE3_ARCHITECTURE],
        **_layer_fields(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        # Our residual stream is the un-normalised hidden state; say so rather than rely on defaults.
        "norm_before_residual": False,
        # vLLM reads the top-level key first, in our convention; SGLang/SpecForge read the nested one in theirs.
        "eagle_aux_hidden_state_layer_ids": to_engine_ids(ours, "vllm"),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": to_engine_ids(ours, "sglang"),
                         "use_aux_hidden_state": True},
        "torch_dtype": dtype_name,
        **draft_kind_fields(cfg),
        EXPORT_KEY: {"aux_layer_ids": ours, "conventions": dict(KEY_CONVENTIONS), "rule": AUX_ID_RULE},
        OUR_KEY: cfg.to_dict(),
    }


def draft_kind_fields(cfg: DraftConfig) -> dict:
    """The draft kind's keys as vLLM reads them, only where set (an EAGLE-3 export's config stays as it was): EAGLE
    3.1's two switches (top-level `norm_before_fc`, `norm_output`); P-EAGLE's `mask_token_id`, and
    `parallel_drafting`, which vLLM takes from its speculative config instead (`vllm_spec.speculative_config` reads
    it here). P-EAGLE's `mask_hidden` is among the tensors."""
    fields = {key: True for key in ("norm_before_fc", "norm_output") if getattr(cfg, key)}
    if cfg.parallel_drafting:
        fields.update(parallel_drafting=True, mask_token_id=cfg.mask_token_id)
    return fields


def eagle3_config_json(draft: Eagle3Draft, dtype: torch.dtype) -> dict:
    return eagle3_config_from(draft.config, _dtype_name(dtype))


def resolve_verifier(verifier, config: DraftConfig | None = None) -> str:
    """The verifier as an engine can resolve it: a hub model id or a local path, never a short name or "".

    `verifier` is a string, or the target model / its config (its `name_or_path` is used); without one the
    draft's lineage (`config.extra["target"]`) is tried. Our short names map to the hub model they were made
    from (`smollm2-135m` -> HuggingFaceTB/SmolLM2-135M-Instruct, of which the embedded GGUF is a Q4_1
    quantisation); an existing local path becomes absolute.
    """
    if verifier is not None and not isinstance(verifier, (str, os.PathLike)):
        conf = getattr(verifier, "config", verifier)
        verifier = getattr(conf, "name_or_path", None) or getattr(conf, "_name_or_path", None)
    if not verifier and config is not None:
        verifier = config.extra.get("target")
    verifier = str(verifier or "").strip()
    if not verifier:
        raise ValueError("export_speculators needs the verifier (target) model: pass verifier= a hub model id, a "
                         "local path, or the target model itself; an empty name would not load in vLLM")
    if verifier in RESOLVABLE_VERIFIERS:
        return RESOLVABLE_VERIFIERS[verifier]
    if Path(verifier).exists():
        return str(Path(verifier).resolve())
    return verifier


def speculators_config_json(draft: Eagle3Draft, dtype: torch.dtype, verifier,
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
        **draft_kind_fields(cfg),
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": speculative_tokens or cfg.ttt_steps}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": resolve_verifier(verifier, cfg),
                         "architectures": ["LlamaForCausalLM"]},
        },
        "torch_dtype": _dtype_name(dtype),
        OUR_KEY: cfg.to_dict(),
    }


def aux_layer_ids_from_json(data: dict, convention: str | None = None) -> list[int]:
    """Our aux ids from a config.json, whoever wrote it.

    Ours (an `eagle3_pipeline` block or the `eagle3_pipeline_export` marker) are read as written. For a
    foreign checkpoint, `convention` says how its ids count: "sglang"/"specforge" read the nested
    `eagle_config` key (what those trainers write) and add 1; "vllm" reads the top-level key, else the nested
    one, as is. Without `convention` the top-level key (written only in vLLM's convention) is used; a
    checkpoint with only the nested key is ambiguous and refused rather than risk feeding the wrong layers.
    """
    if convention is not None and convention not in CONVENTIONS:
        raise ValueError(f"unknown aux layer id convention {convention!r}: expected one of {CONVENTIONS}")
    if OUR_KEY in data and "aux_layer_ids" in data[OUR_KEY]:
        return [int(i) for i in data[OUR_KEY]["aux_layer_ids"]]
    if EXPORT_KEY in data:
        return [int(i) for i in data[EXPORT_KEY]["aux_layer_ids"]]
    top = data.get("eagle_aux_hidden_state_layer_ids")
    nested = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if convention in ("sglang", "specforge"):
        if not nested:
            raise ValueError(f"a {convention} checkpoint keeps its aux ids in eagle_config."
                             "eagle_aux_hidden_state_layer_ids; this config has none: refusing to guess them")
        return from_engine_ids(nested, convention)
    if top:
        return from_engine_ids(top, "vllm")
    if nested and convention in ("vllm", "ours"):
        return from_engine_ids(nested, "vllm")
    if nested:
        raise ValueError(
            f"checkpoint config has aux ids {list(nested)} only under eagle_config, which SGLang/SpecForge count "
            "one layer shallower than vLLM: load it with convention='sglang' (trained with SpecForge or for "
            "SGLang) or convention='vllm' (written for vLLM)")
    raise ValueError("checkpoint config has no eagle_aux_hidden_state_layer_ids: refusing to guess them")


def config_from_json(data: dict, convention: str | None = None) -> DraftConfig:
    """DraftConfig from either layout; foreign checkpoints (no OUR_KEY block) are read from the HF fields.

    `convention`: how a foreign checkpoint counts its aux layer ids (see `aux_layer_ids_from_json`).
    """
    if OUR_KEY in data:
        config = DraftConfig.from_dict(data[OUR_KEY])
        if EXPORT_KEY in data and list(data[EXPORT_KEY]["aux_layer_ids"]) != list(config.aux_layer_ids):
            raise ValueError(f"config.json disagrees with itself: {EXPORT_KEY} aux_layer_ids "
                             f"{data[EXPORT_KEY]['aux_layer_ids']} != {OUR_KEY} {config.aux_layer_ids}")
        return config
    layer = data.get("transformer_layer_config", data)
    aux = aux_layer_ids_from_json(data, convention)
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
        # EAGLE 3.1, where vLLM looks for them (norm_before_fc also under eagle_config)
        norm_before_fc=bool((data.get("eagle_config") or {}).get("norm_before_fc", data.get("norm_before_fc"))),
        norm_output=bool(data.get("norm_output", False)),
        parallel_drafting=bool(data.get("parallel_drafting", False)),
        mask_token_id=data.get("mask_token_id") if data.get("parallel_drafting") else None,
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
               include_embeddings: bool | None = None, engine: str | None = None) -> Path:
    """Write `draft` as config.json + model.safetensors in the EAGLE-3 layout that vLLM, SGLang and SpecForge
    all read as trained (each aux-id key in the convention of the engines that read it; module docstring).

    `engine` does not change the folder; naming one ("vllm", "sglang", "specforge") refuses aux ids that engine
    cannot capture, where None only warns about them (`check_ids_for_engine`).
    """
    check_ids_for_engine(draft.config.aux_layer_ids, engine)
    dtype = dtype or draft.fc.weight.dtype
    return _write(folder, eagle3_config_json(draft, dtype), _tensors_to_save(draft, dtype, include_embeddings))


def refresh_export_config(folder) -> Path:
    """Rewrite the config.json of an EAGLE-3 folder of ours in the current convention; the weights stay as they are.

    Folders exported before the one-folder rule hold our ids in the nested `eagle_config` key too, from which
    SGLang and SpecForge capture one layer deeper than trained. The ids are taken from our own block
    (`eagle3_pipeline`), so the rewrite cannot shift them; a folder without that block is refused.
    """
    path = Path(folder) / CONFIG_FILE
    data = json.loads(path.read_text())
    if OUR_KEY not in data:
        raise ValueError(f"{path} has no {OUR_KEY!r} block: it was not written by this project, so its aux ids "
                         "cannot be re-derived safely; load it with load_draft(convention=...) and save_draft it")
    if "speculators_model_type" in data:
        raise ValueError(f"{path} is a speculators export (read by vLLM from its top-level key): nothing to refresh")
    config = config_from_json(data)
    path.write_text(json.dumps(eagle3_config_from(config, data.get("torch_dtype", "float32")), indent=2) + "\n")
    return Path(folder)


def export_speculators(draft: Eagle3Draft, folder, dtype: torch.dtype | None = None,
                       verifier=None, speculative_tokens: int | None = None,
                       include_embeddings: bool | None = None) -> Path:
    """Write `draft` in the `speculators` layout (Eagle3Speculator: `layers.0.*` keys) that vLLM loads.

    `verifier`: the target as vLLM must resolve it -- a hub model id, a local path, or the target model
    itself (its `name_or_path`); see `resolve_verifier`. The aux ids go to the top-level key, ours = vLLM's.
    A draft narrower or wider than its target is refused: speculators' `Eagle3DraftModel` sizes `fc` from the
    draft's own hidden size (3·H -> H), so a [H, 3·H_target] `fc.weight` does not load there.
    """
    cfg = draft.config
    if cfg.hidden_size != cfg.target_hidden_size:
        raise ValueError(
            f"export_speculators: the draft's hidden_size {cfg.hidden_size} differs from its target's "
            f"{cfg.target_hidden_size}; speculators' Eagle3DraftModel builds fc as 3*{cfg.hidden_size} -> "
            f"{cfg.hidden_size}, so fc.weight {[cfg.hidden_size, 3 * cfg.target_hidden_size]} would not load. "
            "Use save_draft (the EAGLE-3 folder, which vLLM and SGLang size from target_hidden_size)")
    check_ids_for_engine(cfg.aux_layer_ids)
    dtype = dtype or draft.fc.weight.dtype
    tensors = {name.replace("midlayer.", "layers.0.", 1): t
               for name, t in _tensors_to_save(draft, dtype, include_embeddings).items()}
    return _write(folder, speculators_config_json(draft, dtype, verifier, speculative_tokens), tensors)


# ---------------------------------------------------------------------------------------------------
# loading


def read_config(folder, convention: str | None = None) -> tuple[dict, DraftConfig]:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a draft checkpoint folder")
    data = json.loads(path.read_text())
    return data, config_from_json(data, convention)


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


def load_draft(folder, target=None, device=None, dtype=None, convention: str | None = None) -> Eagle3Draft:
    """Load a draft saved by `save_draft` or `export_speculators` (or a compatible EAGLE-3 checkpoint).

    With `target` (a transformers model) the checkpoint is validated against it and, when the draft
    shares the target's embeddings, they are attached. Without it such a draft has zero embeddings until
    `draft.set_target_embeddings(...)` is called (a warning says so). `convention` ("sglang"/"specforge" or
    "vllm") says how a checkpoint trained elsewhere counts its aux layer ids; ours carry a marker instead.
    `folder` is a local path or any fsspec URL (fetched once per node into the cache). `device` and `dtype`
    default to the target's when it is given (a bf16 target gets a bf16 draft), else to the checkpoint's place
    as loaded (CPU, float32).
    """
    folder = local_folder(folder)
    data, config = read_config(folder, convention)
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
    if target is not None:  # the draft runs beside the target: its device and dtype unless told otherwise
        device = device or target.get_input_embeddings().weight.device
        dtype = dtype or target.get_input_embeddings().weight.dtype
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
