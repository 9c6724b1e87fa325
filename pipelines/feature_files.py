"""An extraction output on disk: the feature schema, hidden-state bytes, atomic commits, shards and the manifest.

Layout of an output folder (any fsspec URL), written by `pipelines.extract`:
    features/shard-00000-<hash>.parquet   feature rows (schema below), one file per shard, committed whole (`pipelines.storage.commit_bytes`)
    regenerated/shard-00000-<hash>.jsonl  regenerated conversations (reused on reruns: no second generation)
    quarantine/ingest.jsonl               corpus rows quarantined at ingest, with the reason
    manifest.json                         what the shards hold and how they were made (`FeatureManifest`)

Feature schema (Parquet, zstd), one row per conversation:
    id           string
    input_ids    list<int32>    [S] chat-template tokens
    loss_mask    list<int8>     [S] 1 on assistant content + end-of-turn tokens
    aux_hidden   large_binary   [S, 3H] row-major, the aux layers concatenated, in the manifest's `dtype`
    last_hidden  large_binary   [S, H]  after the final norm, in the manifest's `dtype`
Hidden states are raw little-endian bytes of the dtype the target computed in (bf16 on GPU keeps its exact
bits; Arrow has no bf16 type); `decode_hidden` turns them back into tensors. Each shard's summary (rows,
tokens, loss-token counts, quarantines) lives in its Parquet metadata, so a committed shard is complete by itself.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import MISSING, asdict, dataclass, field, fields

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipelines.storage import arrow_filesystem, commit_bytes, join, url_to_fs

SCHEMA_VERSION = 1
SHARD_META_KEY = b"eagle3.shard"
FEATURE_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("aux_hidden", pa.large_binary()),
    ("last_hidden", pa.large_binary()),
])
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float64: "float64"}


# --------------------------------------------------------------------------------------------------
# The manifest
# --------------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class ShardEntry:
    name: str
    rows: int
    tokens: int


@dataclass(kw_only=True)
class FeatureManifest:
    """`manifest.json`, typed. Field order is the file's key order; `to_json` / `from_json` keep its format, and
    `from_json` refuses a malformed file (missing or unknown keys, another schema version, wrong types)."""

    schema_version: int = SCHEMA_VERSION
    target: str
    target_weights_hash: str | None = None
    target_hidden_size: int
    target_vocab_size: int
    target_num_hidden_layers: int | None = None
    aux_layer_ids: list[int]
    dtype: str  # of the hidden-state bytes (a DTYPE_NAMES value)
    max_length: int | None = None
    regenerate: bool = False
    regeneration: dict = field(default_factory=dict)  # {max_new_tokens, temperature, seed}
    corpus: str | None = None
    limit: int | None = None
    rows: int
    tokens: int
    loss_tokens: int
    ingest: dict = field(default_factory=dict)  # pipelines.data's ingest stats
    quarantined_by_reason: dict[str, int] = field(default_factory=dict)
    bytes: int = 0
    bytes_per_token: float = 0.0
    min_bytes_per_token: int = 0
    shards: list[ShardEntry]
    token_counts: dict[int, int]  # loss-token id -> count over all shards (the file's keys are strings)
    feature_schema: dict[str, str] = field(default_factory=dict)
    config: dict = field(default_factory=dict)  # the ExtractConfig that made it
    seconds: float | None = None
    reused_shards: list[str] = field(default_factory=list)
    mlflow_run_id: str | None = None
    fingerprint: dict | None = None  # what made the shards (`extraction_fingerprint`); None: written before it existed
    corpus_files: list[dict] = field(default_factory=list)  # the corpus by content: [{file, size, sha256}]

    def __post_init__(self):
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(f"schema_version {self.schema_version!r}: this code reads version {SCHEMA_VERSION}")
        if not isinstance(self.target, str) or not self.target:
            raise ValueError(f"target must be a model name or path, got {self.target!r}")
        for name in ("target_hidden_size", "target_vocab_size"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("rows", "tokens", "loss_tokens"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {getattr(self, name)!r}")
        if not isinstance(self.aux_layer_ids, list) or len(self.aux_layer_ids) != 3 \
                or not all(_is_int(i) for i in self.aux_layer_ids):
            raise ValueError(f"aux_layer_ids must be three layer ids, got {self.aux_layer_ids!r}")
        if self.dtype not in DTYPE_NAMES.values():
            raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES.values())}, got {self.dtype!r}")

    def to_json(self) -> dict:
        data = asdict(self)
        data["token_counts"] = {str(k): v for k, v in sorted(self.token_counts.items())}
        return data

    @classmethod
    def from_json(cls, data, source: str = "manifest.json") -> "FeatureManifest":
        def malformed(why: str) -> ValueError:
            return ValueError(f"malformed feature manifest {source}: {why}")

        if not isinstance(data, dict):
            raise malformed(f"expected a JSON object, got {type(data).__name__}")
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing, unknown = sorted(required - set(data)), sorted(set(data) - {f.name for f in fields(cls)})
        if missing or unknown:
            raise malformed(f"missing keys {missing}" if missing else f"unknown keys {unknown}")
        try:
            return cls(**{**data, "schema_version": data.get("schema_version"),
                          "shards": [ShardEntry(**s) for s in data["shards"]],
                          "token_counts": {int(k): int(v) for k, v in data["token_counts"].items()}})
        except (TypeError, ValueError, AttributeError) as err:
            raise malformed(str(err)) from err


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def load_manifest(output: str) -> FeatureManifest:
    url = join(output, "manifest.json")
    with fsspec.open(url, "rt") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"malformed feature manifest {url}: not JSON ({err})") from err
    return FeatureManifest.from_json(data, source=url)


def write_manifest(output: str, manifest: FeatureManifest) -> None:
    commit_bytes(join(output, "manifest.json"), json.dumps(manifest.to_json(), indent=1).encode())


# --------------------------------------------------------------------------------------------------
# Fingerprints: what made an output, compared before anything is resumed or reused
# --------------------------------------------------------------------------------------------------

class FingerprintMismatch(ValueError):
    """An existing output (or a shard to reuse) was made by other inputs or settings than this run's."""


def tokenizer_fingerprint(folder) -> str:
    """A hash of the tokenizer files and the chat template of an HF folder (the token ids and the loss mask
    follow from them)."""
    from pathlib import Path

    folder = Path(folder)
    names = sorted({p.name for pattern in ("tokenizer*", "special_tokens_map.json", "chat_template*", "*.model",
                                           "vocab.*", "merges.txt") for p in folder.glob(pattern) if p.is_file()})
    h = hashlib.sha256()
    for name in names:
        h.update(name.encode() + b"\0" + (folder / name).read_bytes() + b"\0")
    return h.hexdigest()[:16]


# Keys of config.json that say who wrote it, not what the model computes.
CONFIG_KEYS_NOT_HASHED = ("transformers_version",)


def config_fingerprint(folder) -> str:
    """A hash of an HF folder's config.json (the architecture's settings the features follow from: rope_scaling,
    norms' epsilon, window sizes, ...), as canonical JSON (sorted keys, so formatting does not count), without the
    keys that only say which transformers version wrote it (`CONFIG_KEYS_NOT_HASHED`)."""
    from pathlib import Path

    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot fingerprint the target's config {path}: {err}") from err
    if not isinstance(config, dict):
        raise ValueError(f"cannot fingerprint the target's config {path}: not a JSON object")
    kept = {k: v for k, v in config.items() if k not in CONFIG_KEYS_NOT_HASHED}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def target_fingerprint(folder, target_config, max_length: int, dtype: torch.dtype, aux_layer_ids=None) -> dict:
    """The fingerprint fields a target determines (extraction's and the traffic sink's alike): its weights,
    config.json and tokenizer (read from its local `folder`), max_length, the hidden states' dtype and the aux
    layers."""
    from eagle_core.target import resolve_aux_layer_ids, weights_fingerprint

    return {
        "target_weights_hash": weights_fingerprint(folder),
        "target_config_hash": config_fingerprint(folder),
        "tokenizer_hash": tokenizer_fingerprint(folder),
        "max_length": max_length,
        "dtype": DTYPE_NAMES[dtype],
        "aux_layer_ids": list(resolve_aux_layer_ids(aux_layer_ids, target_config.num_hidden_layers)),
    }


def fingerprint_differences(recorded: dict | None, current: dict) -> list[str]:
    """'field: recorded -> current' for every field that differs (a missing fingerprint differs in all)."""
    if recorded is None:
        return ["fingerprint: none recorded (written by an older version) -> " + ", ".join(sorted(current))]
    return [f"{key}: {recorded.get(key)!r} -> {current.get(key)!r}" for key in sorted(set(recorded) | set(current))
            if recorded.get(key) != current.get(key)]


def check_fingerprint(recorded: dict | None, current: dict, what: str, remedy: str) -> None:
    """Raise FingerprintMismatch naming every differing field, or return when `recorded` equals `current`."""
    differences = fingerprint_differences(recorded, current)
    if differences:
        raise FingerprintMismatch(f"{what} was made differently from this run; differing fields: "
                                  + "; ".join(differences) + f". {remedy}")


# --------------------------------------------------------------------------------------------------
# Hidden states and feature rows
# --------------------------------------------------------------------------------------------------

def encode_hidden(t: torch.Tensor) -> bytes:
    t = t.contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def decode_hidden(blob: bytes, dtype: str, width: int) -> torch.Tensor:
    """Raw bytes of one row's hidden states -> [S, width] tensor of `dtype` (the manifest's)."""
    if dtype == "bfloat16":
        return torch.from_numpy(np.frombuffer(blob, dtype=np.int16).copy()).view(torch.bfloat16).reshape(-1, width)
    return torch.from_numpy(np.frombuffer(blob, dtype=np.dtype(dtype)).copy()).reshape(-1, width)


def feature_table(rows) -> pa.Table:
    return pa.table({
        "id": [r.id for r in rows],
        "input_ids": [r.input_ids.to(torch.int32).numpy() for r in rows],
        "loss_mask": [r.loss_mask.to(torch.int8).numpy() for r in rows],
        "aux_hidden": [encode_hidden(r.aux_hidden) for r in rows],
        "last_hidden": [encode_hidden(r.last_hidden) for r in rows],
    }, schema=FEATURE_SCHEMA)


def read_features(output: str):
    """The committed feature shards as a Ray Dataset (rows of FEATURE_SCHEMA)."""
    import ray

    filesystem, path = arrow_filesystem(join(output, "features"))
    return ray.data.read_parquet(path, filesystem=filesystem, file_extensions=["parquet"])


# --------------------------------------------------------------------------------------------------
# Shard discovery
# --------------------------------------------------------------------------------------------------

def read_shard_summary(url: str) -> dict:
    fs, path = url_to_fs(url)
    with fs.open(path, "rb") as f:
        meta = pq.read_metadata(f).metadata or {}
    return json.loads(meta[SHARD_META_KEY])


def committed_shards(output: str) -> set[str]:
    fs, path = url_to_fs(join(output, "features"))
    if not fs.exists(path):
        return set()
    return {os.path.basename(p)[: -len(".parquet")] for p in fs.ls(path, detail=False) if p.endswith(".parquet")}
