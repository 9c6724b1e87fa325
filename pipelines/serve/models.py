"""Load the target and the draft for serving, from a folder, a target name, or an MLflow registry URI."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

REGISTRY_PREFIX = "models:/"


def is_registry_uri(source: str) -> bool:
    return str(source).startswith(REGISTRY_PREFIX)


def _model_folder(root: Path) -> Path:
    """The folder under a downloaded artifact tree that holds `config.json` (shallowest first)."""
    if (root / "config.json").is_file():
        return root
    found = sorted(root.rglob("config.json"), key=lambda p: len(p.parts))
    if not found:
        raise FileNotFoundError(f"no config.json under the registry artifacts in {root}")
    return found[0].parent


def resolve_source(source: str) -> str:
    """`models:/<name>@<alias>` (or `/<version>`) -> a local folder; anything else is returned unchanged."""
    if not is_registry_uri(source):
        return str(source)
    from pipelines import tracking

    mlflow = tracking.configure()
    local = mlflow.artifacts.download_artifacts(artifact_uri=source)
    return str(_model_folder(Path(local)))


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class LoadedModels:
    target: torch.nn.Module
    tokenizer: object
    draft: torch.nn.Module | None
    context_length: int  # the target's max_position_embeddings


def load_models(target: str, draft: str | None = None, device: str | None = None, dtype="auto") -> LoadedModels:
    """Target (+ draft, validated against it) on one device, in eval mode."""
    from eagle_core.checkpoint import load_draft
    from eagle_core.target import load_target

    device = device or default_device()
    model, tokenizer = load_target(resolve_source(target), device=device, dtype=dtype)
    draft_model = None
    if draft:
        dtype_ = model.get_input_embeddings().weight.dtype
        draft_model = load_draft(resolve_source(draft), target=model, device=device, dtype=dtype_).eval()
    context = int(getattr(model.config, "max_position_embeddings", 2048) or 2048)
    return LoadedModels(model, tokenizer, draft_model, context)
