"""Ray Train job: EAGLE-3 training-time-test (TTT) training of the draft, with checkpoints, resume and MLflow.

    features (an extraction output, or a stream of them) -> TorchTrainer workers -> draft -> export + registry

Data (features mode). The driver reads only the light columns (`id`, `input_ids`) of the Parquet shards and
plans every optimiser step of every epoch, independently of the number of workers:
  - held-out split: the `eval_fraction` of conversations whose id hash is smallest (stable across runs);
  - epoch order: the shards in a seeded permutation, the rows of each shard in a seeded permutation (reads
    stay shard-sequential, nothing is shuffled through the object store);
  - global batches: consecutive rows up to `tokens_per_batch` real tokens (one optimiser step);
  - each global batch is split over the W ranks, longest rows first onto the least loaded rank.
Each rank's share is a Ray Dataset (plan rows -> the feature rows read from their shard), handed to it by
`PlannedShards` under `get_dataset_shard("train.<epoch>")` / `("eval")`. A rank pads its micro-batch to its
longest row. The TTT loss of a rank is normalised by the *global* per-step position counts (all-reduced
first, see `ttt_forward(step_denominators=...)`), so DDP's averaged gradient equals one process training on
the whole global batch: 1 worker and W workers follow the same trajectory, up to float rounding.

Data (streaming mode: `corpus`, no features on disk). `stream_features` feeds the workers through the
default streaming split; each rank batches its own rows by `tokens_per_batch / W`. The draft vocabulary and
the step count come from a cheap first pass that only tokenises the corpus (chat template + loss mask,
no target forward); with regeneration on, those counts are of the corpus' own replies (an approximation).
The held-out rows (same id-hash rule) are set aside by the rank that receives them. Which rank gets which
row is up to Ray Data here, so resuming skips as many rows as were consumed but not the very same ones.

Checkpoints (`checkpoint_every` steps, every epoch end, and the end; the last `keep_checkpoints` kept):
    draft/               `save_draft` folder (= the vLLM/SGLang layout), float32 master weights
    trainer_state.pt     optimiser, scheduler and RNG state (tensors and numbers: loaded with weights_only=True)
    state.json           step, epoch, step_in_epoch (the data position), rows_consumed, lineage
Resume: rerun with the same output (`resume=True`): Ray Train v2 restores the run `RunConfig(name,
storage_path)` and `ray.train.get_checkpoint()` hands the workers the latest checkpoint; a worker that
dies mid-run is restarted from it too (`max_failures`).

MLflow (rank 0 only): params (incl. the features manifest's sha256 and extraction run id), per-step loss,
accuracy, tokens/s and learning rate, per-epoch held-out accuracy and simulated acceptance length; the
driver then logs the exported draft (both layouts), loss-curve and acceptance-per-position PNGs, and
registers the draft as a new version of `registered_model_name` with alias `candidate`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import signal
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

from eagle_core.ttt import TrainConfig, ttt_forward

STRATEGIES = ("ddp", "fsdp")
LM_HEAD_INITS = ("random", "target")
CANDIDATE_ALIAS = "candidate"


@dataclass
class TrainJobConfig:
    features: str | None = None  # an extraction output URL (features mode)
    corpus: str | None = None  # streaming mode: a corpus URL ('sharegpt' = embedded); `extract` holds the rest
    extract: dict = field(default_factory=dict)  # ExtractConfig fields for streaming (target/output excluded)
    output: str = "work/train"
    target: str | None = None  # None: the manifest's target (features mode); required when streaming
    num_workers: int = 1
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    strategy: str = "ddp"  # "fsdp" shards draft, gradients and optimiser state (large drafts)
    epochs: int = 1
    max_steps: int | None = None  # stop after this many optimiser steps (None: all epochs)
    lr: float = 1e-4
    warmup_steps: int | None = None  # None: warmup_ratio of the planned steps
    warmup_ratio: float = 0.03
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5
    tokens_per_batch: int = 8192  # real tokens per optimiser step, over all workers together
    ttt_steps: int = 7
    step_decay: float = 0.8
    draft_vocab_size: int = 32000
    lm_head_init: str = "random"
    eval_fraction: float = 0.05
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    resume: bool = False
    max_failures: int = 0  # worker failures Ray Train recovers from (restarting from the last checkpoint)
    seed: int = 0
    log_every: int = 10  # progress lines on rank 0 (MLflow gets every step)
    run_name: str | None = None  # None: "train-<output folder name>"
    mlflow_experiment: str | None = "eagle3-train"
    registered_model_name: str | None = "eagle3-draft"
    fault_at_step: int | None = None  # tests: rank 0 SIGKILLs its own process once, after this step
    init_from: str | None = None  # warm start: a draft folder whose weights seed this draft where shapes agree

    def __post_init__(self):
        if (self.features is None) == (self.corpus is None):
            raise ValueError("give exactly one of features (an extraction output) or corpus (streaming)")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.lm_head_init not in LM_HEAD_INITS:
            raise ValueError(f"lm_head_init must be one of {LM_HEAD_INITS}, got {self.lm_head_init!r}")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError("eval_fraction must be in [0, 1)")
        if self.corpus is not None and self.target is None:
            raise ValueError("streaming from a corpus needs --target")

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def name(self) -> str:
        return self.run_name or f"train-{os.path.basename(self.output.rstrip('/')) or 'run'}"

    def train_config(self, total_steps: int) -> TrainConfig:
        warmup = self.warmup_steps if self.warmup_steps is not None else int(self.warmup_ratio * total_steps)
        return TrainConfig(lr=self.lr, weight_decay=self.weight_decay, warmup_steps=warmup, total_steps=total_steps,
                           min_lr_ratio=self.min_lr_ratio, max_grad_norm=self.max_grad_norm,
                           step_decay=self.step_decay, ttt_steps=self.ttt_steps)


def _join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


# ---------------------------------------------------------------------------------------------------
# the plan: held-out split, epoch order, global batches, rank shares (driver side, light columns only)


def id_hash(conversation_id: str) -> str:
    return hashlib.sha256(conversation_id.encode()).hexdigest()


def scan_features(features: str) -> list[dict]:
    """One light record per feature row: {id, file, row, length} (reads the id and input_ids columns only)."""
    fs, path = fsspec.core.url_to_fs(_join(features, "features"))
    files = sorted(p for p in fs.ls(path, detail=False) if p.endswith(".parquet"))
    rows = []
    for f in files:
        with fs.open(f, "rb") as handle:
            table = pq.read_table(handle, columns=["id", "input_ids"])
        url = fs.unstrip_protocol(f)  # fs.ls drops the protocol; the readers may run on other nodes
        for i, (cid, ids) in enumerate(zip(table["id"].to_pylist(), table["input_ids"].to_pylist())):
            rows.append({"id": cid, "file": url, "row": i, "length": len(ids)})
    return rows


def split_heldout(rows: list[dict], eval_fraction: float) -> tuple[list[dict], list[dict]]:
    """(train, eval): the ceil(fraction * n) rows with the smallest id hash are held out; at least one trains."""
    n_eval = min(math.ceil(eval_fraction * len(rows)), max(len(rows) - 1, 0)) if eval_fraction > 0 else 0
    held = {r["id"] for r in sorted(rows, key=lambda r: id_hash(r["id"]))[:n_eval]}
    return [r for r in rows if r["id"] not in held], [r for r in rows if r["id"] in held]


def epoch_order(rows: list[dict], seed: int, epoch: int) -> list[dict]:
    """Shards in a seeded permutation, rows of each shard permuted too: random enough, reads stay sequential."""
    rng = random.Random(seed * 1_000_003 + epoch)
    by_file: dict[str, list[dict]] = {}
    for r in rows:
        by_file.setdefault(r["file"], []).append(r)
    files = sorted(by_file)
    rng.shuffle(files)
    ordered = []
    for f in files:
        group = sorted(by_file[f], key=lambda r: r["row"])
        rng.shuffle(group)
        ordered += group
    return ordered


def pack_batches(rows: list[dict], tokens_per_batch: int) -> list[list[dict]]:
    """Consecutive rows up to `tokens_per_batch` real tokens each (a longer row is a batch by itself)."""
    batches, current, tokens = [], [], 0
    for r in rows:
        if current and tokens + r["length"] > tokens_per_batch:
            batches.append(current)
            current, tokens = [], 0
        current.append(r)
        tokens += r["length"]
    if current:
        batches.append(current)
    return batches


def split_over_ranks(batch: list[dict], world: int) -> list[list[dict]]:
    """Longest rows first onto the rank with the fewest tokens (ties: fewer rows, lower rank); deterministic."""
    shares = [[] for _ in range(world)]
    load = [(0, 0, r) for r in range(world)]
    for row in sorted(batch, key=lambda r: -r["length"]):
        tokens, count, rank = min(load)
        shares[rank].append(row)
        load[rank] = (tokens + row["length"], count + 1, rank)
    return shares


def plan_steps(batches: list[list[dict]], world: int) -> list[list[dict]]:
    """Per rank, its plan rows {file, row, step, slot}: read order (file by file), `slot` = order in its micro-batch."""
    per_rank = [[] for _ in range(world)]
    position = {}
    for step, batch in enumerate(batches):
        for r in batch:
            position[(r["file"], r["row"])] = len(position)
        for rank, share in enumerate(split_over_ranks(batch, world)):
            per_rank[rank] += [{"file": r["file"], "row": r["row"], "step": step, "slot": slot}
                               for slot, r in enumerate(share)]
    for entries in per_rank:
        entries.sort(key=lambda e: position[(e["file"], e["row"])])
    return per_rank


def read_items(entries: list[dict]) -> list[dict]:
    """Group consecutive plan rows of one shard file: each item makes one task read that file once."""
    items = []
    for e in entries:
        if not items or items[-1]["file"] != e["file"]:
            items.append({"file": e["file"], "rows": [], "steps": [], "slots": []})
        items[-1]["rows"].append(e["row"])
        items[-1]["steps"].append(e["step"])
        items[-1]["slots"].append(e["slot"])
    return items


def read_planned_rows(batch: pa.Table) -> pa.Table:
    """Ray Data map: plan items -> the feature rows they name, each tagged with its step and slot."""
    out = []
    for item in batch.to_pylist():
        with fsspec.open(item["file"], "rb") as f:
            table = pq.read_table(f).take(pa.array(item["rows"], pa.int64()))
        table = table.append_column("step", pa.array(item["steps"], pa.int32()))
        out.append(table.append_column("slot", pa.array(item["slots"], pa.int32())))
    return pa.concat_tables(out)


def planned_dataset(entries: list[dict]):
    import ray

    items = read_items(entries)
    if not items:
        return ray.data.from_items([{"file": "", "rows": [], "steps": [], "slots": []}]).limit(0)
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    # Decoding a shard is light work next to a training step: a fraction of a CPU keeps workers unstarved.
    return ds.map_batches(read_planned_rows, batch_size=1, batch_format="pyarrow", num_cpus=0.25)


def make_plan(train_rows: list[dict], eval_rows: list[dict], config: TrainJobConfig, world: int) -> dict:
    """Steps per epoch and, per rank, the plan rows of every epoch and of the held-out split."""
    epochs = [pack_batches(epoch_order(train_rows, config.seed, e), config.tokens_per_batch)
              for e in range(config.epochs)]
    eval_batches = pack_batches(sorted(eval_rows, key=lambda r: id_hash(r["id"])), config.tokens_per_batch)
    return {
        "steps_per_epoch": [len(b) for b in epochs],
        "eval_steps": len(eval_batches),
        "train": [plan_steps(b, world) for b in epochs],  # [epoch][rank] -> entries
        "eval": plan_steps(eval_batches, world),  # [rank] -> entries
        "tokens_per_epoch": sum(r["length"] for r in train_rows),
    }


def train_dataset_name(epoch: int) -> str:
    return f"train.{epoch}"


def build_planned_datasets(plan: dict, world: int) -> dict:
    """{"train.<epoch>": [per-rank Dataset], "eval": [...]}: lazy, nothing is read until a rank iterates its own."""
    datasets = {train_dataset_name(e): [planned_dataset(entries) for entries in ranks]
                for e, ranks in enumerate(plan["train"])}
    datasets["eval"] = [planned_dataset(entries) for entries in plan["eval"]]
    return datasets


def _planned_shards_class():
    from ray.train import DataConfig

    class PlannedShards(DataConfig):
        """Hands rank r its own planned Dataset for the names in `per_rank`, in order; others split as usual.

        Ray Train asks for one dataset name at a time; the trainer's `datasets` entry for a planned name is
        only a stand-in (rank 0's share), so Ray Train knows the name.
        """

        def __init__(self, per_rank: dict):
            super().__init__()
            self.per_rank = per_rank

        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
            routed = {n for n in datasets if n in self.per_rank}
            rest = {n: ds for n, ds in datasets.items() if n not in routed}
            output = super().configure(rest, world_size, worker_handles, worker_node_ids, **kwargs) if rest \
                else [{} for _ in range(world_size)]
            for name in routed:
                for rank, ds in enumerate(self.per_rank[name]):
                    ds = ds.copy(ds)
                    ds.context.execution_options = self._resolve_execution_options(name)
                    ds.context.execution_options.preserve_order = True  # the plan's order is the training order
                    output[rank][name] = ds.iterator()
            return output

    return PlannedShards


# ---------------------------------------------------------------------------------------------------
# streaming mode: a cheap first pass for the vocabulary and the step count


def stream_first_pass(config: TrainJobConfig, extract_config) -> dict:
    """Token counts and lengths of the corpus after the chat template and loss mask (no target forward)."""
    from transformers import AutoTokenizer

    from eagle_core.features import tokenize_for_training
    from eagle_core.target import materialize_hf_folder
    from pipelines.data import ingest

    tokenizer = AutoTokenizer.from_pretrained(materialize_hf_folder(config.target))
    rows = ingest(extract_config.corpus, limit=extract_config.limit).dataset.take_all()
    tokenized, _ = tokenize_for_training(tokenizer, rows, extract_config.max_length)
    counts: dict[int, int] = {}
    for _, ids, mask in tokenized:
        for t, m in zip(ids, mask):
            if m:
                counts[t] = counts.get(t, 0) + 1
    light = [{"id": cid, "length": len(ids)} for cid, ids, _ in tokenized]
    train, held = split_heldout(light, config.eval_fraction)
    return {"token_counts": counts, "rows": len(light), "tokens": sum(r["length"] for r in light),
            "eval_ids": sorted(r["id"] for r in held), "train_tokens": sum(r["length"] for r in train)}


# ---------------------------------------------------------------------------------------------------
# worker side: target heads, draft, batches, distributed helpers


def load_target_heads(target: str, device, dtype=torch.float32) -> dict:
    """The target's input embeddings, lm_head and final norm only (no decoder layers are loaded)."""
    from safetensors import safe_open

    from eagle_core.target import materialize_hf_folder

    folder = Path(materialize_hf_folder(target))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        where = json.loads(index.read_text())["weight_map"]
    else:
        files = sorted(folder.glob("*.safetensors"))
        where = {}
        for f in files:
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


def build_draft(config: TrainJobConfig, tconfig, heads: dict, d2t, t2d, lineage: dict):
    from eagle_core.draft import DraftConfig, Eagle3Draft

    cfg = DraftConfig.from_target(tconfig, draft_vocab_size=config.draft_vocab_size, ttt_steps=config.ttt_steps,
                                  lm_head_init=config.lm_head_init, aux_layer_ids=lineage.get("aux_layer_ids"))
    cfg.extra = {k: v for k, v in lineage.items() if k != "aux_layer_ids"}
    torch.manual_seed(config.seed)  # every rank builds the same initial draft
    draft = Eagle3Draft(cfg, heads["embed"] if cfg.embeds_from_target else None).to(heads["embed"].device)
    draft.set_vocab(d2t.to(draft.d2t.device), t2d.to(draft.t2d.device))
    if cfg.lm_head_init == "target":
        draft.init_lm_head_from_target(heads["lm_head"], heads["norm"])
    if config.init_from:
        warm_start(draft, config.init_from)
    return draft


@torch.no_grad()
def warm_start(draft, folder: str) -> list[str]:
    """Seed `draft` with an earlier draft's weights: every tensor of the same shape, and the lm_head rows of the
    target tokens both draft vocabularies hold (the vocab moves as the corpus grows). Returns what was copied;
    nothing when the aux layers or the target differ (different features: a fresh start is the honest one)."""
    import warnings

    from eagle_core.checkpoint import load_draft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its shared target embeddings are not needed here
        old = load_draft(folder, device=draft.fc.weight.device)
    same_features = (list(old.config.aux_layer_ids) == list(draft.config.aux_layer_ids)
                     and old.config.target_hidden_size == draft.config.target_hidden_size
                     and old.config.target_vocab_size == draft.config.target_vocab_size)
    if not same_features:
        print(f"[train] not warm-starting from {folder}: it was trained on other target features", flush=True)
        return []
    ours, copied = draft.state_dict(), []
    for name, tensor in old.state_dict().items():
        if name in ("d2t", "t2d") or name.startswith("embed_tokens") or name not in ours:
            continue
        if name == "lm_head.weight":
            old_row = torch.full((draft.config.target_vocab_size,), -1, dtype=torch.long, device=tensor.device)
            old_draft_ids = torch.arange(old.d2t.numel(), device=tensor.device)
            old_row[old.draft_to_target(old_draft_ids)] = old_draft_ids
            new_targets = draft.draft_to_target(torch.arange(draft.d2t.numel(), device=draft.d2t.device))
            rows = old_row[new_targets.to(tensor.device)]
            shared = rows >= 0
            if tensor.shape[1] == ours[name].shape[1]:
                ours[name][shared] = tensor[rows[shared]].to(ours[name].dtype)
                copied.append(name)
        elif ours[name].shape == tensor.shape:
            ours[name].copy_(tensor)
            copied.append(name)
    return copied


class TTTObjective(nn.Module):
    """`ttt_forward` as a module's forward: DDP/FSDP sync gradients only for losses computed inside it.

    bf16 autocast on CUDA wraps the draft's compute; the target distribution is precomputed in float32
    outside it (`with_targets`), and the draft's logits and losses are float32 by construction.
    """

    def __init__(self, draft, autocast: bool):
        super().__init__()
        self.draft = draft
        self.autocast = autocast

    def forward(self, *args, **kwargs):
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=self.autocast):
            return ttt_forward(self.draft, *args, **kwargs)


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


def decode_row(row: dict, meta: dict) -> dict:
    from pipelines.extract import decode_hidden

    h = meta["target_hidden_size"]
    return {"id": row["id"], "slot": row.get("slot", 0),
            "input_ids": torch.as_tensor(row["input_ids"], dtype=torch.long),
            "loss_mask": torch.as_tensor(row["loss_mask"], dtype=torch.long),
            "aux_hidden": decode_hidden(row["aux_hidden"], meta["dtype"], 3 * h),
            "last_hidden": decode_hidden(row["last_hidden"], meta["dtype"], h)}


def collate(rows: list[dict], meta: dict, ttt_steps: int, device) -> dict:
    """Right-pad rows to the longest: {input_ids, loss_mask, attention_mask [B, L], aux_hidden [B, L, 3H], ...}.

    No rows (a rank with an empty share of a small global batch) gives one fully masked dummy row, so the
    rank still runs the forward and backward every collective expects, contributing zero loss.
    """
    h, dtype = meta["target_hidden_size"], getattr(torch, meta["dtype"])
    if not rows:
        n = ttt_steps + 2
        rows = [{"input_ids": torch.zeros(n, dtype=torch.long), "loss_mask": torch.zeros(n, dtype=torch.long),
                 "aux_hidden": torch.zeros(n, 3 * h, dtype=dtype), "last_hidden": torch.zeros(n, h, dtype=dtype),
                 "dummy": True}]
    B, L = len(rows), max(len(r["input_ids"]) for r in rows)
    batch = {"input_ids": torch.zeros(B, L, dtype=torch.long), "loss_mask": torch.zeros(B, L, dtype=torch.long),
             "attention_mask": torch.zeros(B, L, dtype=torch.long),
             "aux_hidden": torch.zeros(B, L, 3 * h, dtype=dtype), "last_hidden": torch.zeros(B, L, h, dtype=dtype)}
    for b, r in enumerate(rows):
        n = len(r["input_ids"])
        for key in ("input_ids", "loss_mask", "aux_hidden", "last_hidden"):
            batch[key][b, :n] = r[key]
        batch["attention_mask"][b, :n] = 0 if r.get("dummy") else 1
    return {k: v.to(device) for k, v in batch.items()}


def step_counts(batch: dict, ttt_steps: int) -> torch.Tensor:
    """[K] loss positions of each TTT step in this batch (what `ttt_forward` counts: mask[t + k + 2])."""
    mask = (batch["loss_mask"] * batch["attention_mask"]).float()
    return torch.stack([mask[:, k + 2:].sum() for k in range(ttt_steps)])


def all_reduce(t: torch.Tensor, op="sum") -> torch.Tensor:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


def world_info() -> tuple[int, int]:
    import ray.train

    ctx = ray.train.get_context()
    return ctx.get_world_rank(), ctx.get_world_size()


def planned_micro_batches(iterator, n_steps: int, start: int):
    """(step, rows) for steps start..n_steps-1 from a rank's planned shard; rows of earlier steps are skipped."""
    rows = iter(iterator.iter_rows()) if iterator is not None else iter(())
    pending = next(rows, None)
    for step in range(n_steps):
        micro = []
        while pending is not None and pending["step"] <= step:
            if pending["step"] == step and step >= start:
                micro.append(pending)
            pending = next(rows, None)
        if step >= start:
            yield step, sorted(micro, key=lambda r: r["slot"])


def streamed_micro_batches(iterator, tokens: int, eval_ids: set, held: list, skip_rows: int):
    """(rows consumed, rows) batches of ~`tokens` real tokens from a streamed shard; held-out rows go to `held`."""
    consumed, micro, size = 0, [], 0
    for row in iterator.iter_rows():
        consumed += 1
        if consumed <= skip_rows:
            continue
        if row["id"] in eval_ids:
            held.append(row)
            continue
        micro.append(row)
        size += len(row["input_ids"])
        if size >= tokens:
            yield consumed, micro
            micro, size = [], 0


# ---------------------------------------------------------------------------------------------------
# worker side: checkpoints


def save_checkpoint(draft, optimizer, scheduler, state: dict, folder: Path) -> None:
    from eagle_core.checkpoint import save_draft

    save_draft(draft, folder / "draft", dtype=torch.float32)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng},
               folder / "trainer_state.pt")
    (folder / "state.json").write_text(json.dumps(state, indent=1))


def load_draft_weights(draft, folder: Path) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "draft" / "model.safetensors"))
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - {"embed_tokens.weight"}:
        raise ValueError(f"checkpoint {folder} does not fit the draft: missing={missing} unexpected={unexpected}")


def load_trainer_state(optimizer, scheduler, folder: Path) -> None:
    saved = torch.load(folder / "trainer_state.pt", map_location="cpu", weights_only=True)
    if optimizer is not None:
        optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    torch.set_rng_state(saved["rng"]["cpu"])
    if "cuda" in saved["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved["rng"]["cuda"])


def is_sharded(strategy: str, world: int) -> bool:
    return strategy == "fsdp" and world > 1


def full_state(draft, objective, optimizer, sharded: bool):
    """(a plain draft, an optimizer-like holder) with full tensors: FSDP gathers them on every rank (a collective)."""
    if not sharded:
        return draft, optimizer
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(objective, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    from eagle_core.draft import Eagle3Draft

    shadow = Eagle3Draft(draft.config)  # a CPU copy to save from; embeddings stay the target's
    shadow.load_state_dict({k.removeprefix("draft."): v for k, v in model_sd.items()}, strict=False)
    return shadow, _StateHolder(optim_sd)


class _StateHolder:
    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state


def load_sharded_optimizer(objective, optimizer, folder: Path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    saved = torch.load(folder / "trainer_state.pt", map_location="cpu", weights_only=True)
    set_optimizer_state_dict(objective, optimizer, saved["optimizer"], options=StateDictOptions(full_state_dict=True))


# ---------------------------------------------------------------------------------------------------
# worker side: the loop


class RankZeroLogger:
    """Per-step metrics to the MLflow run, from rank 0 only (other ranks hold a no-op)."""

    def __init__(self, tracking_uri: str | None, run_id: str | None, active: bool):
        self.client = None
        if active and run_id:
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
            from mlflow.tracking import MlflowClient

            self.client, self.run_id = MlflowClient(tracking_uri), run_id

    def log(self, metrics: dict, step: int) -> None:
        if self.client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])


def global_step_metrics(local: dict, ttt_steps: int, world: int) -> dict:
    """Average the ranks' normalised pieces (sums of a global mean) and add the global derived metrics."""
    from eagle_core.ttt import simulated_accept_length

    keys = ["loss"] + [f"loss_{k}" for k in range(ttt_steps)] + [f"acc_{k}" for k in range(ttt_steps)]
    t = torch.tensor([local[k] for k in keys] + [local["tokens"]], dtype=torch.float64)
    all_reduce(t)
    out = {k: float(v) / world for k, v in zip(keys, t[:-1])}
    out["tokens"] = float(t[-1])
    out["accept_length"] = simulated_accept_length([out[f"acc_{k}"] for k in range(ttt_steps)])
    out.update(lr=local["lr"], grad_norm=local["grad_norm"])
    return out


@torch.no_grad()
def evaluate(objective, draft, batches, head, ttt_steps: int, device) -> dict:
    """Held-out per-step loss and accuracy, and the simulated acceptance length, summed over all ranks."""
    from eagle_core.ttt import simulated_accept_length, with_targets

    draft.eval()
    sums = torch.zeros(3, ttt_steps, dtype=torch.float64)
    for batch in batches:
        batch = with_targets(batch, head, draft.d2t)
        out = objective(batch["input_ids"], batch["loss_mask"], batch["aux_hidden"], batch["last_hidden"], head,
                        attention_mask=batch["attention_mask"], ttt_steps=ttt_steps, targets=batch["targets"])
        counts = out.step_counts.double().cpu()
        sums += torch.stack([out.step_losses.double().cpu() * counts, out.step_accuracies.double().cpu() * counts,
                             counts])
    all_reduce(sums)
    counts = sums[2].clamp(min=1)
    losses, accs = (sums[0] / counts).tolist(), (sums[1] / counts).tolist()
    metrics = {f"eval_loss_{k}": losses[k] for k in range(ttt_steps)}
    metrics.update({f"eval_acc_{k}": accs[k] for k in range(ttt_steps)})
    metrics["eval_loss"] = sum(0.8 ** k * v for k, v in enumerate(losses))
    metrics["eval_accept_length"] = simulated_accept_length(accs)
    metrics["eval_positions"] = float(sums[2][0])
    return metrics


def train_loop(loop_config: dict) -> None:
    """The per-worker function of the TorchTrainer."""
    import ray.train
    import ray.train.torch

    from eagle_core.ttt import make_optimizer, make_scheduler, train_step, with_targets

    config = TrainJobConfig(**loop_config["job"])
    meta, plan = loop_config["meta"], loop_config["plan"]
    rank, world = world_info()
    device = ray.train.torch.get_device()
    K = config.ttt_steps
    heads = load_target_heads(loop_config["target"], device)
    head = heads["lm_head"]
    d2t, t2d = torch.tensor(loop_config["d2t"]), torch.zeros(meta["target_vocab_size"], dtype=torch.bool)
    t2d[torch.arange(len(d2t)) + d2t] = True
    draft = build_draft(config, target_config(loop_config["target"]), heads, d2t, t2d, loop_config["lineage"])
    tcfg = config.train_config(plan["total_steps"])

    state = {"step": 0, "epoch": 0, "step_in_epoch": 0, "rows_consumed": 0, "restored_from": []}
    checkpoint = ray.train.get_checkpoint()
    restore_dir = None
    if checkpoint is not None:
        restore_dir = Path(checkpoint.to_directory())
        load_draft_weights(draft, restore_dir)
        state.update(json.loads((restore_dir / "state.json").read_text()))
        state["restored_from"] = state.get("restored_from", []) + [state["step"]]
    sharded = is_sharded(config.strategy, world)
    objective = wrap_objective(TTTObjective(draft, autocast=device.type == "cuda"), config.strategy, world, device)
    optimizer = make_optimizer(draft, tcfg)  # after wrapping: FSDP swaps the parameters for sharded ones
    scheduler = make_scheduler(optimizer, tcfg)
    if restore_dir is not None:
        if sharded:
            load_sharded_optimizer(objective, optimizer, restore_dir)
        load_trainer_state(None if sharded else optimizer, scheduler, restore_dir)

    logger = RankZeroLogger(loop_config["tracking_uri"], loop_config["mlflow_run_id"], rank == 0)
    forward = lambda _draft, *a, **k: objective(*a, **k)  # noqa: E731  (train_step's hook)

    def report(metrics: dict, with_checkpoint: bool) -> None:
        if not with_checkpoint:
            ray.train.report(metrics)
            return
        model, optim = full_state(draft, objective, optimizer, sharded)
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = None
            if rank == 0:
                save_checkpoint(model, optim, scheduler, state, Path(tmp))
                ckpt = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=ckpt, checkpoint_dir_name=f"checkpoint-{state['step']:07d}")

    def one_step(rows: list[dict]) -> dict:
        started = time.perf_counter()
        batch = collate([decode_row(r, meta) for r in rows], meta, K, device)
        batch = with_targets(batch, head, draft.d2t)  # float32, outside autocast
        counts = all_reduce(step_counts(batch, K).double())
        batch["step_denominators"] = (counts.clamp(min=1) / world).float()
        local = train_step(draft, batch, head, optimizer, scheduler, tcfg, forward=forward)
        metrics = global_step_metrics(local, K, world)
        metrics["tokens_per_s"] = metrics["tokens"] / max(time.perf_counter() - started, 1e-9)
        return metrics

    def after_step(metrics: dict, epoch_end: bool) -> bool:
        """Log, checkpoint, maybe inject the test fault; True when max_steps is reached."""
        state["step"] += 1
        metrics["epoch"] = state["epoch"]
        logger.log(metrics, state["step"])
        if rank == 0 and (state["step"] % config.log_every == 0 or state["step"] == 1):
            print(f"[train] step {state['step']}/{plan['total_steps']} loss {metrics['loss']:.4f} "
                  f"acc_0 {metrics['acc_0']:.3f} {metrics['tokens_per_s']:.0f} tok/s", flush=True)
        done = config.max_steps is not None and state["step"] >= config.max_steps
        if state["step"] % config.checkpoint_every == 0 and not (epoch_end or done):
            report({"step": state["step"], "loss": metrics["loss"]}, with_checkpoint=True)
        _maybe_fault(config, state["step"], rank, loop_config["storage_dir"])
        return done

    def run_eval(held: list, epoch: int) -> dict:
        source = ray.train.get_dataset_shard("eval") if plan["mode"] == "files" else held
        metrics = evaluate(objective, draft, _eval_batches(source, plan, meta, K, device), head, K, device)
        metrics["epoch"] = epoch
        logger.log(metrics, state["step"])
        if rank == 0:
            print(f"[train] step {state['step']} held-out: acc {[round(metrics[f'eval_acc_{k}'], 3) for k in range(K)]}"
                  f" accept_length {metrics['eval_accept_length']:.3f}", flush=True)
        return metrics

    if checkpoint is None and plan["mode"] == "files":
        run_eval([], 0)  # the untrained draft: the baseline of the held-out curves, logged at step 0

    while state["epoch"] < config.epochs:
        epoch = state["epoch"]
        n_steps = plan["steps_per_epoch"][epoch] if plan["mode"] == "files" else None
        shard = ray.train.get_dataset_shard(train_dataset_name(epoch) if plan["mode"] == "files" else "train")
        held: list = []
        done = False
        if plan["mode"] == "files":
            for step, rows in planned_micro_batches(shard, n_steps, state["step_in_epoch"]):
                metrics = one_step(rows)
                state["step_in_epoch"] = step + 1
                if after_step(metrics, epoch_end=step + 1 == n_steps):
                    done = True
                    break
        else:
            batches = streamed_micro_batches(shard, max(config.tokens_per_batch // world, 1),
                                             set(plan["eval_ids"]), held, state["rows_consumed"])
            while True:
                got = next(batches, None)
                # every rank steps together: stop as soon as any rank's stream runs dry
                if float(all_reduce(torch.tensor([0.0 if got else 1.0]), op="max")[0]) > 0:
                    break
                state["rows_consumed"] = got[0]
                state["step_in_epoch"] += 1
                if after_step(one_step(got[1]), epoch_end=False):
                    done = True
                    break
        eval_metrics = run_eval(held, epoch)
        state.update(epoch=epoch + 1, step_in_epoch=0, rows_consumed=0)  # resuming from here starts the next
        report({"step": state["step"], **eval_metrics}, with_checkpoint=True)
        if done:
            break


def _eval_batches(source, plan: dict, meta: dict, K: int, device):
    """The rank's held-out micro-batches; every rank runs the same number of forwards (collectives)."""
    if plan["mode"] == "files":
        groups = [rows for _, rows in planned_micro_batches(source, plan["eval_steps"], 0)]
    else:
        groups = [[r] for r in source]  # streamed held-out rows, one per forward
        n = int(all_reduce(torch.tensor([float(len(groups))]), op="max")[0])
        groups += [[] for _ in range(n - len(groups))]
    return (collate([decode_row(r, meta) for r in rows], meta, K, device) for rows in groups)


def _maybe_fault(config: TrainJobConfig, step: int, rank: int, storage_dir: str) -> None:
    """Test hook: SIGKILL rank 0's process once, after `fault_at_step` (a marker file makes it once)."""
    if config.fault_at_step is None or rank != 0 or step != config.fault_at_step:
        return
    marker = Path(storage_dir) / "fault_injected"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(step))
    time.sleep(2.0)  # let the controller register the checkpoint reported just before
    os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------------------------------------
# driver


def manifest_digest(features: str) -> str:
    with fsspec.open(_join(features, "manifest.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def prepare_data(config: TrainJobConfig, world: int) -> tuple[dict, dict, dict, dict]:
    """(meta, plan, datasets, lineage) for either mode (planned datasets as per-rank lists); plan["total_steps"] drives the LR schedule."""
    from pipelines.extract import ExtractConfig, load_manifest, stream_features

    if config.features is not None:
        manifest = load_manifest(config.features)
        train_rows, eval_rows = split_heldout(scan_features(config.features), config.eval_fraction)
        plan = make_plan(train_rows, eval_rows, config, world)
        plan.update(mode="files", train_rows=len(train_rows), eval_rows=len(eval_rows))
        per_rank = build_planned_datasets(plan, world)
        del plan["train"], plan["eval"]  # the datasets carry them; the workers need the counts only
        token_counts = manifest["token_counts"]
        lineage = {"target": manifest["target"], "features": config.features,
                   "features_manifest_sha256": manifest_digest(config.features),
                   "features_mlflow_run_id": manifest.get("mlflow_run_id"),
                   "target_weights_hash": manifest.get("target_weights_hash"),
                   "aux_layer_ids": manifest["aux_layer_ids"]}
        meta = {k: manifest[k] for k in ("target_hidden_size", "target_vocab_size", "dtype")}
        target = config.target or manifest["target"]
    else:
        extract = ExtractConfig(**{**config.extract, "corpus": config.corpus, "target": config.target,
                                   "output": _join(config.output, "stream"), "mlflow_experiment": None})
        first = stream_first_pass(config, extract)
        steps = max(first["train_tokens"] // config.tokens_per_batch, 1)
        plan = {"mode": "stream", "steps_per_epoch": [steps] * config.epochs, "eval_ids": first["eval_ids"],
                "tokens_per_epoch": first["train_tokens"], "train_rows": first["rows"] - len(first["eval_ids"]),
                "eval_rows": len(first["eval_ids"])}
        per_rank = {"train": stream_features(extract)}
        token_counts = first["token_counts"]
        tc = target_config(config.target)
        from eagle_core.target import default_aux_layer_ids, weights_fingerprint

        lineage = {"target": config.target, "features": f"stream:{config.corpus}",
                   "target_weights_hash": weights_fingerprint(config.target),
                   "aux_layer_ids": extract.aux_layer_ids or default_aux_layer_ids(tc.num_hidden_layers)}
        meta = {"target_hidden_size": tc.hidden_size, "target_vocab_size": tc.vocab_size,
                "dtype": "float32" if not config.use_gpu else "bfloat16"}
        target = config.target
        if extract.dtype != "auto":
            meta["dtype"] = extract.dtype
    planned = sum(plan["steps_per_epoch"])
    plan["total_steps"] = min(planned, config.max_steps) if config.max_steps else planned
    meta["token_counts"] = token_counts
    meta["target"] = target
    return meta, plan, per_rank, lineage


def _run_state_file(config: TrainJobConfig) -> str:
    return _join(config.output, "train_run.json")


def _previous_run(config: TrainJobConfig) -> dict | None:
    fs, path = fsspec.core.url_to_fs(_run_state_file(config))
    if not fs.exists(path):
        return None
    with fs.open(path, "rt") as f:
        return json.load(f)


def _write_run_state(config: TrainJobConfig, info: dict) -> None:
    fs, path = fsspec.core.url_to_fs(_run_state_file(config))
    fs.makedirs(os.path.dirname(path), exist_ok=True)
    with fs.open(path, "wt") as f:
        json.dump(info, f, indent=1)


def storage_path(config: TrainJobConfig) -> str:
    """Ray Train's storage: `<output>/ray` (set explicitly: the default is ~/ray_results)."""
    out = config.output if "://" in config.output else str(Path(config.output).resolve())
    return _join(out, "ray")


def _mlflow_params(config: TrainJobConfig, plan: dict, lineage: dict, world: int, n_trainable: int) -> dict:
    params = {k: v for k, v in config.to_dict().items() if v is not None and k not in ("extract", "fault_at_step")}
    params.update({f"extract.{k}": v for k, v in config.extract.items() if v is not None})
    params.update({k: v for k, v in lineage.items() if v is not None})
    params.update(world_size=world, total_steps=plan["total_steps"], steps_per_epoch=plan["steps_per_epoch"][0],
                  train_rows=plan["train_rows"], eval_rows=plan["eval_rows"], draft_trainable_params=n_trainable)
    return {k: str(v)[:6000] for k, v in params.items()}


def run_train(config: TrainJobConfig) -> dict:
    """Train (or resume) a draft on the connected Ray cluster; returns a summary (also `<output>/summary.json`)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from pipelines import tracking

    started = time.perf_counter()
    world = config.num_workers
    previous = _previous_run(config)
    if previous and not config.resume:
        raise FileExistsError(f"{config.output} already holds a training run ({previous.get('name')}); pass "
                              "--resume to continue it, or choose another --output")
    meta, plan, data, lineage = prepare_data(config, world)
    planned = {name: shares for name, shares in data.items() if isinstance(shares, list)}
    datasets = {name: shares[0] if isinstance(shares, list) else shares for name, shares in data.items()}
    tconfig = target_config(meta["target"])
    d2t, _ = vocab_from_counts(meta["token_counts"], tconfig.vocab_size, config.draft_vocab_size)
    n_trainable = _count_trainable(config, tconfig, d2t)
    run_id = (previous or {}).get("mlflow_run_id")
    if config.mlflow_experiment and run_id is None:
        with tracking.start_run(config.mlflow_experiment, run_name=config.name) as run:
            run_id = run.info.run_id
            mlflow = tracking.configure()
            mlflow.log_params(_mlflow_params(config, plan, lineage, world, n_trainable))
            mlflow.set_tags({"features_manifest_sha256": lineage.get("features_manifest_sha256", ""),
                             "features_mlflow_run_id": lineage.get("features_mlflow_run_id") or "",
                             "stage": "train"})
    _write_run_state(config, {"name": config.name, "mlflow_run_id": run_id, "num_workers": world})
    lineage["train_mlflow_run_id"] = run_id

    storage = storage_path(config)
    loop_config = {"job": config.to_dict(), "meta": {k: v for k, v in meta.items() if k != "token_counts"},
                   "plan": plan, "d2t": d2t.tolist(), "target": meta["target"], "lineage": lineage,
                   "tracking_uri": tracking.tracking_uri() if run_id else None, "mlflow_run_id": run_id,
                   "storage_dir": _join(storage, config.name)}
    trainer = TorchTrainer(
        train_loop,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=world, use_gpu=config.use_gpu,
                                     resources_per_worker={"CPU": config.cpus_per_worker,
                                                           **({"GPU": 1} if config.use_gpu else {})}),
        run_config=RunConfig(name=config.name, storage_path=storage,
                             checkpoint_config=CheckpointConfig(num_to_keep=config.keep_checkpoints),
                             failure_config=FailureConfig(max_failures=config.max_failures)),
        datasets=datasets,
        dataset_config=_planned_shards_class()(planned),
    )
    result = trainer.fit()
    summary = finish_run(config, result, run_id, meta["target"])
    summary.update(seconds=time.perf_counter() - started, total_steps=plan["total_steps"],
                   train_rows=plan["train_rows"], eval_rows=plan["eval_rows"], mlflow_run_id=run_id,
                   lineage=lineage, world_size=world)
    with fsspec.open(_join(config.output, "summary.json"), "wt") as f:
        json.dump(summary, f, indent=1, default=str)
    return summary


def _count_trainable(config: TrainJobConfig, tconfig, d2t) -> int:
    from eagle_core.draft import DraftConfig, Eagle3Draft

    cfg = DraftConfig.from_target(tconfig, draft_vocab_size=config.draft_vocab_size, ttt_steps=config.ttt_steps,
                                  lm_head_init=config.lm_head_init)
    with torch.device("meta"):
        return Eagle3Draft(cfg).num_trainable()


def finish_run(config: TrainJobConfig, result, run_id: str | None, target: str) -> dict:
    """Export the last checkpoint's draft (both layouts), log it with the plots, register a version."""
    from pipelines import tracking

    if result.checkpoint is None:
        raise RuntimeError(f"training produced no checkpoint: {result.error}")
    draft_dir, spec_dir = Path(_local(config.output)) / "draft", Path(_local(config.output)) / "draft-speculators"
    with result.checkpoint.as_directory() as ckpt:
        state = json.loads((Path(ckpt) / "state.json").read_text())
        export_draft(Path(ckpt) / "draft", draft_dir, spec_dir, target)
    summary = {"step": state["step"], "restored_from": state.get("restored_from", []),
               "checkpoint": result.checkpoint.path, "draft": str(draft_dir), "draft_speculators": str(spec_dir),
               "metrics": {k: v for k, v in (result.metrics or {}).items() if isinstance(v, (int, float))}}
    if not run_id:
        return summary
    mlflow = tracking.configure()
    with tracking.start_run(config.mlflow_experiment, run_id=run_id):
        mlflow.log_artifacts(str(draft_dir), "draft")
        mlflow.log_artifacts(str(spec_dir), "draft-speculators")
        with tempfile.TemporaryDirectory() as tmp:
            for path in write_plots(mlflow.tracking.MlflowClient(), run_id, config.ttt_steps, Path(tmp)):
                mlflow.log_artifact(str(path), "plots")
        mlflow.log_metric("final_step", state["step"])
        if config.registered_model_name:
            version = tracking.register_artifact(run_id, "draft", config.registered_model_name, CANDIDATE_ALIAS)
            summary.update(registered_model=config.registered_model_name, model_version=version)
    return summary


def _local(url: str) -> str:
    if "://" in url and not url.startswith("file://"):
        raise ValueError("the exported draft is written next to the job; give a local --output for now")
    return url.removeprefix("file://")


def export_draft(checkpoint_draft: Path, draft_dir: Path, spec_dir: Path, target: str) -> None:
    """The checkpoint's `save_draft` folder as-is (vLLM/SGLang layout) and re-exported in the speculators layout."""
    from eagle_core.checkpoint import export_speculators, load_draft

    if draft_dir.exists():
        shutil.rmtree(draft_dir)
    shutil.copytree(checkpoint_draft, draft_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # shared target embeddings are not part of either export
        draft = load_draft(draft_dir)
    export_speculators(draft, spec_dir, verifier=target)


def write_plots(client, run_id: str, ttt_steps: int, folder: Path) -> list[Path]:
    """loss_curves.png (train loss per step, per TTT step, held-out) and acceptance_per_position.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def history(key):
        points = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
        return [m.step for m in points], [m.value for m in points]

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key in ["loss"] + [f"loss_{k}" for k in range(ttt_steps)]:
        steps, values = history(key)
        if steps:
            ax.plot(steps, values, label=key, linewidth=2 if key == "loss" else 0.8)
    steps, values = history("eval_loss")
    if steps:
        ax.plot(steps, values, "ko--", label="held-out loss")
    ax.set(xlabel="optimiser step", ylabel="TTT loss", title="EAGLE-3 TTT training loss")
    ax.legend(fontsize=7, ncol=2)
    losses = folder / "loss_curves.png"
    fig.savefig(losses, dpi=110, bbox_inches="tight")
    plt.close(fig)

    accs = [history(f"eval_acc_{k}")[1] for k in range(ttt_steps)]
    accs = [a[-1] if a else 0.0 for a in accs]
    cumulative = torch.cumprod(torch.tensor(accs, dtype=torch.float64), 0).tolist()
    fig, ax = plt.subplots(figsize=(7, 4))
    x = torch.arange(ttt_steps).float()
    ax.bar((x - 0.2).tolist(), accs, width=0.4, label="per-position accuracy (earlier positions right)")
    ax.bar((x + 0.2).tolist(), cumulative, width=0.4, label="P(first k+1 drafted tokens accepted)")
    ax.set(xlabel="draft position k", ylabel="held-out rate", ylim=(0, 1),
           title=f"held-out acceptance per position (simulated accept length {1 + sum(cumulative):.2f})")
    ax.set_xticks(range(ttt_steps))
    ax.legend(fontsize=7)
    bars = folder / "acceptance_per_position.png"
    fig.savefig(bars, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [losses, bars]
