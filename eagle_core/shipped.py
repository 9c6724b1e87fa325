"""Drafts that ship with the project: a trained EAGLE-3 draft for each embedded target.

`shipped_draft(name)` is the default draft wherever one is needed for a named target (serve,
benchmarks, the demo's first champion, tests that need a trained draft). Each folder holds config.json,
model.safetensors (bf16) and a model card (README.md) with its data, recipe and measured acceptance.
"""

from __future__ import annotations

from pathlib import Path

from eagle_core.target import GEMMA3_NAME, SMOLLM2_NAME

DRAFTS_DIR = Path(__file__).resolve().parent / "drafts"
SHIPPED = {SMOLLM2_NAME: "smollm2-135m-instruct", GEMMA3_NAME: "gemma3-270m"}


def shipped_draft(target: str = SMOLLM2_NAME) -> Path:
    """The folder of the draft shipped for `target`; FileNotFoundError when the project ships none."""
    name = SHIPPED.get(str(target))
    if name is None:
        raise FileNotFoundError(f"no draft ships for target {target!r} (shipped: {sorted(SHIPPED)}); train one: "
                                f"`python jobs/train.py --target {target} --corpus CORPUS --dry-run` plans it with the "
                                "target's recipe (docs/recipes.md), the same line without --dry-run runs it on Ray; "
                                f"`python -m jobs.distill --target {target}` trains a small target in one process")
    folder = DRAFTS_DIR / name
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is missing its config.json: the checkout is incomplete")
    return folder
