"""Load the target and the draft for serving, from a folder, a URL, a target name, a hub id or an MLflow registry
URI (`pipelines.storage.resolve_source`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoadedModels:
    target: torch.nn.Module
    tokenizer: object
    draft: torch.nn.Module | None
    context_length: int  # the target's max_position_embeddings


def load_models(target: str, draft: str | None = None, device: str | None = None, dtype="auto",
                device_map: str | None = None) -> LoadedModels:
    """Target (+ draft, validated against it) in eval mode: on one device, or spread by `device_map` over
    several GPUs (the draft then sits with the target's embeddings, where decoding keeps its state)."""
    from eagle_core.target import default_device, load_target
    from pipelines.storage import resolve_source

    device = device or default_device()
    model, tokenizer = load_target(resolve_source(target), device=device, dtype=dtype, device_map=device_map)
    draft_model = load_draft_for(model, draft) if draft else None
    context = int(getattr(model.config, "max_position_embeddings", 2048) or 2048)
    return LoadedModels(model, tokenizer, draft_model, context)


def load_draft_for(target: torch.nn.Module, source: str) -> torch.nn.Module:
    """A draft (folder, URL or registry URI), validated against `target`, beside its embeddings and in its dtype
    (load_draft's default with a target), in eval mode."""
    from eagle_core.checkpoint import load_draft
    from pipelines.storage import resolve_source

    return load_draft(resolve_source(source), target=target).eval()
