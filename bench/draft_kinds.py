"""Draft kinds side by side: drafts of one target (EAGLE-3, EAGLE 3.1, P-EAGLE, ... trained at one budget), each in
our decoder (a chain of depth K and a fixed tree) and in vLLM's CPU build with K draft tokens per step, on the same
prompts, every method interleaved per prompt (bench.decode's `measure`), batch 1, greedy.

  python -m bench.draft_kinds --drafts eagle3=DIR,eagle3.1=DIR,p-eagle=DIR --out bench/results/draft-kinds

Reports per draft and method: tau (tokens per target forward), tokens/s, outputs identical to transformers' greedy,
acceptance per draft position; per draft, vLLM's acceptance length beside our chain's at the same depth (the
export's check: the same draft, the same greedy target, two engines). Writes draft_kinds.json and draft_kinds.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.common import command, machine, write_json, write_markdown
from bench.decode import Runner, describe_draft, draft_step_bytes, measure, param_bytes, summarize
from bench.vllm_runner import VLLM_EAGLE3, VllmRunner
from eagle_core.chat import prompt_ids
from eagle_core.checkpoint import load_draft
from eagle_core.target import SMOLLM2_NAME, load_target, materialize_hf_folder, resolve_dtype
from eagle_core.tree import TreeConfig
from pipelines.prompt_sets import prompt_set, target_answerer

RESULTS = Path(__file__).resolve().parent / "results" / "draft-kinds"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--drafts", required=True, help="comma-separated NAME=FOLDER (save_draft layout)")
    p.add_argument("--target", default=SMOLLM2_NAME, help="the target the drafts were trained for")
    p.add_argument("--prompts", default="mtbench", help="prompt set (pipelines/prompt_sets.py)")
    p.add_argument("--num-prompts", type=int, default=16, help="measured prompts")
    p.add_argument("--max-new-tokens", type=int, default=96, help="new tokens per prompt")
    p.add_argument("--dtype", default="float32", help="the target's and the drafts' dtype")
    p.add_argument("--depth", type=int, default=3, help="K: our chain's depth and vLLM's draft tokens per step")
    p.add_argument("--tree", default="8,2,16", help="the fixed tree of the tree method: top-k,depth,nodes")
    p.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True, help="vLLM's rows")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    p.add_argument("--out", default=str(RESULTS), help="folder of draft_kinds.json and draft_kinds.md")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    drafts = dict(item.split("=", 1) for item in args.drafts.split(",") if item)
    dtype = resolve_dtype(args.dtype, "cpu")
    model, tokenizer = load_target(args.target, device="cpu", dtype=dtype)
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [tokenizer.eos_token_id])
    items, calib_items = prompt_set(args.prompts, tokenizer, args.num_prompts, 1,
                                    answer=target_answerer(model, tokenizer, args.max_new_tokens))
    prompts = [prompt_ids(tokenizer, item["messages"]) for item in items]
    warm = prompt_ids(tokenizer, calib_items[0]["messages"])[:64]
    chain, tree = TreeConfig.chain(args.depth), TreeConfig(*[int(x) for x in args.tree.split(",")])
    vllm_method = f"{VLLM_EAGLE3}{args.depth}"
    runners, variants = {}, {}
    try:
        for name, folder in drafts.items():
            draft = load_draft(folder, target=model).eval()
            runner = runners[name] = Runner(model, draft, eos, chain, tree, lookup_tokens=10)
            methods = ["chain", "tree"]
            if args.vllm:
                runner.vllm = VllmRunner(str(materialize_hf_folder(args.target)), folder, dtype, [vllm_method])
                methods.append(vllm_method)
            if not variants:  # the references, once: transformers' greedy and our plain loop
                methods = ["hf_greedy", "plain"] + methods
            for m in methods:
                runner.warm_up(m, warm)
                variants[f"{m} {name}"] = (runner, m)
        t_start = time.perf_counter()
        runs = measure(variants, prompts, args.max_new_tokens)
    finally:  # vLLM's engines end with the run, whatever happens
        for runner in runners.values():
            if runner.vllm is not None:
                runner.vllm.close()
    wall = round(time.perf_counter() - t_start)
    reference = runs[f"hf_greedy {next(iter(drafts))}"]
    summary = []
    for label, (runner, method) in variants.items():
        depth = {"chain": chain.depth, "tree": tree.depth, vllm_method: args.depth}.get(method, 0)
        row = summarize(label, runs[label], reference, param_bytes(model), draft_step_bytes(runner.draft), depth)
        row["draft"] = label.split()[1]
        summary.append(row)
    gaps = {}
    for name in drafts:
        ours = next(s for s in summary if s["method"] == f"chain {name}")["tau"]
        theirs = next((s["tau"] for s in summary if s["method"] == f"{vllm_method} {name}"), None)
        gaps[name] = None if theirs is None else {"ours": ours, "vllm": theirs, "difference": theirs - ours}
    meta = dict(target=args.target, dtype=args.dtype, drafts={n: describe_draft(Path(f)) for n, f in drafts.items()},
                machine=machine(torch.get_num_threads()), command=command("draft_kinds", argv),
                date=time.strftime("%Y-%m-%d %H:%M %Z"), prompt_set=args.prompts, prompts=len(prompts),
                max_new_tokens=args.max_new_tokens, chain=str(chain), tree=str(tree), wall_seconds=wall)
    path = write_json(Path(args.out) / "draft_kinds.json", dict(meta=meta, summary=summary, vllm_vs_ours=gaps))
    write_markdown(path, markdown(meta, summary, gaps, args.depth))


def markdown(meta: dict, summary: list[dict], gaps: dict, depth: int) -> str:
    lines = [f"# Draft kinds side by side ({meta['date']})", "",
             f"- command: `{meta['command']}`", f"- machine: {meta['machine']}",
             f"- target {meta['target']} in {meta['dtype']}; {meta['prompts']} {meta['prompt_set']} prompts x "
             f"{meta['max_new_tokens']} tokens, batch 1, greedy; chain {meta['chain']}; tree {meta['tree']}; "
             f"methods interleaved per prompt, wall {meta['wall_seconds']} s", ""]
    lines += [f"- draft `{n}`: {d}" for n, d in meta["drafts"].items()]
    lines += ["", "| method | draft | tokens/s | tau | acceptance per position | identical to HF greedy |",
              "|---|---|---:|---:|---|---:|"]
    for s in summary:
        per = ", ".join(f"{a:.3f}" for a in s.get("acceptance_per_position", []))
        lines.append(f"| {s['method'].split()[0]} | {s['draft']} | {s['tokens_per_s']:.2f} | "
                     f"{s.get('tau', float('nan')):.3f} | {per} | {s['identical_to_hf_greedy']} |")
    lines += ["", f"Acceptance length at depth {depth}, the same draft in two engines (vLLM's per-request counts; "
              "ours: the chain's tau):", "", "| draft | ours | vLLM | vLLM - ours |", "|---|---:|---:|---:|"]
    for name, g in gaps.items():
        if g is not None:
            lines.append(f"| {name} | {g['ours']:.3f} | {g['vllm']:.3f} | {g['difference']:+.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
