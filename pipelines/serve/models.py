"""Load the target and the draft for serving, from a folder, a URL, a target name, a hub id or an MLflow registry
URI (`pipelines.storage.resolve_source`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


LOCAL_DRAFT = "local"  # the version label of a draft loaded from a folder or URL (no registry version)
NO_DRAFT = "none"  # ... and of plain decoding


def pin_draft(source: str | None) -> tuple[str | None, str | None]:
    """(what to load, its version label): `models:/<name>@<alias>` -> `models:/<name>/<N>` (the version the alias
    names now) and "N"; `models:/<name>/<N>` -> itself and "N"; a folder or URL -> itself and "local"."""
    from pipelines.storage import is_registry_uri, pin_registry_uri

    if not source:
        return None, None
    if not is_registry_uri(source):
        return source, LOCAL_DRAFT
    pinned = pin_registry_uri(source)
    return pinned, pinned.rpartition("/")[2]


def watches_alias(source: str | None) -> bool:
    """Whether a draft source is a registry alias, which can move (a version number or a folder cannot)."""
    from pipelines.storage import is_registry_uri

    return bool(source) and is_registry_uri(source) and "@" in source


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
