"""Benchmark: extraction tokens/s through the Ray Data pipeline vs a plain in-process loop on the same rows.

    python -m bench.extract --rows 48 --max-length 512 --out bench/results/extract.json
    python -m bench.extract --engine hf,vllm --out bench/results/extract-engines.json

With `--engine` (one or more of pipelines.engines' names) it measures the engines side by side on the same rows,
each in its own interleaved turn: the Ray Data extraction (one actor, engine start included), and in this process
the engine's start, its features (tokens/s, warm) and its greedy regeneration of `--regen-prompts` MT-bench-style
prompts x `--regen-tokens` new tokens (generated tokens/s, one batch). Without it, the hf engine against the plain
loop, as before.

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

    from pipelines.extract.job import _stages
    from pipelines.shard_plan import plan_shards
    from pipelines.feature_files import read_shard_summary

    shards = plan_shards(rows, config.rows_per_shard)
    start = time.perf_counter()
    ds = ray.data.from_items(shards, override_num_blocks=len(shards))
    summaries = [json.loads(r["summary_json"]) for r in _stages(ds, config, write=True).iter_rows()]
    seconds = time.perf_counter() - start
    assert all(read_shard_summary(f"{config.output}/features/{s['shard']}.parquet") for s in summaries)
    return seconds, {"tokens": sum(s["tokens"] for s in summaries), "bytes": sum(s["bytes"] for s in summaries)}


def engine_turn(name: str, rows, config, regen_prompts: int, regen_tokens: int) -> dict:
    """One engine's numbers: Ray Data extraction, then in this process start, features and regeneration."""
    import dataclasses

    from eagle_core.chat import prompt_ids
    from eagle_core.features import tokenize_for_training
    from pipelines.engines import make_engine

    config = dataclasses.replace(config, engine=name, output=os.path.join(config.output, name))
    ray_s, ray_out = ray_pipeline(rows, config)
    start = time.perf_counter()
    with make_engine(config.engine_config()) as engine:
        start_s = time.perf_counter() - start
        tokenized, _ = tokenize_for_training(engine.tokenizer, rows, config.max_length)
        aux = engine.aux_layer_ids
        engine.features(tokenized[:2], aux, config.tokens_per_batch)  # warm
        t = time.perf_counter()
        engine.features(tokenized, aux, config.tokens_per_batch)
        feature_s = time.perf_counter() - t
        questions = [r["messages"][0]["content"] for r in rows if r["messages"][0]["role"] == "user"][:regen_prompts]
        prompts = [prompt_ids(engine.tokenizer, [{"role": "user", "content": q}]) for q in questions]
        t = time.perf_counter()
        replies = engine.regenerate(prompts, regen_tokens, 0.0, 0)
        regen_s = time.perf_counter() - t
    generated = sum(len(engine.tokenizer(r.text, add_special_tokens=False)["input_ids"]) for r in replies)
    tokens = sum(len(t[1]) for t in tokenized)
    return {"engine": name, "ray_seconds": ray_s, "ray_tokens_per_s": ray_out["tokens"] / ray_s,
            "start_seconds": start_s, "feature_tokens_per_s": tokens / feature_s, "feature_seconds": feature_s,
            "regen_prompts": len(prompts), "regen_generated_tokens": generated, "regen_seconds": regen_s,
            "regen_tokens_per_s": generated / regen_s, "replies": [r.text for r in replies]}


def cpu_flags() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)


def engines_main(args, rows, config) -> int:
    from bench.common import machine

    turns = [engine_turn(name, rows, config, args.regen_prompts, args.regen_tokens)
             for name in args.engine.split(",")]
    same = len({tuple(t["replies"]) for t in turns}) == 1
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(torch.get_num_threads()),
              "cpu_flags": cpu_flags(), "target": args.target, "dtype": config.dtype, "rows": len(rows),
              "max_length": args.max_length, "regen_tokens": args.regen_tokens, "engines": turns,
              "greedy_replies_identical_across_engines": same, "command": command("extract", args.argv)}
    write_json(args.out, result, indent=1)
    lines = [f"# Extraction engines side by side ({result['date']})", "",
             f"`{result['command']}` on {result['machine']} ({result['cpu_flags']}), {args.target}, {config.dtype}, "
             f"{len(rows)} ShareGPT rows cut at {args.max_length} tokens; regeneration: "
             f"{turns[0]['regen_prompts']} prompts x up to {args.regen_tokens} tokens, greedy, one batch.", "",
             "| engine | Ray Data extraction tokens/s (actor start included) | engine start s | features tokens/s "
             "(warm) | regeneration generated tokens/s |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {t['engine']} | {t['ray_tokens_per_s']:.0f} ({t['ray_seconds']:.1f} s) | {t['start_seconds']:.1f} | "
              f"{t['feature_tokens_per_s']:.0f} | {t['regen_tokens_per_s']:.1f} |" for t in turns]
    lines += ["", f"Greedy replies identical across engines: {same}."]
    from bench.common import write_markdown

    write_markdown(args.out, "\n".join(lines) + "\n")
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default=None, help="engines to compare, e.g. hf,vllm (pipelines.engines)")
    p.add_argument("--dtype", default="auto", choices=["float32", "bfloat16", "auto"], help="target dtype (auto: bf16 where native)")
    p.add_argument("--regen-prompts", type=int, default=8, help="--engine: prompts regenerated in one batch")
    p.add_argument("--regen-tokens", type=int, default=64, help="--engine: new tokens per regenerated reply")
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
    args.argv = argv
    from pipelines.cluster import connect
    from pipelines.data import ingest
    from pipelines.extract import ExtractConfig

    threads = torch.get_num_threads()
    connect(num_cpus=max(4, 2 * threads))
    with tempfile.TemporaryDirectory() as tmp:
        config = ExtractConfig(target=args.target, output=tmp, regenerate=False, max_length=args.max_length,
                               tokens_per_batch=args.tokens_per_batch, rows_per_shard=args.rows_per_shard,
                               num_workers=1, cpus_per_worker=threads, gpus_per_worker=0, mlflow_experiment=None,
                               dtype=args.dtype)
        rows = ingest("sharegpt", limit=args.rows).dataset.take_all()
        if args.engine:
            return engines_main(args, rows, config)
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
