"""The extraction job: corpus -> (regenerate) -> chat template + loss mask -> target forward -> Parquet shards
and their manifest, on Ray Data (`run_extract`), or the same stages' feature rows unwritten (`stream_features`).

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

import json
import os
import time
from collections import Counter

import torch

from pipelines.extract.actor import Extractor
from pipelines.extract.config import ExtractConfig
from pipelines.extract.fingerprint import extraction_fingerprint, prepare_output, reuse_shards
from pipelines.feature_files import (FEATURE_SCHEMA, FeatureManifest, ShardEntry, committed_shards,
                                     read_shard_summary, write_manifest)
from pipelines.shard_plan import one_shard_per_block, plan_shard_dataset
from pipelines.storage import join, url_to_fs


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

    run_name = f"extract-{os.path.basename(config.output.rstrip('/'))}"
    with tracking.start_run(config.mlflow_experiment, run_name=run_name) as run:
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
