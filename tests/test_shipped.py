"""The draft shipped for the embedded target: small enough for git, loads against the target, and drafts well."""

import pytest
import torch

from eagle_core.checkpoint import load_draft, read_config
from eagle_core.shipped import shipped_draft


def test_shipped_draft_is_small_bf16_and_documented():
    folder = shipped_draft("smollm2-135m")
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert size <= 25 * 2**20, f"{size / 2**20:.1f} MiB"
    data, config = read_config(folder)
    assert data["torch_dtype"] == "bfloat16"
    assert config.aux_layer_ids == [2, 15, 27]
    card = (folder / "README.md").read_text()
    for needed in ("python -m jobs.distill", "held-out", "tau"):
        assert needed in card


def test_unknown_target_has_no_shipped_draft():
    with pytest.raises(FileNotFoundError, match="no draft ships"):
        shipped_draft("meta-llama/Llama-3.1-8B-Instruct")
