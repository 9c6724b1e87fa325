"""Training throughput: Ray Train (jobs/train.py's loop) vs the bare eagle_core loop in one process.

    python -m bench.train [--conversations 48 --max-length 256 --steps 24]

Both train the SmolLM2-sized draft on the same real SmolLM2 features, the same global batches (the job's
plan: held-out split, epoch order, token packing) and the same hyper-parameters, with the same number of
torch threads. "Bare" is `eagle_core.ttt.train_draft_steps` over batches already decoded, padded and in
memory; "Ray Train" is the whole job: one TorchTrainer worker reading its planned shard through Ray Data,
decoding, padding, all-reduces, per-step MLflow logging and a checkpoint at the end. Throughput counts real
(non-padding) tokens. Results: bench/results/train.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import RESULTS, ROOT, add_draft_training_args, command, smollm2_recipe, write_json
from pipelines.train import (
    TrainJobConfig,
    collate,
    decode_row,
    epoch_order,
    load_target_heads,
    pack_batches,
    run_train,
    scan_features,
    split_heldout,
    target_config,
    vocab_from_counts,
)


def ensure_features(folder: Path, conversations: int, max_length: int) -> str:
    from pipelines.extract import ExtractConfig, run_extract
    from pipelines.feature_files import load_manifest

    if not (folder / "manifest.json").is_file() or load_manifest(str(folder)).limit != conversations:
        run_extract(ExtractConfig(corpus="sharegpt", limit=conversations, output=str(folder), regenerate=False,
                                  max_length=max_length, rows_per_shard=16, cpus_per_worker=1.0,
                                  mlflow_experiment=None))
    return str(folder)


def planned_batches(config: TrainJobConfig, meta: dict) -> list[dict]:
    """The job's global batches of epoch 0, decoded and padded (one process = one rank holding all of each)."""
    import pyarrow.parquet as pq

    import fsspec

    train, _ = split_heldout(scan_features(config.features), config.eval_fraction)
    batches = pack_batches(epoch_order(train, config.seed, 0), config.tokens_per_batch)
    tables = {}
    out = []
    for batch in batches[: config.max_steps]:
        rows = []
        for r in batch:
            if r["file"] not in tables:
                with fsspec.open(r["file"], "rb") as f:
                    tables[r["file"]] = pq.read_table(f).to_pylist()
            rows.append(decode_row(tables[r["file"]][r["row"]], meta))
        out.append(collate(rows, meta, config.ttt_steps, torch.device("cpu"),
                           config.row_length([len(r["input_ids"]) for r in rows])))
    return out


def bench_bare(config: TrainJobConfig, threads: int) -> dict:
    from eagle_core.ttt import train_draft_steps
    from pipelines.feature_files import load_manifest
    from pipelines.train import Lineage, build_draft

    torch.set_num_threads(threads)
    manifest = load_manifest(config.features)
    meta = {"target_hidden_size": manifest.target_hidden_size, "target_vocab_size": manifest.target_vocab_size,
            "dtype": manifest.dtype}
    tconfig = target_config(manifest.target)
    heads = load_target_heads(manifest.target, torch.device("cpu"))
    d2t, t2d = vocab_from_counts(manifest.token_counts, tconfig.vocab_size, config.draft_vocab_size)
    draft = build_draft(config, tconfig, heads, d2t, t2d, Lineage.of_features(config.features, manifest))
    batches = planned_batches(config, meta)
    times, tokens = [], []
    last = [time.perf_counter()]

    def on_step(step, metrics):
        now = time.perf_counter()
        times.append(now - last[0])
        tokens.append(metrics["tokens"])
        last[0] = now

    train_draft_steps(draft, batches, heads["lm_head"], config.train_config(len(batches)), on_step=on_step)
    steady = slice(1, None)  # the first step pays for allocator warm-up in both setups
    return {"steps": len(times), "tokens_per_s": sum(tokens[steady]) / sum(times[steady]),
            "median_step_s": statistics.median(times[steady])}


def bench_ray(config: TrainJobConfig) -> dict:
    from pipelines import tracking

    started = time.perf_counter()
    summary = run_train(config)
    wall = time.perf_counter() - started
    client = tracking.configure().tracking.MlflowClient()
    tps = sorted(client.get_metric_history(summary["mlflow_run_id"], "tokens_per_s"), key=lambda m: m.step)
    tok = sorted(client.get_metric_history(summary["mlflow_run_id"], "tokens"), key=lambda m: m.step)
    steady = slice(1, None)
    tokens = [m.value for m in tok][steady]
    seconds = [t.value / s.value for t, s in zip(tok, tps)][steady]
    return {"steps": len(tps), "tokens_per_s": sum(tokens) / sum(seconds), "median_step_s": statistics.median(seconds),
            "job_wall_s": wall, "job_tokens_per_s_incl_startup": sum(m.value for m in tok) / wall}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=48, help="ShareGPT conversations to train on")
    add_draft_training_args(p, steps=24, max_length=256)
    p.add_argument("--tokens-per-batch", type=int, default=2048, help="real tokens per optimiser step")
    p.add_argument("--threads", type=int, default=2, help="torch threads in both setups (Ray: CPUs per worker)")
    p.add_argument("--work", default=str(ROOT / "work" / "bench-train"), help="work folder of both setups")
    p.add_argument("--out", default=str(RESULTS / "train.json"), help="result JSON file")
    return p.parse_args(argv)


def job_config(args, features: str, work: Path) -> TrainJobConfig:
    """The training job both setups run: `--steps` steps, one epoch, no mid-run checkpoints or step logs."""
    return TrainJobConfig(features=features, output=str(work / f"run-{int(time.time())}"), max_steps=args.steps,
                          epochs=1, lr=smollm2_recipe().lr, warmup_steps=2, tokens_per_batch=args.tokens_per_batch,
                          ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab_size, eval_fraction=0.1,
                          checkpoint_every=10 ** 6, cpus_per_worker=float(args.threads),
                          mlflow_experiment="bench-train", registered_model_name=None, log_every=10 ** 6)


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.work)
    os.environ.setdefault("EAGLE3_WORK", str(work / "mlflow"))
    from pipelines.cluster import connect

    connect(None)
    features = ensure_features(work / "features", args.conversations, args.max_length)
    config = job_config(args, features, work)
    bare = bench_bare(config, args.threads)
    ray_train = bench_ray(config)
    result = {
        "what": "TTT training tokens/s (real tokens): Ray Train job (1 worker) vs bare eagle_core loop (1 process)",
        "command": command("train", argv),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "threads": args.threads, "device": "cpu"},
        "setup": {"target": "smollm2-135m", "conversations": args.conversations, "max_length": args.max_length,
                  "tokens_per_batch": args.tokens_per_batch, "ttt_steps": args.ttt_steps,
                  "draft_vocab_size": args.draft_vocab_size, "steps": args.steps},
        "bare": bare,
        "ray_train": ray_train,
        "overhead_ratio_steady": bare["tokens_per_s"] / ray_train["tokens_per_s"],
        "overhead_ratio_incl_startup": bare["tokens_per_s"] / ray_train["job_tokens_per_s_incl_startup"],
    }
    write_json(args.out, result, indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
