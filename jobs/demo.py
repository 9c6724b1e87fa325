"""The whole pipeline on the embedded defaults, end to end, on a local Ray cluster and a local MLflow store:

    ingest a ShareGPT slice -> extract (the target regenerates the answers) -> train the EAGLE-3 draft on
    Ray Train -> serve target + draft on Ray Serve (127.0.0.1) -> chat requests over HTTP -> tau and the
    speed-up over plain decoding -> where the MLflow runs and artifacts are.

    python jobs/demo.py                 # ~15-20 min on 2 CPU cores
    python jobs/demo.py --rows 400 --train-epochs 4 --max-new-tokens 256   # a larger run, a flag away

Rerunning resumes: extracted shards and regenerated answers are reused, training continues from its
last checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEMO_QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Give me three tips for writing clean Python code.",
    "Explain what a hash table is to a beginner.",
]


def banner(step: str) -> None:
    print(f"\n=== {step} " + "=" * max(0, 70 - len(step)), flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="demo.py", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--corpus", default="sharegpt", help="corpus URL; 'sharegpt' = the embedded ShareGPT file")
    p.add_argument("--target", default="smollm2-135m", help="target model")
    p.add_argument("--rows", type=int, default=48, help="corpus rows to extract and train on")
    p.add_argument("--max-new-tokens", type=int, default=64, help="regeneration: tokens per regenerated reply")
    p.add_argument("--max-length", type=int, default=512, help="tokens per training conversation")
    p.add_argument("--train-epochs", type=int, default=3, help="training epochs over the extracted features")
    p.add_argument("--work", default=None, help="work folder (default: $EAGLE3_WORK or ./work)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the Serve app on 127.0.0.1")
    p.add_argument("--answer-tokens", type=int, default=64, help="max_tokens of the demo chat requests")
    p.add_argument("--address", default=None, help="Ray address (default: a local cluster)")
    return p


def extract_step(args, work: str) -> dict:
    from pipelines.extract import ExtractConfig, run_extract

    config = ExtractConfig(corpus=args.corpus, output=f"{work}/demo/features", target=args.target, limit=args.rows,
                           max_length=args.max_length, regenerate=True, max_new_tokens=args.max_new_tokens,
                           rows_per_shard=8, regen_batch_size=8, cpus_per_worker=1.0,
                           mlflow_experiment="eagle3-extract")
    manifest = run_extract(config)
    print(f"[demo] extracted {manifest['rows']} conversations, {manifest['tokens']} tokens "
          f"({manifest['loss_tokens']} loss tokens), {manifest['bytes_per_token']:.0f} bytes/token -> {config.output}")
    return manifest


def train_step(args, work: str) -> dict:
    import ray

    from pipelines.train import TrainJobConfig, run_train

    # The trainer's per-epoch dataset reads would draw progress bars over the training log.
    ray.data.DataContext.get_current().enable_progress_bars = False

    config = TrainJobConfig(features=f"{work}/demo/features", output=f"{work}/demo/train", target=args.target,
                            num_workers=1, epochs=args.train_epochs, lr=1e-3, tokens_per_batch=2048,
                            draft_vocab_size=8192, eval_fraction=0.1, checkpoint_every=50, resume=True,
                            mlflow_experiment="eagle3-train", registered_model_name="eagle3-draft")
    summary = run_train(config)
    print(f"[demo] trained {summary['step']} steps in {summary['seconds']:.0f}s; draft -> {summary['draft']}; "
          f"registered eagle3-draft version {summary.get('model_version')} (alias candidate)")
    return summary


def serve_step(args, draft_uri: str) -> list[dict]:
    import httpx
    from ray import serve

    from pipelines.serve.app import build_app

    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    app = build_app({"target": args.target, "draft": draft_uri, "num_cpus": 1.0})
    serve.run(app, name="eagle3-demo", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{args.port}"
    deadline = time.time() + 300
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise RuntimeError("the Serve app did not become healthy within 5 minutes")
        time.sleep(2)
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
            print(f"\n[user] {question}\n[assistant] {answers[-1]['answer']}\n  usage={answers[-1]['usage']} "
                  f"speculative={answers[-1]['speculative']}", flush=True)
    serve.shutdown()
    return answers


def speedup_step(args, draft_folder: str) -> dict:
    """tau and tokens/s of speculative vs plain greedy decoding on the demo questions, in this process."""
    from eagle_core.chat import prompt_ids
    from eagle_core.checkpoint import load_draft
    from eagle_core.generate import generate
    from eagle_core.target import load_target

    target, tokenizer = load_target(args.target)
    draft = load_draft(draft_folder, target=target)
    totals = {"spec": [0, 0.0], "plain": [0, 0.0]}
    committed, rounds = 0, 0
    for question in DEMO_QUESTIONS:
        ids = [prompt_ids(tokenizer, [{"role": "user", "content": question}])]
        for name, use in (("plain", None), ("spec", draft)):
            start = time.perf_counter()
            out = generate(target, ids, draft=use, max_new_tokens=args.answer_tokens,
                           eos_token_id=tokenizer.eos_token_id)
            totals[name][0] += out.stats[0].new_tokens
            totals[name][1] += time.perf_counter() - start
            if use is not None:
                committed += sum(out.stats[0].accept_lengths) + out.stats[0].rounds
                rounds += out.stats[0].rounds
    spec_tps, plain_tps = (totals[k][0] / totals[k][1] for k in ("spec", "plain"))
    return {"tau": committed / max(rounds, 1), "spec_tokens_per_s": spec_tps, "plain_tokens_per_s": plain_tps,
            "speedup": spec_tps / plain_tps}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.work:
        os.environ["EAGLE3_WORK"] = args.work
    from pipelines import tracking
    from pipelines.cluster import connect
    from pipelines.data import ingest

    work = str(tracking.work_dir())
    started = time.perf_counter()
    connect(args.address)

    banner(f"1/5 ingest: {args.rows} rows of {args.corpus}")
    stats = ingest(args.corpus, limit=args.rows).stats
    print(f"[demo] {stats.summary()}")

    banner("2/5 extract: regenerate answers with the target, capture aux + final hidden states")
    extract_step(args, work)

    banner("3/5 train: EAGLE-3 draft with training-time test on Ray Train")
    summary = train_step(args, work)

    banner("4/5 serve: target + draft on Ray Serve at 127.0.0.1, OpenAI-compatible chat")
    version = summary.get("model_version")
    draft_uri = f"models:/eagle3-draft/{version}" if version else summary["draft"]
    serve_step(args, draft_uri)

    banner("5/5 measure: speculative vs plain greedy decoding (same outputs, fewer target forwards)")
    result = speedup_step(args, summary["draft"])
    print(f"[demo] tau (tokens per target forward) = {result['tau']:.2f}; speculative "
          f"{result['spec_tokens_per_s']:.2f} tok/s vs plain {result['plain_tokens_per_s']:.2f} tok/s "
          f"-> speed-up {result['speedup']:.2f}x (a draft trained on {args.rows} conversations for a few minutes; "
          f"see the README for the headline draft)")

    print(f"\n[demo] done in {(time.perf_counter() - started) / 60:.1f} min.")
    print(f"[demo] MLflow runs, metrics, plots and the registered drafts: "
          f"mlflow ui --backend-store-uri {tracking.tracking_uri()}   (then open http://127.0.0.1:5000)")
    print(f"[demo] artifacts: {work}/mlartifacts   features: {work}/demo/features   draft: {summary['draft']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
