"""The extraction's Ray Data actor (`Extractor`): one target copy per actor, a shard of conversations in, a
committed Parquet shard (or feature rows, streaming) out.

Ray ships the class to its workers by reference to this module (`pipelines.extract.actor.Extractor`): it must stay
importable on every node, as the rest of the package is.
"""

from __future__ import annotations

import io
import json
import time
from collections import Counter

import fsspec
import numpy as np
import pyarrow.parquet as pq

from pipelines.extract.config import ExtractConfig
from pipelines.feature_files import DTYPE_NAMES, FEATURE_SCHEMA, SHARD_META_KEY, feature_table
from pipelines.storage import commit_bytes, exists, join


class Extractor:
    """One target copy per actor, run by the configured engine (pipelines.engines): a shard of conversations ->
    (regenerated, cached under regenerated/) -> committed Parquet shard (returns its summary), or feature rows
    (streaming). Regeneration and extraction share the actor's engine: no second pool of target copies idling while
    the other works. The engine is closed when the actor ends (`__del__`, and the engine's own exit and SIGTERM
    hooks)."""

    def __init__(self, config: dict, write: bool = True, fingerprint: dict | None = None):
        from pipelines.cluster import use_assigned_cpus
        from pipelines.engines import make_engine
        from pipelines.regenerate import OpenAIReplies, parse_regenerate_with

        use_assigned_cpus()
        self.config = ExtractConfig(**config)
        self.write, self.fingerprint = write, fingerprint  # recorded in every shard this actor commits
        self.engine = make_engine(self.config.engine_config(self.config.gpus_per_worker or 0))
        self.model, self.tokenizer = self.engine.model, self.engine.tokenizer
        # One client (and connection pool) per actor when a serving engine regenerates.
        server = parse_regenerate_with(self.config.regenerate_with)
        c = self.config
        self.replies = OpenAIReplies(server, c.max_new_tokens, c.temperature) if server else (
            lambda prompts, seed: self.engine.regenerate(prompts, c.max_new_tokens, c.temperature, seed))

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()

    def _regenerated(self, shard: str, rows_json: str) -> tuple[list[dict], dict]:
        """The shard's conversations with every assistant turn rewritten by the target (read back on reruns)."""
        from eagle_core.features import regenerate_conversations
        from pipelines.regenerate import OpenAIReplies

        c = self.config
        cache = join(c.output, "regenerated", f"{shard}.jsonl")
        if exists(cache):
            with fsspec.open(cache, "rt", encoding="utf-8") as f:
                saved = [json.loads(line) for line in f]
            return [r for r in saved if "messages" in r], {r["id"]: r["reason"] for r in saved if "reason" in r}
        seed = c.seed + int(shard.split("-")[1])
        conversations = json.loads(rows_json)
        rows, quarantined = regenerate_conversations(
            self.model, self.tokenizer, conversations, max_new_tokens=c.max_new_tokens, temperature=c.temperature,
            seed=seed, max_length=c.max_length,
            batch_size=c.regen_batch_size if c.engine == "hf" and not isinstance(self.replies, OpenAIReplies)
            else len(conversations),  # a serving engine batches a whole turn itself
            replies=self.replies)
        lines = [json.dumps(r, ensure_ascii=False) for r in rows]
        lines += [json.dumps({"id": i, "reason": why}) for i, why in quarantined.items()]
        commit_bytes(cache, ("\n".join(lines) + "\n").encode())
        return rows, quarantined

    def _features(self, shard: str, rows_json: str):
        from eagle_core.features import tokenize_for_training

        c = self.config
        rows, quarantined = self._regenerated(shard, rows_json) if c.regenerate else (json.loads(rows_json), {})
        tokenized, dropped = tokenize_for_training(self.tokenizer, rows, c.max_length)
        features = self.engine.features(tokenized, self.engine.aux_layer_ids, c.tokens_per_batch)
        return features, {**quarantined, **dropped}

    def __call__(self, batch: dict) -> dict:
        if not self.write:
            rows = [r for shard, rows_json in zip(batch["shard"], batch["rows_json"])
                    for r in self._features(shard, rows_json)[0]]
            return feature_table(rows).to_pydict() if rows else {name: [] for name in FEATURE_SCHEMA.names}
        summaries = []
        for shard, rows_json in zip(batch["shard"], batch["rows_json"]):
            start = time.perf_counter()
            features, quarantined = self._features(shard, rows_json)
            summary = self._summary(shard, features, quarantined, time.perf_counter() - start)
            table = feature_table(features)
            table = table.replace_schema_metadata({SHARD_META_KEY: json.dumps(summary).encode()})
            sink = io.BytesIO()
            pq.write_table(table, sink, compression="zstd")
            commit_bytes(join(self.config.output, "features", f"{shard}.parquet"), sink.getvalue())
            summaries.append(json.dumps({**summary, "bytes": sink.tell()}))
        return {"summary_json": np.array(summaries, dtype=object)}

    def _summary(self, shard: str, features, quarantined: dict, seconds: float) -> dict:
        counts = Counter()
        for f in features:
            counts.update(f.input_ids[f.loss_mask.bool()].tolist())
        from eagle_core.target import default_device, resolve_dtype

        dtype = features[0].aux_hidden.dtype if features else resolve_dtype(self.config.dtype, default_device())
        return {
            "shard": shard, "rows": len(features), "tokens": sum(len(f.input_ids) for f in features),
            "loss_tokens": sum(int(f.loss_mask.sum()) for f in features), "seconds": seconds,
            "quarantined": dict(Counter(quarantined.values())), "quarantined_ids": quarantined,
            "token_counts": {str(k): v for k, v in sorted(counts.items())}, "dtype": DTYPE_NAMES[dtype],
            "fingerprint": self.fingerprint,
        }
