"""Ray Data extraction: corpus -> (regenerate) -> chat template + loss mask -> target forward -> Parquet shards.

What an output folder holds (shards, regenerated conversations, quarantine, `manifest.json`) and the feature
schema: `pipelines.feature_files`.

Exactly-once: shard k holds rows [k*R, (k+1)*R) of the ingested corpus in input order and its name carries a
hash of its rows (ids and content), so a rerun maps the same rows to the same names and skips every shard already
committed, and a row edited in place lands in a shard of another name, extracted anew. The manifest lists exactly
the shards of this run's rows (training reads no others) and the corpus files by content (`corpus_files`).

Streaming: the conversations never pass through the driver. Ingest leaves them in Ray's object store; the shard
plan is cut there by one task per ingested block (`plan_shard_dataset`: each block's place in the corpus comes
from the blocks' row counts alone), and the driver keeps only the shard names, the quarantine is streamed to its
file a row at a time, and the manifest is summed shard by shard. The driver's memory grows with the number of
shards (their names, as the manifest lists them), not with the rows.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import fsspec
import numpy as np
import pyarrow.parquet as pq
import torch

from eagle_core.recipe import REFERENCE
from pipelines.feature_files import (
    DTYPE_NAMES,
    FEATURE_SCHEMA,
    SHARD_META_KEY,
    FeatureManifest,
    ShardEntry,
    check_fingerprint,
    committed_shards,
    feature_table,
    read_shard_summary,
    write_manifest,
)
from pipelines.shard_plan import one_shard_per_block, plan_shard_dataset
from pipelines.storage import commit_bytes, exists, join, read_bytes, url_to_fs


@dataclass
class ExtractConfig:
    corpus: str = "sharegpt"
    output: str = "work/features"
    target: str = "smollm2-135m"
    limit: int | None = None
    max_length: int = REFERENCE.max_length  # tokens per conversation (eagle_core/recipes/reference.toml)
    regenerate: bool = True
    # 'hf': the actor's own target generates (batches of regen_batch_size); 'openai:URL': an OpenAI-compatible
    # server does (vLLM, SGLang, jobs/serve.py), a whole shard's turn in flight at once (pipelines.regenerate)
    regenerate_with: str = "hf"
    # What runs the target in each actor (pipelines.engines): 'hf' (transformers, the reference) or 'vllm' (its
    # engine; tensor_parallel_size x pipeline_parallel_size GPUs per actor, on one node).
    engine: str = "hf"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_new_tokens: int = 512
    temperature: float = 0.0
    seed: int = 0
    aux_layer_ids: list[int] | None = None
    dtype: str = "auto"
    num_workers: int = 1
    gpus_per_worker: float | None = None  # None: 1 when the cluster has GPUs, else 0; > 1: device_map over them
    cpus_per_worker: float = 1.0
    tokens_per_batch: int = 8192
    rows_per_shard: int = 64
    regen_batch_size: int = 16
    mlflow_experiment: str | None = "eagle3-extract"
    # Earlier extraction outputs of the same target and settings: a planned shard committed there is copied
    # (features and regenerated conversations) instead of being computed again. Retraining at growing data
    # scales uses it: shard k of a prefix of the corpus is shard k of the whole.
    reuse_from: list[str] = field(default_factory=list)
    # An output made by other inputs or settings (its fingerprint differs) is refused, naming the differing fields;
    # overwrite=True deletes its shards, regenerated conversations and manifest first.
    overwrite: bool = False

    def __post_init__(self):
        from pipelines.engines import EngineError, check_engine_name
        from pipelines.regenerate import parse_regenerate_with

        check_engine_name(self.engine)  # clear errors before any work
        if parse_regenerate_with(self.regenerate_with) and self.engine != "hf":
            raise EngineError(f"--engine {self.engine} regenerates with its own engine; --regenerate-with openai:URL "
                              "(a serving engine regenerates) goes with --engine hf")
        if self.engine == "hf" and self.tensor_parallel_size * self.pipeline_parallel_size != 1:
            raise EngineError("tensor and pipeline parallelism need --engine vllm (the hf engine spreads a target "
                              "over an actor's GPUs with device_map: --gpus-per-worker)")

    def engine_config(self, gpus: float = 0):
        """The engine each actor runs (pipelines.engines.EngineConfig)."""
        from pipelines.engines import EngineConfig

        return EngineConfig(target=self.target, dtype=self.dtype, engine=self.engine, aux_layer_ids=self.aux_layer_ids,
                            max_length=self.max_length + (self.max_new_tokens if self.regenerate else 1), gpus=gpus,
                            tensor_parallel_size=self.tensor_parallel_size,
                            pipeline_parallel_size=self.pipeline_parallel_size, seed=self.seed)

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------------------------------
# Fingerprints: an output, each of its shards and its manifest record what made them
# --------------------------------------------------------------------------------------------------

FINGERPRINT_FILE = "fingerprint.json"


def extraction_fingerprint(config: ExtractConfig, folder, target_config, device: str) -> dict:
    """What determines a shard's bytes besides its rows (whose ids its name hashes): the target's weights, its
    tokenizer and chat template (both read from the target's local `folder`), max_length, the hidden states' dtype
    on `device`, the aux layers, the regeneration settings and the corpus. Not `limit`: a shard of a prefix is the
    same shard of the whole."""
    from eagle_core.target import resolve_dtype
    from pipelines.engines import engine_fingerprint
    from pipelines.feature_files import target_fingerprint

    engine = engine_fingerprint(config.engine)  # none for hf (the reference): older hf outputs stay valid
    return {
        **target_fingerprint(folder, target_config, config.max_length, resolve_dtype(config.dtype, device),
                             config.aux_layer_ids),
        **({"engine": engine} if engine else {}),
        "regeneration": {"with": config.regenerate_with, "max_new_tokens": config.max_new_tokens,
                         "temperature": config.temperature, "seed": config.seed} if config.regenerate else None,
        "corpus": config.corpus,
    }


def prepare_output(config: ExtractConfig, fingerprint: dict) -> None:
    """Refuse an output that another run made differently (its fingerprint file, its manifest, any committed
    shard), naming the differing fields; with `overwrite`, empty it instead. Then record this run's fingerprint
    before any shard is written, so a run killed early is checked too."""
    fs, root = url_to_fs(config.output)
    if config.overwrite:
        for part in ("features", "regenerated", "quarantine", "manifest.json", FINGERPRINT_FILE):
            if fs.exists(f"{root}/{part}"):
                fs.rm(f"{root}/{part}", recursive=True)
    else:
        remedy = ("Extract into another --output, or replace what is there: --overwrite (jobs/extract.py), "
                  "--extract '{\"overwrite\": true}' (jobs/retrain.py).")
        if exists(join(config.output, FINGERPRINT_FILE)):  # written before any shard: it speaks for all of them
            check_fingerprint(json.loads(read_bytes(join(config.output, FINGERPRINT_FILE))), fingerprint,
                              f"the extraction output {config.output}", remedy)
        else:  # an output without one: its manifest and every committed shard say what made them
            if exists(join(config.output, "manifest.json")):
                from pipelines.feature_files import load_manifest

                check_fingerprint(load_manifest(config.output).fingerprint, fingerprint,
                                  f"the extraction output {config.output} (its manifest)", remedy)
            for name in sorted(committed_shards(config.output)):
                summary = read_shard_summary(join(config.output, "features", f"{name}.parquet"))
                check_fingerprint(summary.get("fingerprint"), fingerprint, f"shard {name} of {config.output}",
                                  remedy)
    commit_bytes(join(config.output, FINGERPRINT_FILE), json.dumps(fingerprint, indent=1).encode())


def reuse_shards(config: ExtractConfig, names: list[str], fingerprint: dict | None = None) -> list[str]:
    """Copy planned shards committed in `config.reuse_from` outputs into this output; returns their names. A
    shard made differently (its recorded fingerprint differs from `fingerprint`) is refused, naming the fields."""
    done = committed_shards(config.output)
    reused = []
    for source in config.reuse_from:
        available = committed_shards(source) - done
        for name in names:
            if name not in available:
                continue
            if fingerprint is not None:
                summary = read_shard_summary(join(source, "features", f"{name}.parquet"))
                check_fingerprint(summary.get("fingerprint"), fingerprint, f"shard {name} of {source} (reuse_from)",
                                  f"Drop {source} from reuse_from, or re-extract it with this run's settings.")
            regenerated = join(source, "regenerated", f"{name}.jsonl")
            if config.regenerate and exists(regenerated):
                commit_bytes(join(config.output, "regenerated", f"{name}.jsonl"), read_bytes(regenerated))
            commit_bytes(join(config.output, "features", f"{name}.parquet"),
                         read_bytes(join(source, "features", f"{name}.parquet")))
            done.add(name)
            reused.append(name)
    return reused


# --------------------------------------------------------------------------------------------------
# Ray actors: one target per actor
# --------------------------------------------------------------------------------------------------

class Extractor:
    """One target copy per actor, run by the configured engine (pipelines.engines): a shard of conversations ->
    (regenerated, cached under regenerated/) -> committed Parquet shard (returns its summary), or feature rows
    (streaming). Regeneration and extraction share the actor's engine: no second pool of target copies idling while
    the other works. The engine is closed when the actor ends (`__del__`, and the engine's own exit and SIGTERM
    hooks)."""

    def __init__(self, config: dict, write: bool = True, fingerprint: dict | None = None):
        from transformers import AutoConfig

        from eagle_core.target import materialize_hf_folder, resolve_aux_layer_ids
        from pipelines.cluster import use_assigned_cpus
        from pipelines.engines import make_engine
        from pipelines.regenerate import OpenAIReplies, parse_regenerate_with

        use_assigned_cpus()
        self.config = ExtractConfig(**config)
        self.write, self.fingerprint = write, fingerprint  # recorded in every shard this actor commits
        self.engine = make_engine(self.config.engine_config(self.config.gpus_per_worker or 0))
        self.model, self.tokenizer = self.engine.model, self.engine.tokenizer
        layers = AutoConfig.from_pretrained(materialize_hf_folder(self.config.target)).num_hidden_layers
        self.aux_layer_ids = resolve_aux_layer_ids(self.config.aux_layer_ids, layers)
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
        return self.engine.features(tokenized, self.aux_layer_ids, c.tokens_per_batch), {**quarantined, **dropped}

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


# --------------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------------

def _actor_resources(config: ExtractConfig) -> dict:
    """One actor's Ray resources: its engine's target copy (vllm: tensor x pipeline parallel GPUs, on one node)."""
    import ray

    from pipelines.engines import gpus_per_copy

    gpus = config.gpus_per_worker
    if gpus is None:
        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    gpus = gpus_per_copy(config.engine_config(gpus))
    return {"num_gpus": gpus, "num_cpus": config.cpus_per_worker}


def check_engine_on_cluster(config: ExtractConfig) -> None:
    """The engine's own checks (installed, loads this target, GPUs per copy on one node of this cluster), before
    any work or any file is written."""
    import ray

    from pipelines.engines import check_engine

    per_node = [node["Resources"].get("GPU", 0) for node in ray.nodes() if node["Alive"]]
    check_engine(config.engine_config(_actor_resources(config)["num_gpus"]), per_node)


def _stages(ds, config: ExtractConfig, write: bool, fingerprint: dict | None = None):
    from ray.data import ActorPoolStrategy

    return ds.map_batches(Extractor, fn_constructor_kwargs={"config": config.to_dict(), "write": write,
                                                            "fingerprint": fingerprint},
                          batch_size=1, compute=ActorPoolStrategy(size=config.num_workers), **_actor_resources(config))


def stream_features(config: ExtractConfig):
    """The same stages as `run_extract`, returning the feature Dataset (rows of FEATURE_SCHEMA) unwritten."""
    from pipelines.data import ingest

    plan, _ = plan_shard_dataset(ingest(config.corpus, limit=config.limit).dataset, config.rows_per_shard)
    return _stages(one_shard_per_block(plan), config, write=False)


def write_ingest_quarantine(config: ExtractConfig, quarantine) -> int:
    """`quarantine/ingest.jsonl`: the quarantined rows in input order, one JSON line each, streamed from the
    Dataset to the file as Ray hands them over (`commit_stream`: written whole or not at all, never held whole
    in the driver's memory). Returns the number of lines."""
    from pipelines.storage import commit_stream

    count = 0

    def lines():
        nonlocal count
        for row in quarantine.iter_rows():
            count += 1
            yield (json.dumps(row, ensure_ascii=False) + "\n").encode()

    commit_stream(join(config.output, "quarantine", "ingest.jsonl"), lines())
    return count


def run_extract(config: ExtractConfig) -> FeatureManifest:
    """Run (or resume) an extraction; returns the manifest (also written to `<output>/manifest.json`)."""
    from transformers import AutoConfig

    from eagle_core.target import materialize_hf_folder, resolve_aux_layer_ids
    from pipelines.data import corpus_fingerprint, ingest

    started = time.perf_counter()
    check_engine_on_cluster(config)  # an engine that cannot run this target: an error before anything is written
    folder = materialize_hf_folder(config.target)  # resolved once: a hub id or a URL is not fetched again
    target_config = AutoConfig.from_pretrained(folder)
    device = "cuda" if _actor_resources(config)["num_gpus"] else "cpu"
    fingerprint = extraction_fingerprint(config, folder, target_config, device)
    prepare_output(config, fingerprint)  # refuses an output made differently (or empties it: overwrite)
    corpus_files = corpus_fingerprint(config.corpus)  # the corpus by content, recorded in the manifest
    ingested = ingest(config.corpus, limit=config.limit)  # rows stay in the object store
    print(f"[extract] {ingested.stats.summary()}", flush=True)
    if ingested.stats.quarantined:
        write_ingest_quarantine(config, ingested.quarantine)
    plan, names = plan_shard_dataset(ingested.dataset, config.rows_per_shard)
    stats = ingested.stats
    del ingested  # the plan holds the rows now: release the ingested copy from the object store
    reused = reuse_shards(config, names, fingerprint)
    done = committed_shards(config.output)
    todo = sum(name not in done for name in names)
    print(f"[extract] {len(names)} shards of <= {config.rows_per_shard} rows: {len(names) - todo} already "
          f"committed, {todo} to do", flush=True)
    if todo:
        from ray.data.expressions import col

        from pipelines.console import progress

        if done:  # committed shards are skipped before their rows reach an actor
            plan = plan.filter(expr=col("shard").not_in(sorted(done & set(names))))
        ds = one_shard_per_block(plan)
        rows_done = tokens_done = 0
        with progress(total=todo, desc="[extract] shards", unit="shard") as bar:
            for item in _stages(ds, config, write=True, fingerprint=fingerprint).iter_rows():  # committed by its actor
                summary = json.loads(item["summary_json"])
                rows_done, tokens_done = rows_done + summary["rows"], tokens_done + summary["tokens"]
                bar.set_postfix_str(f"{rows_done} rows, {tokens_done / max(bar.format_dict['elapsed'], 1e-9):.0f} "
                                    "tokens/s", refresh=False)
                bar.update(1)

    aux_layer_ids = resolve_aux_layer_ids(config.aux_layer_ids, target_config.num_hidden_layers)
    manifest = build_manifest(config, names, target_config, aux_layer_ids, stats.to_dict(),
                              fingerprint["target_weights_hash"])
    manifest.fingerprint = fingerprint
    manifest.corpus_files = corpus_files
    manifest.seconds = time.perf_counter() - started
    manifest.reused_shards = reused
    if config.mlflow_experiment:
        manifest.mlflow_run_id = _log_to_mlflow(config, manifest)
    write_manifest(config.output, manifest)
    return manifest


def build_manifest(config: ExtractConfig, shard_names: list[str], target_config, aux_layer_ids, ingest_stats: dict,
                   weights_hash: str) -> FeatureManifest:
    """The manifest of `shard_names`, summed one shard summary at a time (a summary's per-shard token counts and
    quarantined ids are dropped once added in: the driver keeps a row and token count per shard)."""
    fs, _ = url_to_fs(config.output)
    token_counts, quarantined = Counter(), Counter()
    entries, size, rows, loss_tokens, dtype = [], 0, 0, 0, None
    for name in shard_names:
        url = join(config.output, "features", f"{name}.parquet")
        summary = read_shard_summary(url)
        size += fs.size(url_to_fs(url)[1])
        token_counts.update({int(k): v for k, v in summary["token_counts"].items()})
        quarantined.update(summary["quarantined"])
        entries.append(ShardEntry(name=name, rows=summary["rows"], tokens=summary["tokens"]))
        rows, loss_tokens = rows + summary["rows"], loss_tokens + summary["loss_tokens"]
        dtype = dtype or summary["dtype"]
    tokens = sum(e.tokens for e in entries)
    dtype = dtype or "float32"
    hidden = target_config.hidden_size
    element = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    return FeatureManifest(
        target=config.target, target_weights_hash=weights_hash,
        target_hidden_size=hidden, target_vocab_size=target_config.vocab_size,
        target_num_hidden_layers=target_config.num_hidden_layers,
        aux_layer_ids=aux_layer_ids, dtype=dtype, max_length=config.max_length,
        regenerate=config.regenerate, regeneration={"max_new_tokens": config.max_new_tokens,
                                                    "temperature": config.temperature, "seed": config.seed,
                                                    "with": config.regenerate_with},
        corpus=config.corpus, limit=config.limit,
        rows=rows, tokens=tokens, loss_tokens=loss_tokens,
        ingest=ingest_stats, quarantined_by_reason=dict(quarantined),
        bytes=size, bytes_per_token=size / max(tokens, 1), min_bytes_per_token=4 * hidden * element,
        shards=entries,
        token_counts=dict(sorted(token_counts.items())),
        feature_schema={f.name: str(f.type) for f in FEATURE_SCHEMA},
        config=config.to_dict(),
    )


def _log_to_mlflow(config: ExtractConfig, manifest: FeatureManifest) -> str:
    from pipelines import tracking

    with tracking.start_run(config.mlflow_experiment, run_name=f"extract-{os.path.basename(config.output.rstrip('/'))}") as run:
        mlflow = tracking.configure()
        mlflow.log_params({k: v for k, v in config.to_dict().items() if v is not None})
        mlflow.log_params({"target_weights_hash": manifest.target_weights_hash, "output": config.output})
        seconds = max(manifest.seconds, 1e-9)
        mlflow.log_metrics({
            "rows": manifest.rows, "tokens": manifest.tokens, "loss_tokens": manifest.loss_tokens,
            "tokens_per_second": manifest.tokens / seconds, "bytes_per_token": manifest.bytes_per_token,
            "quarantined": sum(manifest.quarantined_by_reason.values()) + manifest.ingest["quarantined"],
        })
        mlflow.log_dict({k: v for k, v in manifest.to_json().items() if k != "token_counts"}, "manifest.json")
        return run.info.run_id


def local_feature_batches(model, tokenizer, n: int, max_length: int, min_loss_tokens: int = 32, skip: int = 0,
                          corpus: str | None = None, progress: str | None = None) -> list[dict]:
    """Features of the first usable conversations of a corpus file, in this process (no Ray, no regeneration):
    one batch {input_ids, loss_mask, aux_hidden, last_hidden} per conversation with at least
    `min_loss_tokens` loss tokens, after skipping `skip` of them. For benchmarks, tests and streaming distillation."""
    from itertools import islice

    from eagle_core.capture import capture_features
    from pipelines.distill import iter_usable

    batches = []
    for input_ids, loss_mask in islice(iter_usable(tokenizer, corpus, max_length, min_loss_tokens), skip, skip + n):
        ids = torch.tensor([input_ids])
        feats = capture_features(model, ids)
        batches.append(dict(input_ids=ids, loss_mask=torch.tensor([loss_mask]),
                            aux_hidden=feats.aux_hidden, last_hidden=feats.last_hidden))
        if progress and len(batches) % 20 == 0:
            print(f"[{progress}] features of {len(batches)} conversations", flush=True)
    return batches
