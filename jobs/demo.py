"""The whole pipeline on the embedded defaults, as a retraining round, on a local Ray cluster and MLflow store:

    ingest a ShareGPT slice -> the shipped draft becomes the registry's first champion -> extract fresh data
    (the target regenerates the answers) -> train a candidate warm-started from the champion on Ray Train ->
    evaluate both by real decoding on the same prompts, promote the candidate only if it is better -> serve
    the champion on Ray Serve (127.0.0.1), chat over HTTP -> tau and the speed-up over plain decoding.

    python -m jobs.demo                 # about 10 min on 2 CPU cores
    python -m jobs.demo --rows 400 --train-epochs 4 --max-new-tokens 256   # a larger run, a flag away

The terminal shows the stages, progress and results; the full log (Ray, MLflow, workers) goes to
<work>/demo/demo.log. Rerunning resumes: extracted shards and regenerated answers are reused, a trained
candidate is not trained again.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from eagle_core.tree import TreeConfig
from pipelines.cli import add_recipe_option
from pipelines.console import quiet_terminal, say

DEMO_QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Give me three tips for writing clean Python code.",
    "Explain what a hash table is to a beginner.",
]
REGISTERED_MODEL = "eagle3-draft"


def banner(step: str) -> None:
    say(f"\n=== {step} " + "=" * max(0, 70 - len(step)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.demo", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--corpus", default="sharegpt", help="corpus URL; 'sharegpt' = the embedded ShareGPT file")
    p.add_argument("--target", default="smollm2-135m", help="target model")
    p.add_argument("--rows", type=int, default=40, help="corpus rows to extract and train the candidate on")
    p.add_argument("--max-new-tokens", type=int, default=64, help="regeneration: tokens per regenerated reply")
    p.add_argument("--max-length", type=int, default=512, help="tokens per training conversation")
    p.add_argument("--train-epochs", type=int, default=2, help="training epochs over the extracted features")
    p.add_argument("--eval-count", type=int, default=6,
                   help="prompts decoded to compare the drafts, spread over MT-bench turns 1 and 2, HumanEval and "
                   "long contexts (tree, auto and plain lead on a third each)")
    p.add_argument("--work", default=None, help="work folder (default: $EAGLE3_WORK or ./work)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the Serve app on 127.0.0.1")
    p.add_argument("--answer-tokens", type=int, default=64, help="max_tokens of the demo chat requests")
    p.add_argument("--address", default=None, help="Ray address (default: a local cluster)")
    add_recipe_option(p)
    return p


def champion_step(args) -> None:
    from eagle_core.shipped import shipped_draft
    from pipelines.retrain import CHAMPION, PromotionConflict, alias_version, register_draft_folder

    champion = alias_version(REGISTERED_MODEL, CHAMPION)
    if champion is not None:
        say(f"[demo] {REGISTERED_MODEL} already has a champion (version {champion.version}); keeping it")
        return
    folder = shipped_draft(args.target)
    try:  # a compare-and-set: a champion set meanwhile by another process stays
        version = register_draft_folder(str(folder), REGISTERED_MODEL, CHAMPION, run_name="shipped-draft",
                                        expected_champion=None)
    except PromotionConflict as conflict:
        say(f"[demo] {conflict}; keeping that champion")
        return
    say(f"[demo] registered the shipped draft {folder.name} as {REGISTERED_MODEL} version {version} @champion")


def machine_sizes(rows: int) -> dict:
    """How the demo spreads over the machine. torch runs as many threads as whole CPUs Ray gives the task or
    actor, so each stage asks for what it can use (measured in docs/DESIGN.md §4.2): extraction runs one
    single-threaded target copy per core (per GPU where the cluster has GPUs; at least 8 rows each), two shards
    per copy while shards stay within 16 rows, a shard's conversations regenerated as one batch; evaluation and
    serving hold every core of one node (of one GPU node where there are GPUs), training all but one CPU of it,
    which its data readers need."""
    import ray

    from pipelines.cluster import local_cores

    gpus = int(ray.cluster_resources().get("GPU", 0))
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"] and (not gpus or n["Resources"].get("GPU", 0) >= 1)]
    node_cpus = int(max((r.get("CPU", 0) for r in nodes), default=1))
    cores = max(1, min(local_cores(), node_cpus))
    workers = max(1, min(gpus or cores, rows // 8))
    rows_per_shard = max(1, min(16, -(-rows // (2 * workers))))
    return {"cores": float(cores), "train_cpus": float(max(1, min(cores, node_cpus - 1))),
            "extract_workers": workers, "rows_per_shard": rows_per_shard}


def recipe_overrides(recipe) -> tuple[dict, dict]:
    """The recipe's values for the demo's extraction and training. The candidate's lr is retraining's warm-start lr
    (it starts from the champion); max length is the demo's own --max-length (short conversations, a fast demo)."""
    values = recipe.training_values()
    train = {k: values[k] for k in ("draft_vocab_size", "ttt_steps", "tokens_per_batch", "warmup_ratio",
                                    "min_lr_ratio")}
    extract = {"aux_layer_ids": values["aux_layer_ids"]} if values["aux_layer_ids"] else {}
    return extract, train


def retrain_step(args, work: str, sizes: dict, recipe) -> dict:
    import ray

    from pipelines.retrain import RetrainConfig, run_retrain

    ray.data.DataContext.get_current().enable_progress_bars = False  # progress goes to the log, stages here
    extract, train = recipe_overrides(recipe)
    config = RetrainConfig(
        corpus=args.corpus, scales=[args.rows], work=f"{work}/demo", target=args.target,
        registered_model=REGISTERED_MODEL, eval_count=args.eval_count, eval_max_new_tokens=args.answer_tokens,
        eval_cpus=sizes["cores"],
        extract={"max_length": args.max_length, "regenerate": True, "max_new_tokens": args.max_new_tokens,
                 "num_workers": sizes["extract_workers"], "cpus_per_worker": 1.0,
                 "rows_per_shard": sizes["rows_per_shard"], "regen_batch_size": sizes["rows_per_shard"],
                 "mlflow_experiment": "eagle3-extract", **extract},
        train={**train, "epochs": args.train_epochs, "eval_fraction": 0.1, "cpus_per_worker": sizes["train_cpus"],
               "mlflow_experiment": "eagle3-train"})
    result = run_retrain(config)["scales"][0]
    verdict = "promoted to champion" if result["promoted"] else "kept as candidate (not better)"
    say(f"[demo] candidate version {result['version']}: tau {result['tau']:.2f} vs champion "
        f"{'-' if result['champion_tau'] is None else format(result['champion_tau'], '.2f')} -> {verdict}")
    return result


def serve_step(args, draft_uri: str, sizes: dict, tree: dict) -> list[dict]:
    """Serve the draft with `tree` (the one the evaluation auto-tuned for it on this machine: the default
    6-level tree costs two plain steps a round on a CPU, where the auto policy rightly decodes plainly)."""
    import httpx
    from ray import serve

    from pipelines.serve.app import build_app, run_local

    app = build_app({"target": args.target, "draft": draft_uri, "num_cpus": sizes["cores"], **tree})
    base = run_local(app, "eagle3-demo", args.port)
    answers = []
    with httpx.Client(base_url=base, timeout=600) as client:
        for question in DEMO_QUESTIONS:
            response = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": question}], "max_tokens": args.answer_tokens,
                "temperature": 0})
            response.raise_for_status()
            body = response.json()
            answers.append({"question": question, "answer": body["choices"][0]["message"]["content"],
                            "usage": body.get("usage"), "speculative": body.get("speculative")})
            spec = body.get("speculative") or {}
            say(f"\n[user] {question}\n[assistant] {answers[-1]['answer']}\n  {body['usage']['completion_tokens']} "
                f"tokens in {spec.get('rounds', '?')} target forwards (tau {spec.get('tau', 0):.2f})")
    serve.shutdown()
    return answers


def champion_evaluation(result: dict) -> dict:
    """tau, speed-ups and auto-tuned tree of the draft that is champion after the round (the one served)."""
    promoted = result["promoted"] or result["champion_tau"] is None
    keys = ("tau", "speedup", "tree_speedup", "tuned_tree")
    return {key: result[key] if promoted else result[f"champion_{key}"] for key in keys}


def result_line(result: dict) -> str:
    """The champion's tau and speed-ups, as measured by the evaluation, said as what they are."""
    champion = champion_evaluation(result)
    shown = round(champion["speedup"], 2)  # the verdict agrees with the number printed: 0.996 is "1.00x"
    kind = "faster than" if shown > 1.0 else "slower than" if shown < 1.0 else "as fast as"
    tree = TreeConfig(**champion["tuned_tree"])
    return (f"[demo] champion: tau {champion['tau']:.2f} tokens per target forward; with the auto policy (trees "
            f"where they pay, plain otherwise) decoding is {shown:.2f}x plain greedy on this machine ({kind} "
            f"plain; the tree auto-tuned here, top-k {tree.top_k}, depth {tree.depth}, {tree.total_tokens} nodes, "
            f"on every round: {champion['tree_speedup']:.2f}x), same output tokens")


def run(args, work: str) -> None:
    from pipelines import tracking
    from pipelines.cluster import connect
    from pipelines.data import ingest

    from eagle_core.recipe import resolve_recipe

    started = time.perf_counter()
    recipe = resolve_recipe(getattr(args, "recipe", None), args.target)
    say(f"[demo] recipe {recipe.summary()} ({recipe.why})")
    connect(args.address)

    banner(f"1/5 ingest: {args.rows} rows of {args.corpus}")
    say(f"[demo] {ingest(args.corpus, limit=args.rows).stats.summary()}")

    banner("2/5 champion: the draft shipped with the project starts the registry")
    champion_step(args)

    banner("3/5 retrain: extract fresh data, train a candidate from the champion, evaluate both, promote")
    sizes = machine_sizes(args.rows)
    say(f"[demo] {sizes['cores']:.0f} cores: {sizes['extract_workers']} extraction actor(s) of one thread each, "
        f"{sizes['rows_per_shard']} rows per shard; training on {sizes['train_cpus']:.0f} threads, evaluation and "
        f"serving on {sizes['cores']:.0f}")
    result = retrain_step(args, work, sizes, recipe)

    banner("4/5 serve: target + champion draft on Ray Serve at 127.0.0.1, OpenAI-compatible chat")
    serve_step(args, f"models:/{REGISTERED_MODEL}@champion", sizes, champion_evaluation(result)["tuned_tree"])

    banner("5/5 result")
    say(result_line(result))
    say(f"[demo] done in {(time.perf_counter() - started) / 60:.1f} min.")
    mlflow = tracking.configure()
    locations = sorted({e.artifact_location for e in mlflow.search_experiments() if e.name.startswith("eagle3")})
    say(f"[demo] MLflow runs, metrics, plots and the registered drafts: mlflow ui --backend-store-uri "
        f"{tracking.tracking_uri()}   (then open http://127.0.0.1:5000)")
    say(f"[demo] artifacts: {', '.join(locations)}")
    say(f"[demo] features: {work}/demo/features   drafts: {work}/demo/drafts")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.work:
        os.environ["EAGLE3_WORK"] = args.work
    from pipelines import tracking

    work = str(tracking.work_dir())
    log = os.path.join(work, "demo", "demo.log")
    with quiet_terminal(log):
        say(f"[demo] full log: {log}")
        try:
            run(args, work)
        except BaseException as error:
            with open(log) as f:
                tail = f.readlines()[-40:]
            say("".join(tail).rstrip())
            say(f"[demo] failed: {type(error).__name__}: {error}\n[demo] full log: {log}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
