"""Decoding benchmark on MT-bench (turn 1, chat template, greedy), batch 1, methods interleaved per prompt.

  python -m bench.decode                                   # defaults: 16 of the 80 questions, 128 tokens
  python -m bench.decode --num-prompts 80 --max-new-tokens 128   # the full set (hours on 2 CPU cores)

Methods: HF `generate` greedy; HF prompt-lookup decoding; our plain loop (same KV cache and forward code as
the speculative one, no draft); ours with a chain draft (top_k=1); ours with the EAGLE-2 dynamic tree whose
`total_tokens` is auto-tuned on this machine first (on MT-bench questions outside the measured ones).
Reports per method: tau (tokens per target forward, bonus counted), tokens/s, speed-up over HF greedy and
over our plain loop, achieved memory bandwidth (weights read per second, gpt-fast habit), and whether the
outputs equal HF greedy's token for token. Writes bench/results/decode.json and decode.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.common import SHIPPED_DRAFT, RESULTS, command, machine, user_turn, write_json, write_markdown
from eagle_core.autotune import autotune
from eagle_core.chat import prompt_ids
from eagle_core.checkpoint import load_draft
from eagle_core.generate import generate
from eagle_core.target import load_target
from eagle_core.tree import TreeConfig
from pipelines.data import load_mtbench_questions, spread_indices

METHODS = ("hf_greedy", "hf_prompt_lookup", "plain", "chain", "tree")


def describe_draft(folder: Path) -> str:
    """Where the draft came from: its model card's first line, or the summary.json of the training run that
    exported it."""
    card, trained = folder / "README.md", folder.parent / "summary.json"
    if card.is_file():
        return f"{folder} ({card.read_text().splitlines()[0].lstrip('# ')})"
    if trained.is_file():
        info = json.loads(trained.read_text())
        return (f"{folder} (jobs/train.py: {info['train_rows']} training conversations of "
                f"{info['lineage']['features']}, {info['step']} optimiser steps)")
    return str(folder)


def param_bytes(module) -> int:
    seen, total = set(), 0
    for p in module.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


class Runner:
    def __init__(self, model, draft, eos, chain: TreeConfig, tree: TreeConfig, lookup_tokens: int):
        self.model, self.draft, self.eos = model, draft, eos
        self.chain, self.tree, self.lookup_tokens = chain, tree, lookup_tokens

    def run(self, method: str, ids: list[int], max_new_tokens: int) -> dict:
        t0 = time.perf_counter()
        if method.startswith("hf_"):
            x = torch.tensor([ids])
            kw = dict(prompt_lookup_num_tokens=self.lookup_tokens) if method == "hf_prompt_lookup" else {}
            with torch.inference_mode():
                out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                          do_sample=False, eos_token_id=self.eos, pad_token_id=self.eos[0], **kw)
            tokens = out[0, len(ids):].tolist()
            seconds = time.perf_counter() - t0
            return dict(tokens=tokens, seconds=seconds, rounds=None, accepted=None, draft_s=None, verify_s=None)
        draft = None if method == "plain" else self.draft
        tree = {"plain": None, "chain": self.chain, "tree": self.tree}[method]
        res = generate(self.model, [ids], draft=draft, tree=tree, max_new_tokens=max_new_tokens, eos_token_id=self.eos)
        seconds = time.perf_counter() - t0
        s = res.stats[0]
        return dict(tokens=res.tokens[0], seconds=seconds, rounds=s.rounds, accepted=sum(s.accept_lengths),
                    draft_s=s.draft_s, verify_s=s.verify_s)


def tokens_per_s(runs: list[dict]) -> float:
    return sum(len(r["tokens"]) for r in runs) / sum(r["seconds"] for r in runs)


def speculative_tau(runs: list[dict]) -> float:
    """Tokens committed per round over runs of a draft method (accepted draft tokens + the bonus token)."""
    return 1.0 + sum(r["accepted"] for r in runs) / sum(r["rounds"] for r in runs)


def summarize(method: str, runs: list[dict], reference: list[dict], target_bytes: int, draft_step_bytes: int,
              depth: int) -> dict:
    tokens = sum(len(r["tokens"]) for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    out = dict(method=method, prompts=len(runs), new_tokens=tokens, seconds=round(seconds, 2),
               tokens_per_s=tokens_per_s(runs))
    identical = [r["tokens"] == ref["tokens"] for r, ref in zip(runs, reference)]
    out["identical_to_hf_greedy"] = f"{sum(identical)}/{len(runs)}"
    if runs[0]["rounds"] is not None:
        rounds = sum(r["rounds"] for r in runs)
        out["tau"] = speculative_tau(runs) if method != "plain" else 1.0
        out["target_forwards"] = rounds + len(runs)  # rounds + one prefill per prompt
        draft_steps = 0 if method == "plain" else (rounds * depth[method] + len(runs))
        out["draft_s"] = round(sum(r["draft_s"] for r in runs), 2)
        out["verify_s"] = round(sum(r["verify_s"] for r in runs), 2)
        moved = target_bytes * out["target_forwards"] + draft_step_bytes * draft_steps
        out["bandwidth_GBps"] = moved / seconds / 1e9
    elif method == "hf_greedy":
        out["tau"] = 1.0
        out["bandwidth_GBps"] = target_bytes * tokens / seconds / 1e9  # one forward per token (prefill = 1st)
    return out


def by_category(runs: dict[str, list[dict]], categories: list[str]) -> dict[str, dict[str, dict]]:
    """{category: {method: {tau, tokens_per_s, speedup_vs_hf_greedy}}} over the prompts of each category."""
    table = {}
    for category in dict.fromkeys(categories):
        picked = [i for i, c in enumerate(categories) if c == category]
        row = {}
        for method, method_runs in runs.items():
            chosen = [method_runs[i] for i in picked]
            entry = {"prompts": len(chosen), "tokens_per_s": tokens_per_s(chosen)}
            if chosen[0]["rounds"] is not None and method != "plain":
                entry["tau"] = speculative_tau(chosen)
            row[method] = entry
        if "hf_greedy" in row:
            for entry in row.values():
                entry["speedup_vs_hf_greedy"] = entry["tokens_per_s"] / row["hf_greedy"]["tokens_per_s"]
        table[category] = row
    return table


def category_markdown(table: dict[str, dict[str, dict]]) -> list[str]:
    methods = [m for m in ("chain", "tree") if m in next(iter(table.values()))]
    if not methods or "hf_greedy" not in next(iter(table.values())):
        return []
    lines = ["Per MT-bench category (speed-up over HF greedy on the same prompts):", "",
             "| category | prompts | " + " | ".join(f"tau {m} | speed-up {m}" for m in methods) + " |",
             "|---|---:|" + "---:|---:|" * len(methods)]
    for category, row in table.items():
        cells = " | ".join(f"{row[m]['tau']:.2f} | {row[m]['speedup_vs_hf_greedy']:.2f}x" for m in methods)
        lines.append(f"| {category} | {row[methods[0]]['prompts']} | {cells} |")
    return lines + [""]


def markdown(summary: list[dict], meta: dict, categories: dict[str, dict[str, dict]] | None = None) -> str:
    base = {s["method"]: s["tokens_per_s"] for s in summary}
    lines = [f"# Decoding benchmark: {meta['target']} on {meta['machine']}", "",
             f"`{meta['command']}`", "",
             f"{meta['prompts']} MT-bench questions (turn 1, chat template), greedy, max_new_tokens "
             f"{meta['max_new_tokens']}, batch 1, methods interleaved per prompt. Draft: {meta['draft']}. "
             f"Tree: {meta['tree']}{' (auto-tuned)' if meta['autotuned'] else ''}, chain: {meta['chain']}. "
             f"{meta['note']}.", "",
             "| method | tau | tokens/s | vs HF greedy | vs our plain loop | GB/s | identical to HF greedy |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        tau = f"{s['tau']:.2f}" if "tau" in s else "n/a"
        bw = f"{s['bandwidth_GBps']:.2f}" if "bandwidth_GBps" in s else "n/a"
        vs_hf = s["tokens_per_s"] / base["hf_greedy"] if "hf_greedy" in base else float("nan")
        vs_plain = s["tokens_per_s"] / base["plain"] if "plain" in base else float("nan")
        lines.append(f"| {s['method']} | {tau} | {s['tokens_per_s']:.2f} | {vs_hf:.2f}x | {vs_plain:.2f}x | {bw} | "
                     f"{s['identical_to_hf_greedy']} |")
    lines += ["", "tau = tokens committed per target forward (accepted draft tokens + the bonus token). GB/s = "
              "weights read per second (target weights per target forward + draft weights per draft step; "
              "n/a where HF does not expose its forward count).", ""]
    lines += category_markdown(categories) if categories else []
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", default=str(SHIPPED_DRAFT))
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--chain-depth", type=int, default=4)
    p.add_argument("--top-k", type=int, default=TreeConfig.top_k)
    p.add_argument("--depth", type=int, default=TreeConfig.depth)
    p.add_argument("--total-tokens", type=int, default=0, help="fixed tree size; 0 = auto-tune")
    p.add_argument("--autotune-prompts", type=int, default=3)
    p.add_argument("--autotune-tokens", type=int, default=48)
    p.add_argument("--lookup-tokens", type=int, default=10, help="HF prompt_lookup_num_tokens")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def load_models(draft_path: str):
    """(target, tokenizer, draft in eval mode, eos ids as a list)."""
    model, tokenizer = load_target("smollm2-135m")
    draft = load_draft(draft_path, target=model)
    draft.eval()
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [tokenizer.eos_token_id])
    return model, tokenizer, draft, eos


def pick_prompts(tokenizer, questions: list[dict], num_prompts: int, num_calib: int):
    """(chosen question indices, their prompts, calibration prompts from the other questions)."""
    chosen = spread_indices(num_prompts, len(questions))
    prompts = [prompt_ids(tokenizer, user_turn(questions[i]["turns"][0])) for i in chosen]
    others = [i for i in range(len(questions)) if i not in chosen] or list(range(len(questions)))
    calib = [prompt_ids(tokenizer, user_turn(questions[others[i]]["turns"][0]))
             for i in spread_indices(num_calib, len(others))]
    return chosen, prompts, calib


def choose_tree(args, model, draft, eos, prompts, calib):
    """(tree, autotune result or None): the fixed `--total-tokens` tree, else one auto-tuned on `calib`."""
    if args.total_tokens:
        return TreeConfig(args.top_k, args.depth, args.total_tokens), None
    print(f"[bench] auto-tuning total_tokens on {len(calib)} other MT-bench questions ...", flush=True)
    tuned = autotune(model, draft, calib, top_k=args.top_k, depth=args.depth,
                     max_new_tokens=args.autotune_tokens, eos_token_id=eos,
                     context_tokens=int(sum(map(len, prompts)) / len(prompts)) + args.max_new_tokens // 2)
    print(f"[bench] chose {tuned.tree}; expected tokens/s by size: "
          f"{ {k: round(v, 2) for k, v in tuned.expected_tokens_per_s.items()} }", flush=True)
    return tuned.tree, tuned


def measure(runner: Runner, methods: list[str], prompts: list[list[int]], max_new_tokens: int) -> dict[str, list]:
    """{method: [run per prompt]}, methods interleaved per prompt in rotating order (spreads machine drift)."""
    runs = {m: [] for m in methods}
    t_start = time.perf_counter()
    for i, ids in enumerate(prompts):
        order = methods[i % len(methods):] + methods[: i % len(methods)]
        for m in order:
            runs[m].append(runner.run(m, ids, max_new_tokens))
        line = " ".join(f"{m}={len(runs[m][-1]['tokens']) / runs[m][-1]['seconds']:.2f}" for m in methods)
        print(f"[bench] prompt {i + 1}/{len(prompts)} ({len(ids)} tokens) tok/s: {line} "
              f"[{time.perf_counter() - t_start:.0f}s]", flush=True)
    return runs


def draft_step_bytes(draft) -> int:
    """Weights one draft step reads: all but the embedding table (rows are gathered, not streamed)."""
    return sum(p.numel() * p.element_size() for n, p in draft.named_parameters() if not n.startswith("embed_tokens"))


def summaries(runs: dict[str, list], methods: list[str], target_bytes: int, dstep: int, depth: dict) -> list[dict]:
    """summarize() per method plus the speed-ups over HF greedy and over our plain loop (None when not run)."""
    reference = runs.get("hf_greedy") or runs[methods[0]]
    summary = [summarize(m, runs[m], reference, target_bytes, dstep, depth) for m in methods]
    base = {s["method"]: s["tokens_per_s"] for s in summary}
    for s in summary:
        s["speedup_vs_hf_greedy"] = s["tokens_per_s"] / base["hf_greedy"] if "hf_greedy" in base else None
        s["speedup_vs_plain"] = s["tokens_per_s"] / base["plain"] if "plain" in base else None
    return summary


def per_prompt(runs: dict[str, list]) -> dict[str, list[dict]]:
    """The runs without their tokens (new_tokens counts them instead)."""
    return {m: [{k: v for k, v in r.items() if k != "tokens"} | {"new_tokens": len(r["tokens"])} for r in rs]
            for m, rs in runs.items()}


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = [m for m in args.methods.split(",") if m]
    model, tokenizer, draft, eos = load_models(args.draft)
    questions = load_mtbench_questions()
    chosen, prompts, calib = pick_prompts(tokenizer, questions, args.num_prompts, args.autotune_prompts)
    tree, tuned = choose_tree(args, model, draft, eos, prompts, calib)
    chain = TreeConfig.chain(args.chain_depth)
    runner = Runner(model, draft, eos, chain, tree, args.lookup_tokens)
    for m in methods:  # warm-up: first-call costs stay out of the measurement
        runner.run(m, calib[0][:64], 4)
    t_start = time.perf_counter()
    runs = measure(runner, methods, prompts, args.max_new_tokens)
    wall = round(time.perf_counter() - t_start)
    target_bytes, dstep = param_bytes(model), draft_step_bytes(draft)
    summary = summaries(runs, methods, target_bytes, dstep, {"chain": chain.depth, "tree": tree.depth})
    meta = dict(target="SmolLM2-135M-Instruct (float32)", draft=describe_draft(Path(args.draft)),
                machine=machine(torch.get_num_threads()), command=command("decode", argv),
                prompts=len(prompts), question_ids=[questions[i]["question_id"] for i in chosen],
                max_new_tokens=args.max_new_tokens, tree=str(tree), chain=str(chain), autotuned=tuned is not None,
                target_weight_bytes=target_bytes, draft_step_bytes=dstep, wall_seconds=wall,
                note=f"Wall time {wall} s; timings on a shared machine are noisy, "
                     f"which is why methods are interleaved per prompt")
    categories = by_category(runs, [questions[i]["category"] for i in chosen])
    result = dict(meta=meta, summary=summary, by_category=categories, autotune=tuned.to_dict() if tuned else None,
                  per_prompt=per_prompt(runs))
    path = write_json(Path(args.out) / "decode.json", result)
    write_markdown(path, markdown(summary, meta, categories))


if __name__ == "__main__":
    main()
