"""The plan (driver side, light columns only): held-out split, epoch order, global batches, rank shares.

Features mode: every optimiser step of every epoch is planned up front, independently of the number of
workers, from the `id` and `input_ids` columns of the Parquet shards:
  - held-out split: the `eval_fraction` of conversations whose id hash is smallest (stable across runs);
  - several sources (`config.feature_sources`): each source's conversations whose id hash falls below its
    `holdout` are never read; each epoch's training rows are drawn from the sources by weight (`mix_rows`);
  - epoch order: the shards in a seeded permutation, the rows of each shard in a seeded permutation (reads
    stay shard-sequential, nothing is shuffled through the object store);
  - global batches: consecutive rows up to `tokens_per_batch` real tokens (one optimiser step);
  - each global batch is split over the W ranks, longest rows first onto the least loaded rank.
Streaming mode: `stream_first_pass` only tokenises the corpus (no target forward) for the draft vocabulary,
the step count and the held-out ids.
What the workers need of either plan is a `TrainPlan`; the per-rank rows travel as Ray Datasets (`shards.py`).
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import asdict, dataclass, field

import fsspec
import pyarrow.parquet as pq

from pipelines.storage import join
from pipelines.train.config import TrainJobConfig


MODES = ("files", "stream")


@dataclass
class TrainPlan:
    """What the driver planned, as every worker (and the summary, and MLflow) reads it."""

    mode: str  # "files": planned from extracted features; "stream": features streamed from a corpus
    steps_per_epoch: list[int] = field(default_factory=list)
    total_steps: int = 0  # the planned steps, capped by max_steps: the LR schedule's length
    train_rows: int = 0
    eval_rows: int = 0
    tokens_per_epoch: int = 0
    eval_steps: int = 0  # files mode: held-out forwards per rank
    eval_ids: list[str] = field(default_factory=list)  # stream mode: the held-out conversations, set aside as they come

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"plan mode must be one of {MODES}, got {self.mode!r}")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "TrainPlan":
        return cls(**data)


def id_hash(conversation_id: str) -> str:
    return hashlib.sha256(conversation_id.encode()).hexdigest()


def scan_features(features: str, shards: list[str] | None = None) -> list[dict]:
    """One light record per feature row: {id, file, row, length} (reads the id and input_ids columns only).

    `shards`: the manifest's shard names, read exactly (a missing one is an error); other Parquet files in the
    folder (a reused folder's stale shards) are not training data. None: every Parquet file of the folder."""
    fs, path = fsspec.core.url_to_fs(join(features, "features"))
    if shards is None:
        files = sorted(p for p in fs.ls(path, detail=False) if p.endswith(".parquet"))
    else:
        files = [f"{path}/{name}.parquet" for name in shards]
        missing = [f for f in files if not fs.exists(f)]
        if missing:
            raise FileNotFoundError(f"{features}: the manifest lists shards that are not there: {missing[:5]}")
    rows = []
    for f in files:
        with fs.open(f, "rb") as handle:
            table = pq.read_table(handle, columns=["id", "input_ids"])
        url = fs.unstrip_protocol(f)  # fs.ls drops the protocol; the readers may run on other nodes
        for i, (cid, ids) in enumerate(zip(table["id"].to_pylist(), table["input_ids"].to_pylist())):
            rows.append({"id": cid, "file": url, "row": i, "length": len(ids)})
    return rows


def held_out_by_hash(conversation_id: str, fraction: float) -> bool:
    """Whether a conversation falls in the `fraction` of id-hash space kept out of training (for an evaluation
    elsewhere). Decided by its id alone, so it holds as a source grows (a traffic sink adds rows): a conversation
    held out once is held out in every later run with the same fraction."""
    return int(id_hash(conversation_id)[:15], 16) < fraction * 16 ** 15


def split_heldout(rows: list[dict], eval_fraction: float) -> tuple[list[dict], list[dict]]:
    """(train, eval): the ceil(fraction * n) rows with the smallest id hash are held out; at least one trains."""
    n_eval = min(math.ceil(eval_fraction * len(rows)), max(len(rows) - 1, 0)) if eval_fraction > 0 else 0
    held = {r["id"] for r in sorted(rows, key=lambda r: id_hash(r["id"]))[:n_eval]}
    return [r for r in rows if r["id"] not in held], [r for r in rows if r["id"] in held]


def mix_rows(rows: list[dict], weights: list[float], seed: int, epoch: int) -> list[dict]:
    """One epoch's training rows drawn from several sources (each row's `source`: an index into `weights`).

    The epoch keeps the length of all the sources' rows together (N); source i supplies round(N * w_i / sum(w))
    of them (the last source the rest): every row of it as many whole times as fit, then a seeded sample, new
    each epoch, of the remainder. A source with fewer rows than its share repeats them; one with more is
    subsampled (a different sample each epoch). The order is left to `epoch_order`."""
    by_source: dict[int, list[dict]] = {i: [] for i in range(len(weights))}
    for r in rows:
        by_source[r["source"]].append(r)
    total, norm = len(rows), sum(weights)
    counts = [round(total * w / norm) for w in weights[:-1]]
    counts.append(max(total - sum(counts), 0))
    rng = random.Random(seed * 1_000_003 + epoch + 1)
    mixed = []
    for i, n in enumerate(counts):
        pool = by_source[i]
        if n and not pool:
            raise ValueError(f"features source {i} has weight {weights[i]} but no training rows")
        if n:
            whole, rest = divmod(n, len(pool))
            mixed += pool * whole + rng.sample(pool, rest)
    return mixed


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
    """Per rank, its plan rows {file, row, step, slot}: read order (file by file), `slot` = order in its micro-batch.

    A row drawn more than once in an epoch (`mix_rows` repeats a small source's rows) is planned once per step it
    is in: positions are per (file, row, step), so the read order stays the step order the workers consume."""
    per_rank = [[] for _ in range(world)]
    position = {}
    for step, batch in enumerate(batches):
        for r in batch:
            position.setdefault((r["file"], r["row"], step), len(position))
        for rank, share in enumerate(split_over_ranks(batch, world)):
            per_rank[rank] += [{"file": r["file"], "row": r["row"], "step": step, "slot": slot}
                               for slot, r in enumerate(share)]
    for entries in per_rank:
        entries.sort(key=lambda e: position[(e["file"], e["row"], e["step"])])
    return per_rank


def make_plan(train_rows: list[dict], eval_rows: list[dict], config: TrainJobConfig, world: int,
              weights: list[float] | None = None):
    """(the TrainPlan, per rank the plan rows of every epoch [epoch][rank], per rank those of the held-out split).

    `weights`: the rows come from several sources (each row's `source`), drawn per epoch by `mix_rows`; None: every
    training row once per epoch. With packing (`config.pack_length`) or micro-batches (`micro_batch_tokens`) a
    conversation longer than the row or the micro-batch is refused here, before any worker starts (BadBatch naming
    it)."""
    every = train_rows + eval_rows
    config.refuse_too_long([r["length"] for r in every], [r["id"] for r in every])
    drawn = [train_rows if weights is None else mix_rows(train_rows, weights, config.seed, e)
             for e in range(config.epochs)]
    epochs = [pack_batches(epoch_order(rows, config.seed, e), config.tokens_per_batch) for e, rows in enumerate(drawn)]
    eval_batches = pack_batches(sorted(eval_rows, key=lambda r: id_hash(r["id"])), config.tokens_per_batch)
    plan = TrainPlan(mode="files", steps_per_epoch=[len(b) for b in epochs], eval_steps=len(eval_batches),
                     tokens_per_epoch=sum(r["length"] for r in (drawn[0] if weights and drawn else train_rows)),
                     train_rows=len(train_rows), eval_rows=len(eval_rows))
    return plan, [plan_steps(b, world) for b in epochs], plan_steps(eval_batches, world)


def stream_first_pass(config: TrainJobConfig, extract_config, chunk_rows: int = 1024) -> dict:
    """Token counts and lengths of the corpus after the chat template and loss mask (no target forward).

    The conversations stream from Ray's object store `chunk_rows` at a time and are tokenised as they come: the
    driver keeps the token counts and an {id, length} per conversation (what the held-out split needs), never the
    conversations themselves (as the extraction driver, `pipelines.extract`)."""
    from itertools import islice

    from transformers import AutoTokenizer

    from eagle_core.features import tokenize_for_training
    from eagle_core.target import materialize_hf_folder
    from pipelines.data import ingest

    tokenizer = AutoTokenizer.from_pretrained(materialize_hf_folder(config.target))
    # iter(): `iter_rows` returns an iterable that starts over each time it is iterated, not an iterator
    rows = iter(ingest(extract_config.corpus, limit=extract_config.limit).dataset.iter_rows())
    counts: dict[int, int] = {}
    light = []
    while chunk := list(islice(rows, chunk_rows)):  # each conversation is tokenised alone: chunks change nothing
        tokenized, _ = tokenize_for_training(tokenizer, chunk, extract_config.max_length)
        for cid, ids, mask in tokenized:
            for t, m in zip(ids, mask):
                if m:
                    counts[t] = counts.get(t, 0) + 1
            light.append({"id": cid, "length": len(ids)})
    config.refuse_too_long([r["length"] for r in light], [r["id"] for r in light])  # as in `make_plan`
    train, held = split_heldout(light, config.eval_fraction)
    return {"token_counts": counts, "rows": len(light), "tokens": sum(r["length"] for r in light),
            "eval_ids": sorted(r["id"] for r in held), "train_tokens": sum(r["length"] for r in train)}
