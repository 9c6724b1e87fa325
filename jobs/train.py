"""Train an EAGLE-3 draft with training-time test on Ray Train, from extracted features or a streamed corpus.

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python jobs/train.py --features work/features --output work/train/run1 --num-workers 2
    python jobs/train.py --features s3://bucket/features/run1 --output work/train/run1 --num-workers 8 --use-gpu
    python jobs/train.py --corpus sharegpt --limit 2000 --target smollm2-135m --output work/train/online
    python jobs/train.py --recipe llama3.1-8b-instruct --target meta-llama/Llama-3.1-8B-Instruct \
        --corpus chats.jsonl --dry-run

The recipe in force (--recipe, else the target's; eagle_core/recipes/) sets the learning rate and schedule, TTT
steps, draft vocabulary, tokens per step and, when streaming, max length, aux layers and GPUs per target copy,
unless those flags are given. --dry-run prints the plan and checks that target and recipe load (no Ray, no weights).
Connects to the cluster `ray job submit` gives it, else starts an embedded local one. Checkpoints go to
<output>/ray; rerun with --resume to continue a stopped run where its last checkpoint left it. The final
draft lands in <output>/draft (vLLM/SGLang layout) and <output>/draft-speculators, is logged to MLflow and
registered as a new version of --registered-model-name with alias `candidate`. Before that, where vLLM is installed,
the serving-engine gate decodes a few MT-bench prompts with the exported draft in vLLM and with the checkpoint's in
our decoder (--serving-gate): an export whose acceptance in vLLM falls below 0.9x ours does not finish.
"""

from __future__ import annotations

import argparse
import json
import sys

from jobs.extract import add_extraction_options, add_plan_options, resolve_job_recipe, target_shape
from pipelines.cli import defer_to_recipe, fill_from_recipe
from pipelines.serving_gate import GATE_MODES
from eagle_core.draft import DRAFT_KINDS
from pipelines.train import LM_HEAD_INITS, STRATEGIES, TrainJobConfig, run_train
from pipelines.train.config import parse_pack_length

# Streaming mode: the extraction options (jobs/extract.py) that apply, with their ExtractConfig names.
STREAM_OPTIONS = {
    "limit": "limit", "max_length": "max_length", "regenerate": "regenerate", "regenerate_with": "regenerate_with", "max_new_tokens": "max_new_tokens",
    "temperature": "temperature", "aux_layer_ids": "aux_layer_ids", "dtype": "dtype",
    "extract_workers": "num_workers", "gpus_per_extract_worker": "gpus_per_worker",
    "cpus_per_extract_worker": "cpus_per_worker", "extract_tokens_per_batch": "tokens_per_batch",
    "rows_per_shard": "rows_per_shard", "regen_batch_size": "regen_batch_size", "engine": "engine",
    "tensor_parallel_size": "tensor_parallel_size", "pipeline_parallel_size": "pipeline_parallel_size",
}
# Options that default to the recipe's values (option -> recipe value); the last two only when streaming.
RECIPE_OPTIONS = {"lr": "lr", "warmup_ratio": "warmup_ratio", "min_lr_ratio": "min_lr_ratio",
                  "tokens_per_batch": "tokens_per_batch", "ttt_steps": "ttt_steps",
                  "draft_vocab_size": "draft_vocab_size", "max_length": "max_length", "aux_layer_ids": "aux_layer_ids"}


def build_parser() -> argparse.ArgumentParser:
    from pipelines.extract import ExtractConfig

    d = TrainJobConfig(features="x")
    e = ExtractConfig()
    p = argparse.ArgumentParser(prog="train.py", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_argument_group("data (give --features or --corpus)")
    src.add_argument("--features", default=None, help="extraction output URL (manifest.json + features/*.parquet)")
    src.add_argument("--corpus", default=None, help="stream features from this corpus instead (no features on "
                     "disk); 'sharegpt' = the embedded ShareGPT file")
    p.add_argument("--output", default=d.output, help="output folder: checkpoints (ray/), exported drafts, summary")
    p.add_argument("--target", default=None, help="target model (default: the manifest's; required with --corpus)")

    t = p.add_argument_group("training")
    t.add_argument("--num-workers", type=int, default=d.num_workers, help="Ray Train workers (data parallel)")
    t.add_argument("--use-gpu", action=argparse.BooleanOptionalAction, default=d.use_gpu, help="one GPU per worker")
    t.add_argument("--cpus-per-worker", type=float, default=d.cpus_per_worker,
                   help="CPUs per worker (fractions keep Ray Data's readers from starving on small machines)")
    t.add_argument("--strategy", choices=STRATEGIES, default=d.strategy, help="ddp, or fsdp for large drafts")
    t.add_argument("--epochs", type=int, default=d.epochs, help="passes over the training split")
    t.add_argument("--max-steps", type=int, default=d.max_steps, help="stop after this many optimiser steps")
    t.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    t.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear warm-up steps "
                   "(default: --warmup-ratio of the planned steps)")
    t.add_argument("--warmup-ratio", type=float, default=d.warmup_ratio, help="warm-up as a fraction of the steps")
    t.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="cosine floor, as a fraction of --lr")
    t.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    t.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm, help="gradient clipping norm")
    t.add_argument("--tokens-per-batch", type=int, default=d.tokens_per_batch,
                   help="real tokens per optimiser step, over all workers together")
    t.add_argument("--pack-length", type=parse_pack_length, default=d.pack_length, metavar="TOKENS|longest|none",
                   help="sequence packing: several conversations per row of this many tokens (longest: each step's "
                   "longest conversation), attention and TTT steps kept inside each; none: one conversation per "
                   "row, right-padded")
    t.add_argument("--micro-batch-tokens", type=int, default=d.micro_batch_tokens, metavar="TOKENS",
                   help="gradient accumulation: each worker runs its share of a step in micro-batches of at most this "
                   "many tokens, gradients summed before the step (same batch and trajectory, less activation "
                   "memory; default: one forward per worker and step)")
    t.add_argument("--ttt-steps", type=int, default=d.ttt_steps, help="training-time-test steps")
    t.add_argument("--step-decay", type=float, default=d.step_decay, help="TTT step k's loss weight is decay**k")
    t.add_argument("--draft-vocab-size", type=int, default=d.draft_vocab_size,
                   help="draft vocabulary: the most frequent loss-masked target tokens")
    t.add_argument("--lm-head-init", choices=LM_HEAD_INITS, default=d.lm_head_init,
                   help="random (SpecForge) or the target's lm_head rows (needs draft hidden == target hidden)")
    t.add_argument("--draft-kind", choices=sorted(DRAFT_KINDS), default=d.draft_kind,
                   help="eagle3; eagle3.1 (target features normalised before fc, each step's post-norm state fed "
                        "to the next; vLLM reads it as norm_before_fc / norm_output); p-eagle (every depth drafted "
                        "in one forward from mask slots; vLLM's parallel_drafting)")
    t.add_argument("--eval-fraction", type=float, default=d.eval_fraction, help="held-out conversations")
    t.add_argument("--seed", type=int, default=d.seed, help="draft init and data order")
    t.add_argument("--log-every", type=int, default=d.log_every, help="progress line every N steps")

    c = p.add_argument_group("checkpoints")
    c.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="checkpoint every N steps "
                   "(and at every epoch end)")
    c.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints, help="keep the last K checkpoints")
    c.add_argument("--init-from", default=None, metavar="DRAFT_DIR",
                   help="warm start: seed the draft with an earlier draft's weights where shapes agree")
    c.add_argument("--resume", action="store_true", help="continue the run in --output from its last checkpoint")
    c.add_argument("--max-failures", type=int, default=d.max_failures,
                   help="worker failures to recover from automatically (restart from the last checkpoint)")
    c.add_argument("--run-name", default=d.run_name, help="Ray Train run name (default: train-<output name>)")

    m = p.add_argument_group("tracking")
    m.add_argument("--mlflow-experiment", default=d.mlflow_experiment, help="MLflow experiment ('' = no tracking)")
    m.add_argument("--registered-model-name", default=d.registered_model_name,
                   help="MLflow registered model for the draft ('' = do not register)")

    g = p.add_argument_group("serving-engine gate (pipelines/serving_gate.py, docs/training.md)")
    g.add_argument("--serving-gate", choices=GATE_MODES, default="auto",
                   help="measure the exported draft's acceptance length in vLLM against our decoder's chain of the "
                   "same depth on the same prompts; below 0.9x, or an export that differs from the checkpoint, "
                   "the export does not finish. auto: where vLLM is installed and loads the target (else a loud "
                   "warning that it was skipped); vllm: measure or fail; off: skip")
    g.add_argument("--serving-gate-k", type=int, default=None, metavar="K",
                   help="the depth the gate measures at (default: the draft's TTT depth, --ttt-steps)")

    s = p.add_argument_group("streaming (with --corpus: the extraction options of jobs/extract.py)")
    add_extraction_options(s, e)
    s.add_argument("--extract-workers", type=int, default=e.num_workers, help="target actors per stage")
    s.add_argument("--gpus-per-extract-worker", type=float, default=e.gpus_per_worker, help="GPUs per target actor")
    s.add_argument("--cpus-per-extract-worker", type=float, default=e.cpus_per_worker, help="CPUs per target actor")
    s.add_argument("--extract-tokens-per-batch", type=int, default=e.tokens_per_batch,
                   help="padded tokens per target forward")
    s.add_argument("--rows-per-shard", type=int, default=e.rows_per_shard, help="conversations per stream block")
    s.add_argument("--regen-batch-size", type=int, default=e.regen_batch_size, help="conversations per generate call")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, else a local cluster)")
    add_plan_options(p)
    defer_to_recipe(p, RECIPE_OPTIONS)
    return p


def config_from_args(args: dict) -> TrainJobConfig:
    extract = {STREAM_OPTIONS[k]: args.pop(k) for k in list(STREAM_OPTIONS)}
    args["mlflow_experiment"] = args["mlflow_experiment"] or None
    args["registered_model_name"] = args["registered_model_name"] or None
    if args["features"] is None and args["corpus"] is None:
        raise SystemExit("train.py: give --features (an extraction output) or --corpus (streaming)")
    return TrainJobConfig(**args, extract=extract if args["corpus"] is not None else {})


def job_target(args: dict) -> str | None:
    """The target of the run: --target, else (features mode) the extraction manifest's."""
    if args["target"] is not None or args["features"] is None:
        return args["target"]
    from pipelines.feature_files import load_manifest

    try:
        return load_manifest(args["features"]).target
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"train.py: cannot read the manifest of --features {args['features']}: {err}") from err


def main(argv=None) -> int:
    args = vars(build_parser().parse_args(argv))
    address, dry_run, gpu_memory_gib = args.pop("address"), args.pop("dry_run"), args.pop("gpu_memory_gib")
    if args["features"] is None and args["corpus"] is None and not (dry_run and args["target"]):
        raise SystemExit("train.py: give --features (an extraction output) or --corpus (streaming)"
                         + ("" if dry_run else "; --dry-run with --target alone plans for the target and recipe"))
    if args["corpus"] is not None and args["target"] is None:
        raise SystemExit("train.py: streaming from --corpus needs --target")
    target = job_target(args)
    shape = target_shape("train", target) if dry_run else None
    recipe = resolve_job_recipe("train", args.pop("recipe", None), target, gpu_memory_gib, shape)
    fill_from_recipe(args, recipe, RECIPE_OPTIONS)
    if args["gpus_per_extract_worker"] is None and recipe.gpus_per_target > 1:
        args["gpus_per_extract_worker"] = float(recipe.gpus_per_target)
    if dry_run:
        print("\n".join(dry_run_plan(args, target, recipe, shape, gpu_memory_gib).lines()), flush=True)
        return 0
    config = config_from_args(args)
    from pipelines.cluster import connect

    connect(address)
    summary = run_train(config)
    keys = ["step", "total_steps", "restored_from", "metrics", "mlflow_run_id", "registered_model", "model_version",
            "draft", "draft_speculators", "seconds"]
    print(json.dumps({k: summary.get(k) for k in keys}, indent=1, default=str))
    print(f"[train] draft in {summary['draft']}")
    return 0


def dry_run_plan(args: dict, target: str, recipe, shape, gpu_memory_gib: float):
    from pipelines.preflight import plan_extract, plan_from_manifest, plan_without_data

    train = {"epochs": args["epochs"], "eval_fraction": args["eval_fraction"],
             "tokens_per_batch": args["tokens_per_batch"], "max_steps": args["max_steps"],
             "pack_length": args["pack_length"], "micro_batch_tokens": args["micro_batch_tokens"],
             "train_workers": args["num_workers"], "strategy": args["strategy"]}
    if args["features"] is None and args["corpus"] is None:
        return plan_without_data(job="train", target=target, recipe=recipe, shape=shape, dtype=args["dtype"],
                                 num_workers=args["extract_workers"], gpus_per_worker=args["gpus_per_extract_worker"],
                                 gpu_memory_gib=gpu_memory_gib, **train)
    if args["features"] is not None:
        return plan_from_manifest(features=args["features"], recipe=recipe, shape=shape, gpu_memory_gib=gpu_memory_gib,
                                  **train)
    return plan_extract(job="train", streaming=True, target=target, corpus=args["corpus"], recipe=recipe,
                        shape=shape, max_length=args["max_length"], limit=args["limit"], dtype=args["dtype"],
                        num_workers=args["extract_workers"], gpus_per_worker=args["gpus_per_extract_worker"],
                        gpu_memory_gib=gpu_memory_gib, **train)


if __name__ == "__main__":
    sys.exit(main())
