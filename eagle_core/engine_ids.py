"""Aux layer ids across engines: which hidden states an id names in vLLM, SGLang and SpecForge.

Our ids index transformers' `output_hidden_states` (0 = embeddings, j = output of decoder layer j-1).
The engines read two different keys, in two conventions:

    key                                         read by                         an id s captures
    eagle_aux_hidden_state_layer_ids (top)      vLLM (read first)               hidden_states[s]      (= ours)
    eagle_config.eagle_aux_hidden_state_...     SGLang, SpecForge; vLLM only    SGLang/SpecForge: hidden_states[s+1]
                                                when the top-level key is       vLLM: hidden_states[s]
                                                absent

Rule: every key is written in the convention of the engines that read it, so one folder serves all of
them. The top-level key holds ours (only vLLM reads it, and reads it first); the nested key holds ours - 1
(SGLang and SpecForge add 1 back). Both keys are always written, so no vLLM version reaches its fallback to
the nested key. A marker block `eagle3_pipeline_export` records our ids and the conventions, so our loader
never has to guess; a checkpoint without it (trained elsewhere) is read with
`load_draft(..., convention="sglang"|"vllm")`. Folders written before this rule (nested key = ours, marker
engine "vllm") are read right by our loader and vLLM, but SGLang captures one layer deeper from them:
`refresh_export_config(folder)` rewrites their config.json (weights untouched).

What remains engine-specific: id 0 (the embeddings) is -1 in SGLang's convention, which SpecForge refuses,
and vLLM's Llama forward adds a residual that does not exist before layer 0; `save_draft` warns about it.
The `speculators` layout is vLLM's only and holds drafts as wide as their target (`export_speculators`).
"""

from __future__ import annotations

import warnings

ENGINES = ("vllm", "sglang", "specforge")
CONVENTIONS = ("ours", "vllm", "sglang", "specforge")  # vllm == ours; specforge == sglang
# The convention each aux-id key of an EAGLE-3 folder is written in (the rule above).
KEY_CONVENTIONS = {"eagle_aux_hidden_state_layer_ids": "vllm",
                   "eagle_config.eagle_aux_hidden_state_layer_ids": "sglang"}
AUX_ID_RULE = ("top-level eagle_aux_hidden_state_layer_ids: output_hidden_states index, read by vLLM; "
               "eagle_config.eagle_aux_hidden_state_layer_ids: index - 1 (the decoder layer whose output is "
               "captured), read by SGLang and SpecForge, which add 1 back")


def to_engine_ids(aux_layer_ids, engine: str) -> list[int]:
    """Our aux ids (output_hidden_states indices) in `engine`'s convention ("vllm": as ours; "sglang" and
    "specforge": ours - 1, the decoder layer whose output is captured)."""
    if engine == "vllm":
        return [int(i) for i in aux_layer_ids]
    if engine in ("sglang", "specforge"):
        return [int(i) - 1 for i in aux_layer_ids]  # SGLang/SpecForge name the layer whose output is captured
    raise ValueError(f"unknown engine {engine!r}: expected one of {ENGINES}")


def from_engine_ids(ids, convention: str) -> list[int]:
    """Ids written in `convention` as ours (output_hidden_states indices); inverse of `to_engine_ids`."""
    if convention in ("ours", "vllm"):
        return [int(i) for i in ids]
    if convention in ("sglang", "specforge"):
        return [int(i) + 1 for i in ids]
    raise ValueError(f"unknown aux layer id convention {convention!r}: expected one of {CONVENTIONS}")


def check_ids_for_engine(aux_layer_ids, engine: str | None = None) -> None:
    """Warn (engine None: any engine) or refuse (a named engine) aux ids that engine cannot capture.

    Id 0 (the embeddings) is the one id not every engine can take: it is -1 in SGLang's convention, which
    SpecForge's id validation refuses, and vLLM's Llama forward adds a residual that does not exist yet before
    decoder layer 0. SGLang itself captures it (its -1 + 1 = 0, the input of layer 0).
    """
    if engine is not None and engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: expected one of {ENGINES} (or None for all of them)")
    if 0 not in [int(i) for i in aux_layer_ids]:
        return
    unable = {"vllm": "vLLM's Llama forward adds a residual that is None before layer 0",
              "specforge": "SpecForge refuses the id -1 that names it in its convention"}
    if engine in unable:
        raise ValueError(f"aux_layer_ids {list(aux_layer_ids)} include 0 (the embeddings), which {engine} cannot "
                         f"capture: {unable[engine]}; train with ids >= 1")
    if engine is None:
        warnings.warn(f"aux_layer_ids {list(aux_layer_ids)} include 0 (the embeddings): SGLang and our serving "
                      "capture it, vLLM and SpecForge cannot (" + "; ".join(unable.values()) + ")", stacklevel=3)
