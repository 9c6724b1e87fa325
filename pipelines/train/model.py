"""The models on a worker: the target's heads, the draft (built, warm-started) and the TTT objective wrapped
for data parallelism (DDP or FSDP2)."""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from eagle_core.teacher import with_targets
from eagle_core.ttt import ttt_forward
from pipelines.train.config import TrainJobConfig
from pipelines.train.lineage import Lineage


def load_target_heads(target: str, device, dtype=torch.float32) -> dict:
    """The target's input embeddings, lm_head and final norm only (no decoder layers are loaded)."""
    from safetensors import safe_open

    from eagle_core.target import materialize_hf_folder

    folder = Path(materialize_hf_folder(target))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        where = json.loads(index.read_text())["weight_map"]
    else:
        where = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), "pt") as s:
                where.update({k: f.name for k in s.keys()})

    def get(name):
        with safe_open(str(folder / where[name]), "pt") as s:
            return s.get_tensor(name).to(device=device, dtype=dtype)

    embed = get("model.embed_tokens.weight")
    head = get("lm_head.weight") if "lm_head.weight" in where else embed  # tied embeddings
    return {"embed": embed, "lm_head": head, "norm": get("model.norm.weight")}


def target_config(target: str):
    from transformers import AutoConfig

    from eagle_core.target import materialize_hf_folder

    return AutoConfig.from_pretrained(materialize_hf_folder(target))


def vocab_from_counts(token_counts: dict, target_vocab_size: int, draft_vocab_size: int):
    from eagle_core.vocab import TokenCounter, build_vocab_mapping

    counter = TokenCounter(target_vocab_size)
    if token_counts:
        ids = torch.tensor([int(k) for k in token_counts])
        counter.merge(torch.zeros(target_vocab_size, dtype=torch.long).index_put_(
            (ids,), torch.tensor(list(token_counts.values()), dtype=torch.long)))
    return build_vocab_mapping(counter, min(draft_vocab_size, target_vocab_size))


def vocab_coverage(token_counts: dict, d2t: torch.Tensor) -> float:
    """The share of the loss tokens counted in `token_counts` that the draft vocabulary `d2t` holds. A draft never
    proposes a token outside its vocabulary, so the rest can never be accepted from it, however long it trains."""
    total = sum(token_counts.values())
    if not total:
        return 1.0
    from eagle_core.vocab import draft_ids_from_mapping

    held = set(draft_ids_from_mapping(d2t).tolist())
    return sum(count for token, count in token_counts.items() if int(token) in held) / total


def draft_config(config: TrainJobConfig, tconfig, aux_layer_ids=None):
    from eagle_core.draft import DRAFT_KINDS, DraftConfig

    return DraftConfig.from_target(tconfig, draft_vocab_size=config.draft_vocab_size, ttt_steps=config.ttt_steps,
                                   lm_head_init=config.lm_head_init, aux_layer_ids=aux_layer_ids,
                                   **DRAFT_KINDS[config.draft_kind])


def count_trainable(config: TrainJobConfig, tconfig) -> int:
    from eagle_core.draft import Eagle3Draft

    with torch.device("meta"):
        return Eagle3Draft(draft_config(config, tconfig)).num_trainable()


def build_draft(config: TrainJobConfig, tconfig, heads: dict, d2t, t2d, lineage: Lineage):
    from eagle_core.draft import Eagle3Draft

    cfg = draft_config(config, tconfig, lineage.aux_layer_ids)
    cfg.extra = lineage.draft_extra()
    torch.manual_seed(config.seed)  # every rank builds the same initial draft
    draft = Eagle3Draft(cfg, heads["embed"] if cfg.embeds_from_target else None).to(heads["embed"].device)
    draft.set_vocab(d2t.to(draft.d2t.device), t2d.to(draft.t2d.device))
    if cfg.lm_head_init == "target":
        draft.init_lm_head_from_target(heads["lm_head"], heads["norm"], tconfig)
    if config.init_from:
        warm_start(draft, config.init_from)
    return draft


def inherited_vocab(source: str, tconfig, draft_vocab_size: int) -> torch.Tensor | None:
    """The d2t of the draft a warm start comes from, when its vocabulary fits this run (same target, same draft
    vocabulary size); else None (the run builds its own from its token counts).

    A candidate warm-started from a champion keeps the champion's vocabulary, as fine-tuning a released draft
    does: rebuilt from a small fresh corpus (the demo's 40 rows) it shared 4 742 of 8 192 rows with the
    champion's, the other rows started from the target's head, and the warm-started candidate's step-0
    held-out accuracy read 0.085 where the champion's own is ~0.3."""
    from eagle_core.checkpoint import load_draft
    from pipelines.storage import resolve_source

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its shared target embeddings are not needed here
        old = load_draft(resolve_source(source))
    if old.config.target_vocab_size != tconfig.vocab_size or old.config.draft_vocab_size != draft_vocab_size:
        return None
    return old.d2t.clone()


@torch.no_grad()
def warm_start(draft, source: str) -> list[str]:
    """Seed `draft` with an earlier draft's weights (`source`: a folder, any fsspec URL or a `models:/` URI):
    every tensor of the same shape, and the lm_head rows of the target tokens both draft vocabularies hold (the
    vocab moves as the corpus grows). Returns what was copied; nothing when the aux layers or the target differ
    (different features: a fresh start is the honest one)."""
    from eagle_core.checkpoint import load_draft
    from pipelines.storage import resolve_source

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its shared target embeddings are not needed here
        old = load_draft(resolve_source(source), device=draft.fc.weight.device)
    same_features = (list(old.config.aux_layer_ids) == list(draft.config.aux_layer_ids)
                     and old.config.target_hidden_size == draft.config.target_hidden_size
                     and old.config.target_vocab_size == draft.config.target_vocab_size)
    if not same_features:
        print(f"[train] not warm-starting from {source}: it was trained on other target features", flush=True)
        return []
    ours, copied = draft.state_dict(), []
    for name, tensor in old.state_dict().items():
        if name in ("d2t", "t2d") or name.startswith("embed_tokens") or name not in ours:
            continue
        if name == "lm_head.weight":
            if tensor.shape[1] == ours[name].shape[1]:
                _copy_shared_vocab_rows(old, draft, tensor, ours[name])
                copied.append(name)
        elif ours[name].shape == tensor.shape:
            ours[name].copy_(tensor)
            copied.append(name)
    return copied


def _copy_shared_vocab_rows(old, draft, old_head: torch.Tensor, new_head: torch.Tensor) -> None:
    """new_head[i] = old_head[j] wherever draft token i and old draft token j are the same target token.

    The other rows (tokens new to the vocabulary) keep their initial values, except where those are the target's
    own head rows (`lm_head_init="target"`): training moved the old draft's rows away from the target's, and the
    draft's hidden states with them, so raw target rows score far above every trained one (measured on the shipped
    SmolLM2 draft grown from 8 192 to 16 384 rows: every position predicted one new token, held-out accuracy 0.0
    where the old draft has 0.30). One least-squares linear map, fitted from the target's rows of the shared tokens
    to their trained rows, carries the new tokens' target rows into the trained head's space (same draft: accuracy
    0.30, the old draft's); it needs at least as many shared rows as the hidden size."""
    old_row = torch.full((draft.config.target_vocab_size,), -1, dtype=torch.long, device=old_head.device)
    old_draft_ids = torch.arange(old.d2t.numel(), device=old_head.device)
    old_row[old.draft_to_target(old_draft_ids)] = old_draft_ids
    new_targets = draft.draft_to_target(torch.arange(draft.d2t.numel(), device=draft.d2t.device))
    rows = old_row[new_targets.to(old_head.device)]
    shared = rows >= 0
    if draft.config.lm_head_init == "target" and not bool(shared.all()) and int(shared.sum()) >= new_head.shape[1]:
        start = new_head.detach().float().cpu()  # the target's rows: what the new tokens would start from
        mapping = torch.linalg.lstsq(start[shared.cpu()], old_head[rows[shared]].float().cpu()).solution  # [H, H]
        new_head[~shared] = (start[~shared.cpu()] @ mapping).to(new_head.device, new_head.dtype)
    new_head[shared] = old_head[rows[shared]].to(new_head.dtype)


class TTTObjective(nn.Module):
    """`ttt_forward` as a module's forward: DDP/FSDP sync gradients only for losses computed inside it.

    bf16 autocast on CUDA wraps the draft's compute; the draft's logits and losses are float32 by construction.
    The target distribution of a batch: `with_targets` outside autocast gives the float32 teacher; `teacher`
    gives it under this objective's autocast (on CUDA the draft-vocabulary soft labels from bf16 inputs and the
    float32 argmax from a float16 screen, `eagle_core.teacher.low_precision_teacher`: a full-vocabulary float32 GEMM
    was the largest cost of a step on an H200, issue 40).
    """

    def __init__(self, draft, autocast: bool):
        super().__init__()
        self.draft = draft
        self.autocast = autocast

    def forward(self, *args, **kwargs):
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=self.autocast):
            return ttt_forward(self.draft, *args, **kwargs)

    def teacher(self, batch: dict, target_lm_head_weight) -> dict:
        """`batch` plus its target distribution, computed under this objective's autocast."""
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=self.autocast):
            return with_targets(batch, target_lm_head_weight, self.draft.d2t)


@contextmanager
def gradient_sync(objective, last: bool):
    """Around a micro-batch's forward and backward: gradients are synced over the ranks only for a step's `last`
    micro-batch (DDP's `no_sync`, FSDP2's `set_requires_gradient_sync`), the others accumulate locally; alone there is
    nothing to sync. Every rank runs as many micro-batches (`loop.rank_batches`), so the collectives pair up."""
    from torch.nn.parallel import DistributedDataParallel

    if last:
        yield
    elif isinstance(objective, DistributedDataParallel):
        with objective.no_sync():
            yield
    elif hasattr(objective, "set_requires_gradient_sync"):  # fully_shard (FSDP2)
        objective.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            objective.set_requires_gradient_sync(True)
    else:
        yield


def wrap_objective(objective: TTTObjective, strategy: str, world: int, device):
    """DDP (gloo on CPU, nccl on GPU: Ray Train sets the backend) or FSDP2 over the objective; as-is alone."""
    if world == 1:
        return objective
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        # One FSDP unit: the draft's submodules are called from ttt_forward, never through their own forward,
        # so only the root's forward hook is sure to gather the parameters (one decoder layer: little to overlap).
        return fully_shard(objective)
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(objective, device_ids=ids)
