"""Which engine decodes for a replica (`ServeConfig.engine_name`): this project's decoder (`eagle3`: EAGLE-2 dynamic
trees over transformers models, `pipelines.serve.engine.Engine`) or vLLM (`vllm`: its async engine with the draft
as an EAGLE-3 speculator, `pipelines.serve.vllm_engine.VllmServeEngine`).

Both have one interface — `submit`, `load`, `stalled`, `begin_drain`, `close`, `load_draft(source)` then
`set_draft(handle, version)`, `draft_version`, `thread`, `sink_errors` — and `Service` runs the same routes, limits,
metrics, acceptance labels and champion following over either. `SERVE_ENGINES` is the one place that picks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

ENGINE_NAMES = ("eagle3", "vllm")


@dataclass
class Started:
    engine: object
    tokenizer: object
    vocab_size: int
    context_length: int  # the target's max_position_embeddings
    dtype: torch.dtype  # the target's compute dtype
    speculative: bool


def start_eagle3(config, draft_source: str | None, version: str | None, metrics, start_sink: Callable) -> Started:
    """Target (+ draft) as transformers models and this project's decoder; `start_sink(models)` gives the traffic
    sink (or None), closed again if the engine does not start."""
    from eagle_core.target import device_map_for
    from pipelines.serve.engine import Engine
    from pipelines.serve.models import load_models

    device_map = config.device_map if config.device_map is not None else device_map_for()
    models = load_models(config.target, draft_source, config.device, config.dtype, device_map)
    sink = start_sink(models)
    try:
        engine = Engine(models.target, models.tokenizer, models.draft, config.engine, metrics=metrics,
                        draft_version=version, sink=sink)
    except BaseException:
        if sink is not None:
            sink.close(0)
        raise
    return Started(engine, models.tokenizer, models.target.get_input_embeddings().weight.shape[0],
                   models.context_length, models.target.get_input_embeddings().weight.dtype,
                   models.draft is not None)


def start_vllm(config, draft_source: str | None, version: str | None, metrics, start_sink: Callable) -> Started:
    """vLLM on the target with the draft as its speculator (`num_speculative_tokens`, default the draft's TTT
    depth). The checks of the extraction engine run first (vLLM installed, the architecture in its registry, a
    head size its CPU attention runs)."""
    from transformers import AutoConfig, AutoTokenizer

    from eagle_core.target import default_device, materialize_hf_folder, resolve_dtype
    from pipelines.engines import EngineConfig as TargetEngineConfig
    from pipelines.engines import check_engine
    from pipelines.serve.vllm_engine import VllmServeEngine
    from pipelines.storage import resolve_source

    check_engine(TargetEngineConfig(target=resolve_source(config.target), dtype=config.dtype, engine="vllm"))
    folder = materialize_hf_folder(resolve_source(config.target))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    target_config = AutoConfig.from_pretrained(folder)
    context = int(getattr(target_config, "max_position_embeddings", 2048) or 2048)
    dtype = resolve_dtype(config.dtype, config.device or default_device())
    engine = VllmServeEngine(str(folder), tokenizer, draft_source, config.engine, target_config=target_config,
                             dtype=str(dtype).removeprefix("torch."), max_model_len=min(config.max_context, context),
                             num_speculative_tokens=config.num_speculative_tokens, metrics=metrics,
                             draft_version=version)
    return Started(engine, tokenizer, int(target_config.vocab_size), context, dtype, draft_source is not None)


SERVE_ENGINES: dict[str, Callable[..., Started]] = {"eagle3": start_eagle3, "vllm": start_vllm}
