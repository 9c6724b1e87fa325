"""Checkpoints of a training run: write one, restore from one (DDP or FSDP-sharded).

    draft/               `save_draft` folder (= the vLLM/SGLang layout), float32 master weights
    trainer_state.pt     optimiser, scheduler and RNG state (tensors and numbers: loaded with weights_only=True)
    state.json           step, epoch, step_in_epoch (the data position), rows_consumed, restored_from
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipelines.storage import commit_json


def save_checkpoint(draft, optimizer, scheduler, state: dict, folder: Path) -> None:
    from eagle_core.checkpoint import save_draft

    save_draft(draft, folder / "draft", dtype=torch.float32)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng},
               folder / "trainer_state.pt")
    commit_json(str(folder / "state.json"), state)


def load_draft_weights(draft, folder: Path) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "draft" / "model.safetensors"))
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - {"embed_tokens.weight"}:
        raise ValueError(f"checkpoint {folder} does not fit the draft: missing={missing} unexpected={unexpected}")


def restore_state(draft, folder: Path, state: dict) -> None:
    """The draft's weights and the run's position from a checkpoint (before wrapping the draft)."""
    load_draft_weights(draft, folder)
    state.update(json.loads((folder / "state.json").read_text()))
    state["restored_from"] = state.get("restored_from", []) + [state["step"]]


def _load_trainer_file(folder: Path) -> dict:
    return torch.load(folder / "trainer_state.pt", map_location="cpu", weights_only=True)


def load_trainer_state(optimizer, scheduler, folder: Path) -> None:
    saved = _load_trainer_file(folder)
    if optimizer is not None:
        optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    torch.set_rng_state(saved["rng"]["cpu"])
    if "cuda" in saved["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved["rng"]["cuda"])


def load_sharded_optimizer(objective, optimizer, folder: Path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    saved = _load_trainer_file(folder)
    set_optimizer_state_dict(objective, optimizer, saved["optimizer"], options=StateDictOptions(full_state_dict=True))


def restore_trainer(objective, optimizer, scheduler, folder: Path, sharded: bool) -> None:
    """Optimiser (FSDP: scattered to the shards), scheduler and RNG state, after wrapping the draft."""
    if sharded:
        load_sharded_optimizer(objective, optimizer, folder)
    load_trainer_state(None if sharded else optimizer, scheduler, folder)


def is_sharded(strategy: str, world: int) -> bool:
    return strategy == "fsdp" and world > 1


def full_state(draft, objective, optimizer, sharded: bool):
    """(a plain draft, an optimizer-like holder) with full tensors: FSDP gathers them on every rank (a collective)."""
    if not sharded:
        return draft, optimizer
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from eagle_core.draft import Eagle3Draft

    model_sd, optim_sd = get_state_dict(objective, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    shadow = Eagle3Draft(draft.config)  # a CPU copy to save from; embeddings stay the target's
    shadow.load_state_dict({k.removeprefix("draft."): v for k, v in model_sd.items()}, strict=False)
    return shadow, _StateHolder(optim_sd)


class _StateHolder:
    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state
