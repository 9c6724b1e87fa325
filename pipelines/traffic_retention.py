"""What a traffic folder holds, as one traffic sink (`pipelines.traffic.TrafficSink`) knows it: the committed shards
of every replica writing there (their summaries and sizes), their retention, and the manifest of the live ones.

Retention (`max_shards`, `max_age_s`): after each commit the oldest shards beyond the limits are retired, in two
steps. A retired shard gets a tombstone `retired/<shard>.<ms>.json` that every replica reads, which takes it out of
every manifest written from then on; it leaves the store `retention_grace_s` later (longer than a training run
reads the shards its manifest named), and only if the manifest there now does not list it: a replica that listed
the folder before the tombstone and wrote its manifest after it would otherwise name a deleted shard. Several
replicas may share one URL (each its own writer id); each rebuilds the manifest from the shards listed there, so
one replica's manifest may miss another's newest shard until the next commit.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict
from typing import Callable

import torch

from pipelines.feature_files import (DTYPE_NAMES, FEATURE_SCHEMA, FeatureManifest, ShardEntry, committed_shards,
                                     load_manifest, read_shard_summary, write_manifest)
from pipelines.storage import commit_bytes, join, url_to_fs
from pipelines.traffic_config import CORPUS, TrafficConfig

RETIRED = "retired"  # the tombstones of retired shards (`TrafficShards.refresh`)


class TrafficShards:
    """The committed shards of `config.url` (any writer's), oldest first by name, with their summaries and sizes
    cached (shards never change); `refresh` retires and removes what retention says and rewrites the manifest.

    Used by the sink's writer thread, except `committed_bytes` (None until the first listing), which the sink's
    callers read. `count(name, n)` adds to the sink's counters (shards_retired, removals_deferred,
    shards_removed)."""

    def __init__(self, config: TrafficConfig, fingerprint: dict, target_config, dtype: torch.dtype,
                 count: Callable[[str, int], None]):
        self.config, self.fingerprint, self.target_config, self.dtype = config, fingerprint, target_config, dtype
        self.count = count
        self.hidden, self.aux_layer_ids = target_config.hidden_size, list(fingerprint["aux_layer_ids"])
        self.summaries: dict[str, dict] = {}  # committed shard -> its summary
        self.sizes: dict[str, int] = {}  # committed shard -> its size
        self.committed_bytes: int | None = None  # known after the first listing

    def add(self, name: str, summary: dict, size: int) -> None:
        """A shard this writer has just committed."""
        self.summaries[name] = summary
        self.sizes[name] = size

    def committed(self) -> int:
        """Bytes of the committed shards (listed once; then kept up to date by this writer)."""
        if self.committed_bytes is None:
            try:
                self.scan()
            except Exception:  # noqa: BLE001 -- an unreachable store: nothing known yet
                return 0
        return self.committed_bytes

    def scan(self) -> list[str]:
        """Every committed shard of the folder (any writer's), oldest first; their summaries and sizes cached."""
        fs, _ = url_to_fs(self.config.url)
        names = sorted(committed_shards(self.config.url))
        for name in names:
            if name not in self.summaries:
                url = join(self.config.url, "features", f"{name}.parquet")
                self.summaries[name] = read_shard_summary(url)
                self.sizes[name] = fs.size(url_to_fs(url)[1])
        for gone in set(self.summaries) - set(names):
            self.summaries.pop(gone)
            self.sizes.pop(gone, None)
        self.committed_bytes = sum(self.sizes[n] for n in names)
        return names

    def refresh(self) -> None:
        """Retention in two steps (module docstring), then the manifest of the live shards."""
        names = self.scan()
        now_ms = int(time.time() * 1000)
        retired = self.retired()
        live = [n for n in names if n not in retired]
        expired = self.expired(live)
        for name in expired:
            commit_bytes(join(self.config.url, RETIRED, f"{name}.{now_ms}.json"), b"{}")
            retired[name] = now_ms
        if expired:
            self.count("shards_retired", len(expired))
        keep = [n for n in live if n not in expired]
        write_manifest(self.config.url, self.manifest(keep))
        due = [n for n, ms in retired.items() if n in names and now_ms - ms >= self.config.retention_grace_s * 1000]
        if due:
            listed = {s.name for s in load_manifest(self.config.url).shards}  # another replica's, maybe
            fs, _ = url_to_fs(self.config.url)
            for name in due:
                if name in listed:
                    self.count("removals_deferred", 1)  # listed by a manifest again: the next refresh rewrites it
                    continue
                try:
                    fs.rm(url_to_fs(join(self.config.url, "features", f"{name}.parquet"))[1])
                except FileNotFoundError:  # another replica removed it first
                    pass
                self.summaries.pop(name, None)
                self.sizes.pop(name, None)
                self.count("shards_removed", 1)
                names.remove(name)
            self.committed_bytes = sum(self.sizes.values())
        for name, ms in retired.items():  # tombstones of shards no longer in the store
            if name not in names:
                try:
                    url_to_fs(self.config.url)[0].rm(url_to_fs(join(self.config.url, RETIRED, f"{name}.{ms}.json"))[1])
                except FileNotFoundError:
                    pass

    def retired(self) -> dict[str, int]:
        """Retired shard -> when it was retired (ms), from the tombstones every replica writes."""
        fs, path = url_to_fs(join(self.config.url, RETIRED))
        if not fs.exists(path):
            return {}
        out = {}
        for entry in fs.ls(path, detail=False):
            stem = entry.rsplit("/", 1)[-1].removesuffix(".json")
            name, _, ms = stem.rpartition(".")
            if name and ms.isdigit():
                out[name] = min(int(ms), out.get(name, int(ms)))
        return out

    def expired(self, names: list[str]) -> list[str]:
        """The shards of `names` (oldest first) past `max_age_s`, then the oldest beyond `max_shards`."""
        expired = []
        if self.config.max_age_s is not None:
            cutoff = (time.time() - self.config.max_age_s) * 1000
            expired = [n for n in names if self.created_ms(n) < cutoff]
        left = [n for n in names if n not in expired]
        if self.config.max_shards is not None and len(left) > self.config.max_shards:
            expired += left[: len(left) - self.config.max_shards]
        return expired

    def created_ms(self, name: str) -> int:
        created = self.summaries.get(name, {}).get("created_unix_ms")
        return int(created) if created is not None else int(name.split("-")[1])

    def manifest(self, names: list[str]) -> FeatureManifest:
        token_counts = Counter()
        for name in names:
            token_counts.update({int(k): v for k, v in self.summaries[name]["token_counts"].items()})
        entries = [ShardEntry(name=n, rows=self.summaries[n]["rows"], tokens=self.summaries[n]["tokens"])
                   for n in names]
        tokens, size = sum(e.tokens for e in entries), sum(self.sizes[n] for n in names)
        element = torch.tensor([], dtype=self.dtype).element_size()
        return FeatureManifest(
            target=self.config.target, target_weights_hash=self.fingerprint["target_weights_hash"],
            target_hidden_size=self.hidden, target_vocab_size=self.target_config.vocab_size,
            target_num_hidden_layers=self.target_config.num_hidden_layers, aux_layer_ids=self.aux_layer_ids,
            dtype=DTYPE_NAMES[self.dtype], max_length=self.config.max_length, regenerate=False,
            regeneration={"with": "serve"}, corpus=CORPUS,
            rows=sum(e.rows for e in entries), tokens=tokens,
            loss_tokens=sum(self.summaries[n]["loss_tokens"] for n in names),
            bytes=size, bytes_per_token=size / max(tokens, 1), min_bytes_per_token=4 * self.hidden * element,
            shards=entries, token_counts=dict(sorted(token_counts.items())),
            feature_schema={f.name: str(f.type) for f in FEATURE_SCHEMA},
            config={k: v for k, v in asdict(self.config).items()}, fingerprint=self.fingerprint,
        )
