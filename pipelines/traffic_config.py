"""What the traffic sink (`pipelines.traffic.TrafficSink`) is configured with, what it records of one served
request, and the fingerprint its shards declare (the extraction's fields, so training checks them alike)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eagle_core.recipe import REFERENCE
from pipelines.feature_files import target_fingerprint

CORPUS = "traffic"  # the fingerprint's and manifest's `corpus`: served conversations, not a corpus file


@dataclass
class TrafficConfig:
    url: str | None = None  # where shards go (any fsspec URL); None: the sink is off and writes nothing
    target: str = "smollm2-135m"  # the served target (its name or folder): fingerprints and manifest
    sample_rate: float = 1.0  # fraction of served conversations recorded (a seeded draw per conversation)
    features: bool = True  # rows carry captured features (trainable as they are); False: ids and mask only
    rows_per_shard: int = 64  # a shard is committed when the buffer holds this many rows
    flush_after_s: float = 300.0  # ... or when its oldest row has waited this long
    max_length: int = REFERENCE.max_length  # tokens per conversation, as extraction truncates
    max_bytes: int | None = None  # size cap of the committed shards; records beyond it are dropped (counted)
    max_shards: int | None = None  # retention: the oldest shards beyond this many are removed
    max_age_s: float | None = None  # retention: shards older than this are removed
    # a retired shard leaves the store this long after it left the manifests (and only if none lists it again):
    # longer than a training run reads the shards of the manifest it started from
    retention_grace_s: float = 86400.0
    max_pending: int = 1024  # records queued for the writer thread; beyond it new ones are dropped (counted)
    # bytes the sink holds for records not yet committed (queued, buffered, being written: their features and ids);
    # beyond it new records are dropped (counted "pending_bytes"), so a stalled store holds this much at most
    max_pending_bytes: int = 1 << 30
    redact: str | None = None  # "module:function" of a redaction hook (or pass a callable to TrafficSink)
    close_s: float = 30.0  # a process that exits (SIGTERM in a Ray worker) writes what is buffered for this long
    seed: int = 0  # the sampling draws

    def __post_init__(self):
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be within [0, 1], got {self.sample_rate}")
        if self.retention_grace_s < 0:
            raise ValueError(f"retention_grace_s must be >= 0, got {self.retention_grace_s}")
        if self.rows_per_shard < 1 or self.max_pending < 1 or self.max_pending_bytes < 1:
            raise ValueError("rows_per_shard, max_pending and max_pending_bytes must be >= 1")


@dataclass
class ServedConversation:
    """What the sink records of one served request; what a redaction hook sees and may change or drop."""

    id: str
    prompt_ids: list[int]
    answer_ids: list[int]  # the target's answer, its end-of-turn token included when it ended
    messages: list[dict] | None = None  # the request's chat messages (the loss mask of earlier assistant turns)
    tools: list | None = None
    features: object | None = None  # RowFeatures (aux_hidden [n, 3H], last_hidden [n, H]) of prompt + answer
    meta: dict = field(default_factory=dict)  # e.g. the request's category label


def traffic_fingerprint(config: TrafficConfig, folder, target_config, dtype: torch.dtype) -> dict:
    """The extraction's fingerprint fields (`pipelines.extract.extraction_fingerprint`) for served traffic: the
    target's (`target_fingerprint`: weights, tokenizer, max_length, the features' dtype, the extraction's default aux
    layers); `regeneration` says the answers are the serving target's own, `corpus` that the rows are traffic."""
    return {**target_fingerprint(folder, target_config, config.max_length, dtype),
            "regeneration": {"with": "serve"}, "corpus": CORPUS}
