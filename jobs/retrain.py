"""Retrain the draft at growing data scales: extract what is new -> train -> evaluate -> promote.

    python jobs/retrain.py --scales 200,400 --limit-eval 8
    ray job submit --address http://127.0.0.1:8265 -- python $PWD/jobs/retrain.py --scales 0.25,0.5,1.0

Each scale is a corpus prefix (a row count, or a fraction <= 1 of the corpus); shards extracted for a
smaller scale are reused, a scale trained before is not trained again. The new draft version becomes the
registry's `champion` only if its greedy tau beats the champion's by --margin; otherwise `candidate`. The
decision is a compare-and-set under a lock held in the registry: a champion that moved since the evaluation is
evaluated again first. `--rollback` restores the champion that the current one replaced.

    python jobs/retrain.py --scales 1.0 --traffic s3://bucket/traffic --traffic-ratio 0.5

--traffic retrains from served traffic (a deployment's traffic sink output, pipelines/retrain/traffic.py): the
fraction --traffic-ratio of the training rows is drawn from it, the conversations below --traffic-eval-fraction by
id hash are never trained on and are decoded as a second evaluation set; the candidate becomes champion only if
its tau on that held-out traffic beats the champion's by --margin and its tau on --eval-prompts is no more than
--base-margin below the champion's; --eval-prompts must then be a fixed set with MT-bench prompts (all, mixed,
mtbench, mtbench-turn2), never sink data alone.

Where vLLM is installed, the evaluation also decodes its prompts with candidate and champion in vLLM (the
serving-engine gate, --serving-gate, pipelines/serving_gate.py): a candidate whose acceptance length there falls
below 0.9x our decoder's chain of the same depth, or whose export is not the draft as trained, stays `candidate`
whatever its tau, and the message names the likely cause.

The recipe in force (--recipe, else the target's: eagle_core/recipes/) fills the extraction's max length and aux
layers and the training's draft vocabulary, TTT steps, tokens per step and schedule wherever --extract / --train do
not set them; a warm-started candidate's lr is --warm-start-lr, a candidate from scratch takes the recipe's.
"""

from __future__ import annotations

import argparse
import json
import sys

from pipelines.cli import add_recipe_option, comma_separated
from pipelines.retrain import RetrainConfig, run_retrain
from pipelines.serving_gate import GATE_MODES


parse_scales = comma_separated(float, "numbers", lambda scales: None if scales and all(x > 0 for x in scales)
                               else "scales must be positive (fractions <= 1 or row counts)")


def parse_overrides(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    d = RetrainConfig()
    p = argparse.ArgumentParser(prog="retrain.py", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--corpus", default=d.corpus, help="corpus URL; 'sharegpt' = the embedded ShareGPT file")
    p.add_argument("--scales", type=parse_scales, default=d.scales,
                   help="comma-separated data scales: fractions <= 1 of the corpus, or row counts")
    p.add_argument("--corpus-rows", type=int, default=d.corpus_rows, help="rows a fraction refers to (default: all)")
    p.add_argument("--work", default=d.work, help="URL for the features and drafts of every scale")
    p.add_argument("--target", default=d.target, help="target model: 'smollm2-135m', a .gguf file, an HF folder (path or URL) or a hub id")
    p.add_argument("--registered-model", default=d.registered_model, help="MLflow registered model of the drafts")
    p.add_argument("--eval-prompts", default=d.eval_prompts, help="a prompt set (all = MT-bench turns 1 and 2, HumanEval, long contexts; "
                   "pipelines/prompt_sets.py) or a JSONL file of {prompt|messages}")
    p.add_argument("--eval-count", type=int, default=d.eval_count, help="held-out prompts decoded per evaluation")
    p.add_argument("--eval-max-new-tokens", type=int, default=d.eval_max_new_tokens, help="tokens per evaluation prompt")
    p.add_argument("--eval-cpus", type=float, default=d.eval_cpus, help="CPUs of the evaluation task")
    p.add_argument("--eval-gpus", type=float, default=d.eval_gpus,
                   help="GPUs of the evaluation task (default: 1 when the cluster has GPUs)")
    p.add_argument("--margin", type=float, default=d.margin,
                   help="tau gain over the champion needed for promotion (on held-out traffic, with --traffic)")
    p.add_argument("--traffic", default=None, help="URL of a traffic sink's output to mix into training and "
                   "evaluate on (its manifest's fingerprint must be --target's)")
    p.add_argument("--traffic-ratio", type=float, default=d.traffic_ratio,
                   help="with --traffic: the fraction of each epoch's training rows drawn from traffic")
    p.add_argument("--traffic-eval-fraction", type=float, default=d.traffic_eval_fraction,
                   help="with --traffic: the conversations (by id hash) never trained on; --eval-count of them are "
                        "decoded as the traffic evaluation")
    p.add_argument("--base-margin", type=float, default=d.base_margin,
                   help="with --traffic: the most the tau on --eval-prompts may fall for a promotion")
    p.add_argument("--lock-ttl-s", type=float, default=d.lock_ttl_s,
                   help="the promotion lock lapses this long after its holder's last progress (must exceed the "
                        "evaluation's longest silent phase, the target's load)")
    p.add_argument("--lock-wait-s", type=float, default=d.lock_wait_s,
                   help="how long to wait for another driver's promotion decision before giving up")
    p.add_argument("--eval-timeout-s", type=float, default=d.eval_timeout_s,
                   help="the champion's re-evaluation under the promotion lock is cancelled after this long "
                        "(the decision then fails, nothing changed)")
    p.add_argument("--serving-gate", choices=GATE_MODES, default=d.serving_gate,
                   help="the serving-engine gate: decode the evaluation's prompts with each draft in vLLM too; a "
                   "candidate whose acceptance length there is below 0.9x our decoder's chain of the same depth, "
                   "or whose export differs from its checkpoint, is never promoted. auto: where vLLM is installed "
                   "and loads the target (else a loud warning that it was skipped); vllm: measure or fail; off")
    p.add_argument("--serving-gate-k", type=int, default=d.serving_gate_k, metavar="K",
                   help="the depth the gate measures at (default: each draft's TTT depth; a candidate's is the "
                   "recipe's ttt_steps)")
    p.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=d.warm_start,
                   help="initialise from the current champion when compatible (else from scratch)")
    p.add_argument("--warm-start-lr", type=float, default=d.warm_start_lr,
                   help="learning rate of a warm-started candidate, unless --train sets lr")
    p.add_argument("--extract", type=parse_overrides, default=d.extract,
                   help='ExtractConfig overrides as JSON, e.g. \'{"max_new_tokens": 256, "num_workers": 4}\'')
    p.add_argument("--train", type=parse_overrides, default=d.train,
                   help='TrainJobConfig overrides as JSON, e.g. \'{"epochs": 3, "num_workers": 2}\'')
    p.add_argument("--mlflow-experiment", default=d.mlflow_experiment, help="MLflow experiment of the parent run")
    p.add_argument("--results", default=None, metavar="PATH",
                   help="also write the per-scale results (rows, tau, speed-up, version, promoted) to this JSON file")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, else a local cluster)")
    p.add_argument("--rollback", action="store_true",
                   help="only point --registered-model's champion back at the version the current champion "
                        "replaced (recorded at promotion), under the promotion lock; no training")
    add_recipe_option(p)
    return p


def apply_recipe(args: dict, recipe) -> dict:
    """`args` with the recipe's values in its --extract / --train overrides wherever those do not set them."""
    values = recipe.training_values()
    extract, train = dict(args["extract"]), dict(args["train"])
    extract.setdefault("max_length", values["max_length"])
    if values["aux_layer_ids"]:
        extract.setdefault("aux_layer_ids", values["aux_layer_ids"])
    if values["gpus_per_target"] > 1:
        extract.setdefault("gpus_per_worker", float(values["gpus_per_target"]))
    for key in ("draft_vocab_size", "ttt_steps", "tokens_per_batch", "warmup_ratio", "min_lr_ratio"):
        train.setdefault(key, values[key])
    if not args["warm_start"]:  # a warm-started candidate takes --warm-start-lr unless --train sets lr
        train.setdefault("lr", values["lr"])
    return {**args, "extract": extract, "train": train}


def main(argv=None) -> int:
    args = vars(build_parser().parse_args(argv))
    address, results = args.pop("address"), args.pop("results")
    if args.pop("rollback"):
        from pipelines.registry import rollback

        old, new = rollback(args["registered_model"])
        print(f"[retrain] {args['registered_model']}@champion rolled back from version {old} to version {new}")
        return 0
    from eagle_core.recipe import RecipeError, resolve_recipe

    try:
        recipe = resolve_recipe(args.pop("recipe", None), args["target"])
    except (RecipeError, FileNotFoundError) as err:
        raise SystemExit(f"retrain.py: {err}") from err
    print(f"[retrain] recipe {recipe.summary()} ({recipe.why})", flush=True)
    args = apply_recipe(args, recipe)
    from pipelines.cluster import connect

    connect(address)
    config = RetrainConfig(**args)
    result = run_retrain(config)
    print(json.dumps(result, indent=1))
    if results:
        from pipelines.storage import commit_json

        commit_json(results, {"command": "python jobs/retrain.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                              "config": config.to_dict(), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
