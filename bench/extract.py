"""Benchmark: extraction tokens/s through the Ray Data pipeline vs a plain in-process loop on the same rows.

    python -m bench.extract --rows 48 --max-length 512 --out bench/results/extract.json

Both sides start from the same ingested conversations in memory and end with Parquet bytes of the same
features: the plain loop loads the target, tokenises, runs the target by length batches and encodes; the Ray
side runs the regular extraction stages (actor start and model load included) with one actor holding as
many CPUs as the plain process has threads. Regeneration is off: it is generation, benchmarked elsewhere.
Also reports bytes/token of the written shards against the floor 4*H*bytes_per_element.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time

import pyarrow.parquet as pq
import torch

from bench.common import RESULTS, command, write_json


def plain_loop(rows, config) -> tuple[float, int, int]:
    from eagle_core.features import featurize, tokenize_for_training
    from eagle_core.target import load_target, resolve_aux_layer_ids
    from pipelines.feature_files import feature_table

    start = time.perf_counter()
    model, tokenizer = load_target(config.target, dtype=config.dtype)
    aux = resolve_aux_layer_ids(config.aux_layer_ids, model.config.num_hidden_layers)
    tokenized, _ = tokenize_for_training(tokenizer, rows, config.max_length)
    features = featurize(model, tokenized, aux, config.tokens_per_batch)
    sink = io.BytesIO()
    pq.write_table(feature_table(features), sink, compression="zstd")
    return time.perf_counter() - start, sum(len(t[1]) for t in tokenized), sink.tell()


def ray_pipeline(rows, config) -> tuple[float, dict]:
    import ray

    from pipelines.extract import _stages
    from pipelines.shard_plan import plan_shards
    from pipelines.feature_files import read_shard_summary

    shards = plan_shards(rows, config.rows_per_shard)
    start = time.perf_counter()
    ds = ray.data.from_items(shards, override_num_blocks=len(shards))
    summaries = [json.loads(r["summary_json"]) for r in _stages(ds, config, write=True).iter_rows()]
    seconds = time.perf_counter() - start
    assert all(read_shard_summary(f"{config.output}/features/{s['shard']}.parquet") for s in summaries)
    return seconds, {"tokens": sum(s["tokens"] for s in summaries), "bytes": sum(s["bytes"] for s in summaries)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m", help="target model (a named target, an HF folder or a hub id)")
    p.add_argument("--rows", type=int, default=48, help="ShareGPT conversations")
    p.add_argument("--max-length", type=int, default=512, help="tokens per conversation")
    p.add_argument("--tokens-per-batch", type=int, default=4096, help="padded tokens per target forward")
    p.add_argument("--rows-per-shard", type=int, default=16, help="conversations per output shard")
    p.add_argument("--out", default=str(RESULTS / "extract.json"), help="result JSON file")
    return p.parse_args(argv)


def hidden_size(target: str) -> int:
    from transformers import AutoConfig

    from eagle_core.target import materialize_hf_folder

    return AutoConfig.from_pretrained(materialize_hf_folder(target)).hidden_size


def main(argv=None) -> int:
    args = parse_args(argv)
    from pipelines.cluster import connect
    from pipelines.data import ingest
    from pipelines.extract import ExtractConfig

    threads = torch.get_num_threads()
    connect(num_cpus=max(4, 2 * threads))
    with tempfile.TemporaryDirectory() as tmp:
        config = ExtractConfig(target=args.target, output=tmp, regenerate=False, max_length=args.max_length,
                               tokens_per_batch=args.tokens_per_batch, rows_per_shard=args.rows_per_shard,
                               num_workers=1, cpus_per_worker=threads, gpus_per_worker=0, mlflow_experiment=None)
        rows = ingest("sharegpt", limit=args.rows).dataset.take_all()
        plain_s, tokens, plain_bytes = plain_loop(rows, config)
        ray_s, ray_out = ray_pipeline(rows, config)
    assert ray_out["tokens"] == tokens
    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPU cores, torch threads {threads}",
        "target": args.target, "rows": len(rows), "tokens": tokens, "max_length": args.max_length,
        "plain_seconds": plain_s, "ray_seconds": ray_s,
        "plain_tokens_per_s": tokens / plain_s, "ray_tokens_per_s": tokens / ray_s,
        "ray_over_plain": plain_s / ray_s,
        "bytes_per_token": ray_out["bytes"] / tokens, "plain_bytes_per_token": plain_bytes / tokens,
        "min_bytes_per_token": 4 * hidden_size(args.target) * 4, "dtype": "float32",
        "command": command("extract", argv),
    }
    write_json(args.out, result, indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
