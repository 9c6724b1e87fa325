"""Extract EAGLE-3 training features: corpus -> regenerate -> chat template + loss mask -> target -> Parquet.

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python jobs/extract.py --limit 1000
    python jobs/extract.py --corpus s3://bucket/chats/ --output s3://bucket/features/run1 --num-workers 8
    python jobs/extract.py --target meta-llama/Llama-3.1-8B-Instruct --corpus chats.jsonl --dry-run

The recipe in force (--recipe, else the target's; eagle_core/recipes/) sets --max-length, --aux-layer-ids and the
GPUs per target copy unless those flags are given. --dry-run prints the plan (rows, tokens, feature bytes, GPUs per
target copy, the recipe) and checks that target and recipe load, without Ray, weights or a GPU.
Connects to the cluster `ray job submit` gives it, else starts an embedded local one. Rerunning with the
same arguments resumes: committed shards are skipped, regenerated conversations are reused.
"""

from __future__ import annotations

import argparse
import json
import sys

from eagle_core.recipe import GPU_MEMORY_GIB

from pipelines.cli import add_recipe_option, comma_separated, defer_to_recipe, fill_from_recipe
from pipelines.extract import ExtractConfig, run_extract

# Options of the extraction that default to the recipe's values (option -> recipe value).
RECIPE_OPTIONS = {"max_length": "max_length", "aux_layer_ids": "aux_layer_ids"}


parse_layer_ids = comma_separated(int, "integers",
                                  lambda ids: None if len(ids) == 3 else "EAGLE-3 uses exactly three aux layers")


def regenerate_with(value: str) -> str:
    from pipelines.regenerate import parse_regenerate_with

    try:
        parse_regenerate_with(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    return value


def add_extraction_options(p, d: ExtractConfig) -> None:
    """What to read and how the target regenerates and computes: shared with jobs/train.py's streaming mode."""
    p.add_argument("--limit", type=int, default=d.limit, help="read at most this many corpus rows")
    p.add_argument("--max-length", type=int, default=d.max_length, help="truncate conversations to this many tokens")
    p.add_argument("--regenerate", action=argparse.BooleanOptionalAction, default=d.regenerate,
                   help="rewrite assistant turns with the target before extracting")
    p.add_argument("--regenerate-with", type=regenerate_with, default=d.regenerate_with, metavar="hf|openai:URL",
                   help="who regenerates: 'hf' (the target in each extraction actor) or any OpenAI-compatible server, "
                        "e.g. openai:http://vllm:8000/v1 (prompts sent as token ids; OPENAI_API_KEY as bearer)")
    p.add_argument("--engine", choices=["hf", "vllm"], default=d.engine,
                   help="what runs the target in each actor: hf (transformers, the reference) or vllm (its engine; "
                        "docs/engines.md)")
    p.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size,
                   help="vllm: GPUs one target copy is split over by tensor parallelism (one node)")
    p.add_argument("--pipeline-parallel-size", type=int, default=d.pipeline_parallel_size,
                   help="vllm: pipeline stages of one target copy (one GPU each, same node)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="regeneration: tokens per reply")
    p.add_argument("--temperature", type=float, default=d.temperature, help="regeneration temperature (0 = greedy)")
    p.add_argument("--aux-layer-ids", type=parse_layer_ids, default=d.aux_layer_ids,
                   help="three output_hidden_states indices, e.g. 2,15,27 (a recipe without ids: [2, N//2, N-3])")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="target compute dtype (auto: bf16 where native, else fp32); features are stored in it")


def add_plan_options(p) -> None:
    """--recipe, --dry-run and the GPU size the plan assumes: shared with jobs/train.py."""
    add_recipe_option(p)
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (rows, tokens, feature bytes, GPUs per target copy, steps, the recipe) and "
                        "check that target and recipe load; no Ray, no weights, nothing written")
    p.add_argument("--gpu-memory-gib", type=float, default=GPU_MEMORY_GIB,
                   help="memory of one GPU, for GPUs per target copy in the plan and the recipe rule")


def resolve_job_recipe(tag: str, recipe: str | None, target: str | None, gpu_memory_gib: float, shape=None):
    """The recipe in force, printed with why; a recipe or target that does not load is a clear error."""
    from eagle_core.recipe import RecipeError, resolve_recipe

    try:
        chosen = resolve_recipe(recipe, target, shape=shape, gpu_memory_gib=gpu_memory_gib)
    except (RecipeError, FileNotFoundError) as err:
        raise SystemExit(f"{tag}.py: {err}") from err
    print(f"[{tag}] recipe {chosen.summary()} ({chosen.why})", flush=True)
    return chosen


def target_shape(tag: str, target: str):
    """The target's shape from its config and a meta-device model (no weights), or a clear error."""
    from eagle_core.recipe import TargetShape

    try:
        return TargetShape.of(target)
    except Exception as err:  # noqa: BLE001 - whatever stops the target from loading is the answer here
        raise SystemExit(f"{tag}.py: target {target!r} does not load: {type(err).__name__}: {err}") from err


def build_parser() -> argparse.ArgumentParser:
    d = ExtractConfig()
    p = argparse.ArgumentParser(prog="extract.py", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--corpus", default=d.corpus, help="corpus URL (file, folder or glob; any fsspec protocol); "
                   "'sharegpt' = the embedded ShareGPT file")
    p.add_argument("--output", default=d.output, help="output URL for shards, regenerated conversations, manifest")
    p.add_argument("--target", default=d.target, help="target model: 'smollm2-135m', a .gguf file, an HF folder (path or URL) or a hub id")
    add_extraction_options(p, d)
    p.add_argument("--seed", type=int, default=d.seed, help="regeneration seed")
    p.add_argument("--num-workers", type=int, default=d.num_workers, help="actors per stage (one target each)")
    p.add_argument("--gpus-per-worker", type=float, default=d.gpus_per_worker,
                   help="GPUs per actor, i.e. per target copy (default: 1 when the cluster has GPUs, else 0; "
                        "more than 1: the copy is spread over them with device_map)")
    p.add_argument("--cpus-per-worker", type=float, default=d.cpus_per_worker, help="CPUs per actor")
    p.add_argument("--tokens-per-batch", type=int, default=d.tokens_per_batch,
                   help="padded tokens per target forward (rows are batched by similar length)")
    p.add_argument("--rows-per-shard", type=int, default=d.rows_per_shard, help="conversations per output shard")
    p.add_argument("--regen-batch-size", type=int, default=d.regen_batch_size, help="conversations per generate call")
    p.add_argument("--reuse-from", action="append", default=[], metavar="URL",
                   help="an earlier extraction output (same target and settings) whose committed shards are copied "
                        "instead of recomputed; repeatable")
    p.add_argument("--mlflow-experiment", default=d.mlflow_experiment, help="MLflow experiment ('' = no tracking)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an --output made by another target or other settings (refused otherwise, naming "
                        "the differing fields)")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, else a local cluster)")
    add_plan_options(p)
    defer_to_recipe(p, RECIPE_OPTIONS)
    return p


def main(argv=None) -> int:
    args = vars(build_parser().parse_args(argv))
    address, dry_run, gpu_memory_gib = args.pop("address"), args.pop("dry_run"), args.pop("gpu_memory_gib")
    args["mlflow_experiment"] = args["mlflow_experiment"] or None
    try:
        ExtractConfig(**{k: v for k, v in args.items() if k in ExtractConfig.__dataclass_fields__})
    except ValueError as err:  # an engine that cannot do what was asked: said before any work
        raise SystemExit(f"extract.py: {err}") from err
    shape = target_shape("extract", args["target"]) if dry_run else None
    recipe = resolve_job_recipe("extract", args.pop("recipe", None), args["target"], gpu_memory_gib, shape)
    fill_from_recipe(args, recipe, RECIPE_OPTIONS)
    if args["gpus_per_worker"] is None and recipe.gpus_per_target > 1:
        # a copy larger than one GPU; a single-GPU copy keeps None (1 where the cluster has GPUs, else 0)
        args["gpus_per_worker"] = float(recipe.gpus_per_target)
    if dry_run:
        from pipelines.preflight import plan_extract

        plan = plan_extract(target=args["target"], corpus=args["corpus"], recipe=recipe, shape=shape,
                            max_length=args["max_length"], limit=args["limit"], dtype=args["dtype"],
                            num_workers=args["num_workers"], gpus_per_worker=args["gpus_per_worker"],
                            gpu_memory_gib=gpu_memory_gib, engine=args["engine"],
                            tensor_parallel_size=args["tensor_parallel_size"],
                            pipeline_parallel_size=args["pipeline_parallel_size"])
        print("\n".join(plan.lines()), flush=True)
        return 0
    from pipelines.cluster import connect

    connect(address)
    manifest = run_extract(ExtractConfig(**args))
    keys = ["rows", "tokens", "loss_tokens", "bytes_per_token", "min_bytes_per_token", "quarantined_by_reason",
            "seconds", "mlflow_run_id"]
    data = manifest.to_json()
    print(json.dumps({k: data[k] for k in keys}, indent=1))
    print(f"[extract] features and manifest in {args['output']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
