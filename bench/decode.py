"""Decoding benchmark on a named prompt set (chat template, greedy), batch 1, methods interleaved per prompt.

  python -m bench.decode                                   # defaults: 16 of MT-bench's 80 questions, 96 tokens
  python -m bench.decode --dtypes float32 --methods hf_greedy,plain,tree   # a subset
  python -m bench.decode --target gemma3-270m --prompts mixed   # another target; long contexts too

Methods, in each dtype of `--dtypes` (default: float32, plus bfloat16 where the CPU has native bf16): HF
`generate` greedy; HF prompt-lookup decoding; our plain loop (same KV cache and forward code as the
speculative one, no draft); ours with a chain draft (top_k=1); ours with the EAGLE-2 dynamic tree whose
size is auto-tuned on this machine and dtype first (on calibration prompts outside the measured ones), with
the lm_head on every node or on the accepted path as the auto-tune chose, and the same tree with the other
choice ("tree_other_head": what the choice buys); the same tree with the context chain (prompt lookup grafted
beside it, mode "context"; "tree_context": the auto-tuned chain length, else --lookup-tokens); ours with the auto policy (`generate(mode="auto")`: per
round the measured-fastest of tree, chain and plain).
Reports per method: tau (tokens per target forward, bonus counted), tokens/s, speed-up over HF greedy
float32 (what transformers gives by default) and over our plain loop of the same dtype, achieved memory
bandwidth (weights read per second, gpt-fast habit), outputs identical to HF greedy of the same dtype and
the token agreement with it (matching prefix / length); then the cost table: our verify forward at 1-32
tokens beside the bare transformers forward, our plain step, a draft level, our round overhead.
Writes bench/results/decode.json and decode.md.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.common import RESULTS, command, machine, shown_path, write_json, write_markdown
from bench.decode_report import COST_WIDTHS, markdown
from bench.vllm_runner import VLLM_EAGLE3, VLLM_PLAIN, VllmRunner, is_vllm, vllm_methods
from pipelines.prompt_sets import PROMPT_SETS, prompt_set, target_answerer
from eagle_core.autotune import autotune, draft_cases, target_forward_cases, timed
from eagle_core.chat import prompt_ids
from eagle_core.checkpoint import load_draft
from eagle_core.decoding import available_modes, plain_step, prefill
from eagle_core.generate import generate
from eagle_core.kv import TargetKV
from eagle_core.policy import ModeChooser
from eagle_core import packed_linear
from eagle_core.shipped import shipped_draft
from eagle_core.static_rows import StaticConfig, inductor
from eagle_core.target import (NAMED_TARGETS, SMOLLM2_NAME, cpu_has_native_bf16, load_target, materialize_hf_folder,
                               resolve_dtype)
from eagle_core.tree import TreeConfig
from eagle_core.verify import SamplingConfig

METHODS = ("hf_greedy", "hf_prompt_lookup", "plain", "chain", "tree", "tree_other_head", "tree_context", "auto",
           "plain_static", "auto_static", "plain_unpacked", "auto_unpacked", "plain_torchpacks", "auto_torchpacks",
           "plain_unfused", "auto_unfused", "plain_unlayered", "auto_unlayered",
           "vllm")  # "vllm": vLLM plain and vLLM + the draft at each --vllm-k (bench/vllm_runner.py)
# "<method>_static": the method on the static caches with compiled steps (`eagle_core.static_rows.inductor`: one
# graph per step, row bucket and verify width; compiled in the warm-up, or loaded from torch's persistent cache).
# "<method>_unpacked": the method with the plain CPU linear (`eagle_core.packed_linear.DECODE_DTYPES` empty);
# "<method>_torchpacks": on torch's packs, not vLLM's kernels (`packed_linear.USE_VLLM_KERNELS` off);
# "<method>_unfused": sibling linears packed and run one by one, transformers' RMSNorm and decoder layers
# (`packed_linear.FUSE_SIBLINGS`, `FUSED_NORMS`, `FUSED_LAYERS` off); "<method>_unlayered": transformers' decoder
# layers on the fused packs and norms (`FUSED_LAYERS` off: what `eagle_core.llama_layer` buys).
VARIANTS = {"_unpacked": {"DECODE_DTYPES": set()}, "_torchpacks": {"USE_VLLM_KERNELS": False},
            "_unfused": {"FUSE_SIBLINGS": False, "FUSED_NORMS": False, "FUSED_LAYERS": False},
            "_unlayered": {"FUSED_LAYERS": False}}
STATIC_CAPACITY = 2048
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16"}
COST_CONTEXT = 300  # cache length of the cost table (tokens)


def describe_draft(folder: Path) -> str:
    """Where the draft came from: its model card's first line, or the summary.json of the training run that
    exported it."""
    card, trained = folder / "README.md", folder.parent / "summary.json"
    if card.is_file():
        return f"{shown_path(folder)} ({card.read_text().splitlines()[0].lstrip('# ')})"
    if trained.is_file():
        info = json.loads(trained.read_text())
        return (f"{shown_path(folder)} (jobs/train.py: {info['train_rows']} training conversations of "
                f"{info['lineage']['features']}, {info['step']} optimiser steps)")
    return shown_path(folder)


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
        # the auto policy keeps what it measured across prompts, as a server does; the context mode where the tree has
        # a chain
        self.choosers = {}  # method -> its ModeChooser (each variant of auto measures its own steps' costs)
        self.tuned = None  # the auto-tune's result, which every chooser starts from
        self.vllm = None  # bench.vllm_runner.VllmRunner of this dtype, for the vllm_* methods
        self.static = StaticConfig(capacity=STATIC_CAPACITY, compile=inductor())

    def warm_up(self, method: str, ids: list[int]) -> None:
        """First-call costs out of the measurement: a static method compiles every step a round may take here."""
        self.run(method, ids, 4)
        if method.endswith("_static") and self.draft is not None:
            for mode, tree in (("tree", self.tree), ("tree", self.chain), ("context", self.tree)):
                if mode in available_modes(tree):
                    generate(self.model, [ids], draft=self.draft, tree=tree, mode=mode, max_new_tokens=8,
                             eos_token_id=self.eos, static=self.static)

    def run(self, method: str, ids: list[int], max_new_tokens: int) -> dict:
        if is_vllm(method):
            return self.vllm.run(method, ids, max_new_tokens, self.eos)
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
        for suffix, settings in VARIANTS.items():
            if method.endswith(suffix):
                saved = {name: getattr(packed_linear, name) for name in settings}
                for name, value in settings.items():
                    setattr(packed_linear, name, value)
                try:
                    return self._run(method, method.removesuffix(suffix), ids, max_new_tokens)
                finally:
                    for name, value in saved.items():
                        setattr(packed_linear, name, value)
        return self._run(method, method, ids, max_new_tokens)

    def chooser(self, method: str) -> ModeChooser:
        if method not in self.choosers:
            self.choosers[method] = ModeChooser(available_modes(self.tree))
            if self.tuned is not None:  # the auto policy starts from what the auto-tune measured
                self.tuned.prime(self.choosers[method])
        return self.choosers[method]

    def _run(self, name: str, method: str, ids: list[int], max_new_tokens: int) -> dict:
        t0 = time.perf_counter()
        static = None
        if method.endswith("_static"):
            method, static = method.removesuffix("_static"), self.static
        draft = None if method == "plain" else self.draft
        tree, mode = {"plain": (None, "plain"), "chain": (self.chain, "tree"), "tree": (self.tree, "tree"),
                      "tree_other_head": (replace(self.tree, path_logits=not self.tree.path_logits), "tree"),
                      "tree_context": (replace(self.tree, context_chain=self.tree.context_chain or self.lookup_tokens),
                                       "context"),
                      "auto": (self.tree, "auto")}[method]
        res = generate(self.model, [ids], draft=draft, tree=tree, mode=mode, chooser=self.chooser(name),
                       max_new_tokens=max_new_tokens, eos_token_id=self.eos, static=static)
        seconds = time.perf_counter() - t0
        s = res.stats[0]
        return dict(tokens=res.tokens[0], seconds=seconds, rounds=s.rounds, accepted=sum(s.accept_lengths),
                    draft_rounds=len(s.accept_lengths), accept_lengths=list(s.accept_lengths),
                    prefill_s=s.prefill_s, draft_s=s.draft_s, verify_s=s.verify_s, modes=s.modes)


def tokens_per_s(runs: list[dict]) -> float:
    return sum(len(r["tokens"]) for r in runs) / sum(r["seconds"] for r in runs)


def speculative_tau(runs: list[dict]) -> float:
    """Tokens committed per speculative round over runs of a draft method (accepted draft tokens + the bonus)."""
    return 1.0 + sum(r["accepted"] for r in runs) / max(sum(r["draft_rounds"] for r in runs), 1)


def acceptance_per_position(runs: list[dict], depth: int) -> list[float]:
    """Per draft position d (1..depth): the fraction of draft rounds whose accept length reached d."""
    lengths = [n for r in runs for n in r["accept_lengths"]]
    return [sum(n >= d for n in lengths) / max(len(lengths), 1) for d in range(1, depth + 1)]


def agreement(runs: list[dict], reference: list[dict]) -> float:
    """Mean over prompts of the matching prefix with the reference, as a fraction of the reference's length."""
    fractions = []
    for r, ref in zip(runs, reference):
        same = next((i for i, (a, b) in enumerate(zip(r["tokens"], ref["tokens"])) if a != b),
                    min(len(r["tokens"]), len(ref["tokens"])))
        fractions.append(same / max(len(ref["tokens"]), 1))
    return sum(fractions) / len(fractions)


def summarize(label: str, runs: list[dict], reference: list[dict], target_bytes: int, draft_step_bytes: int,
              depth: int) -> dict:
    """One variant ("tree bf16"): tokens/s, tau, forwards, bandwidth, agreement with `reference` (HF greedy of
    the same dtype, else our plain loop of it); `depth`: draft levels per round (0 without a draft)."""
    method = label.split()[0]
    tokens = sum(len(r["tokens"]) for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    out = dict(method=label, prompts=len(runs), new_tokens=tokens, seconds=round(seconds, 2),
               tokens_per_s=tokens_per_s(runs))
    identical = [r["tokens"] == ref["tokens"] for r, ref in zip(runs, reference)]
    out["identical_to_hf_greedy"] = f"{sum(identical)}/{len(runs)}"
    out["agreement_with_hf_greedy"] = agreement(runs, reference)
    if runs[0]["rounds"] is not None:
        rounds = sum(r["rounds"] for r in runs)
        speculative = method not in ("plain", VLLM_PLAIN)
        out["tau"] = speculative_tau(runs) if speculative else 1.0
        if speculative:
            out["acceptance_per_position"] = acceptance_per_position(runs, depth)
        out["target_forwards"] = rounds + len(runs)  # rounds + one prefill per prompt
        draft_rounds = sum(r["draft_rounds"] for r in runs)
        out["modes"] = {m: sum(r["modes"].get(m, 0) for r in runs) for m in ("tree", "context", "chain", "plain", "vllm")}
        moved = target_bytes * out["target_forwards"] + draft_step_bytes * (draft_rounds * depth + len(runs))
        out["bandwidth_GBps"] = moved / seconds / 1e9
        if runs[0]["draft_s"] is None:  # vLLM: no split of a step into draft and verify
            return out
        out["draft_s"] = round(sum(r["draft_s"] for r in runs), 2)
        out["verify_s"] = round(sum(r["verify_s"] for r in runs), 2)
        other = seconds - sum(r["prefill_s"] + r["draft_s"] + r["verify_s"] for r in runs)
        out["overhead_ms_per_round"] = 1000 * other / max(rounds, 1)  # bookkeeping outside draft and verify
    elif method == "hf_greedy":
        out["tau"] = 1.0
        out["bandwidth_GBps"] = target_bytes * tokens / seconds / 1e9  # one forward per token (prefill = 1st)
    return out


def by_category(runs: dict[str, list[dict]], categories: list[str]) -> dict[str, dict[str, dict]]:
    """{category: {variant: {tau, tokens_per_s, speedup_vs_hf_greedy}}} over the prompts of each category."""
    table = {}
    for category in dict.fromkeys(categories):
        picked = [i for i, c in enumerate(categories) if c == category]
        row = {}
        for label, variant_runs in runs.items():
            chosen = [variant_runs[i] for i in picked]
            entry = {"prompts": len(chosen), "tokens_per_s": tokens_per_s(chosen)}
            if chosen[0]["rounds"] is not None and not label.startswith("plain"):
                entry["tau"] = speculative_tau(chosen)
            row[label] = entry
        base = row.get("hf_greedy fp32")
        for entry in row.values():
            entry["speedup_vs_hf_greedy"] = entry["tokens_per_s"] / base["tokens_per_s"] if base else None
        table[category] = row
    return table


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default=SMOLLM2_NAME,
                   help=f"the target: a named one ({', '.join(NAMED_TARGETS)}), an HF folder, a .gguf file or a hub id")
    p.add_argument("--draft", default=None,
                   help="the draft folder (save_draft layout); default: the draft shipped for --target")
    p.add_argument("--prompts", default="mtbench",
                   help=f"prompt set ({', '.join(PROMPT_SETS)}; pipelines/prompt_sets.py) or a .jsonl file")
    p.add_argument("--num-prompts", type=int, default=16, help="measured prompts")
    p.add_argument("--max-new-tokens", type=int, default=96, help="new tokens per prompt")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")
    p.add_argument("--dtypes", default="float32,bfloat16" if cpu_has_native_bf16() else "float32",
                   help="comma-separated dtypes to run every method in")
    p.add_argument("--vllm-k", default="3,5",
                   help="draft tokens per step of the vllm_eagle3_k<K> methods (one method per K; with --methods vllm)")
    p.add_argument("--chain-depth", type=int, default=4, help="draft tokens per round of the chain method")
    p.add_argument("--top-k", type=int, default=TreeConfig.top_k, help="tree: children expanded per node")
    p.add_argument("--depth", type=int, default=TreeConfig.depth, help="tree: the deepest level the auto-tune tries")
    p.add_argument("--total-tokens", type=int, default=0, help="fixed tree size; 0 = auto-tune")
    p.add_argument("--autotune-prompts", type=int, default=3, help="calibration prompts of the auto-tune")
    p.add_argument("--autotune-tokens", type=int, default=48, help="new tokens per calibration prompt")
    p.add_argument("--lookup-tokens", type=int, default=10, help="HF prompt_lookup_num_tokens")
    p.add_argument("--costs", action=argparse.BooleanOptionalAction, default=True, help="measure the cost table")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    p.add_argument("--out", default=str(RESULTS), help="folder of decode.json and decode.md")
    p.add_argument("--render", metavar="JSON", help="only rewrite the .md of an earlier run's decode.json")
    return p.parse_args(argv)


def load_models(target: str, draft_path: str, dtype: torch.dtype):
    """(target, tokenizer, draft in eval mode, eos ids as a list), both models in `dtype`."""
    model, tokenizer = load_target(target, device="cpu", dtype=dtype)
    draft = load_draft(draft_path, target=model)  # in the target's dtype
    draft.eval()
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [tokenizer.eos_token_id])
    return model, tokenizer, draft, eos


def choose_tree(args, model, draft, eos, prompts, calib):
    """(tree, autotune result or None): the fixed `--total-tokens` tree, else one auto-tuned on `calib`."""
    if args.total_tokens:
        return TreeConfig(args.top_k, args.depth, args.total_tokens), None
    print(f"[bench] auto-tuning the tree ({model.dtype}) on {len(calib)} calibration prompts ...", flush=True)
    tuned = autotune(model, draft, calib, top_k=args.top_k, depth=args.depth,
                     max_new_tokens=args.autotune_tokens, eos_token_id=eos,
                     context_tokens=int(sum(map(len, prompts)) / len(prompts)) + args.max_new_tokens // 2)
    print(f"[bench] chose {tuned.tree} (plain is {tuned.mode == 'plain' and 'faster' or 'slower'}); expected "
          f"tokens/s: { {k: round(v, 2) for k, v in tuned.expected_tokens_per_s.items()} }, plain "
          f"{tuned.plain_tokens_per_s:.2f}", flush=True)
    return tuned.tree, tuned


def measure_costs(model, draft, top_k: int, context_tokens: int = COST_CONTEXT, repeats: int = 15) -> dict:
    """Bare transformers forward vs our verify forward at COST_WIDTHS, our plain step, one draft level (ms), all
    timed interleaved (`autotune.timed`): their ratios are what the cost table compares."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, context_tokens + max(COST_WIDTHS)), generator=g)
    cache = DynamicCache()
    with torch.inference_mode():
        model(ids[:, :context_tokens], past_key_values=cache, use_cache=True)

    def bare(width):  # transformers' forward with logits of every new token, then the cache back
        return (lambda: model(ids[:, context_tokens: context_tokens + width], past_key_values=cache, use_cache=True,
                              logits_to_keep=0),
                lambda: cache.crop(-width))  # transformers 5 crops by a negative count

    aux = list(draft.config.aux_layer_ids)
    kv = TargetKV(1, "cpu")
    with torch.inference_mode():
        prefill(model, kv, [ids[0, :context_tokens].tolist()], aux)
    token = torch.tensor([1])
    ms = timed("cpu", {"bare": {w: bare(w) for w in COST_WIDTHS},
                       "verify": target_forward_cases(model, COST_WIDTHS, context_tokens, aux),
                       "plain": {1: (lambda: plain_step(model, kv, token, SamplingConfig(), None, aux),
                                     lambda: kv.truncate_(context_tokens))},
                       "draft": draft_cases(draft, top_k, [1, 6], context_tokens)}, repeats)
    return {"bare_ms": {str(w): v for w, v in ms["bare"].items()},
            "verify_ms": {str(w): v for w, v in ms["verify"].items()},
            "plain_step_ms": ms["plain"][1],
            "draft_level_ms": (ms["draft"][6] - ms["draft"][1]) / 5}


def measure(variants: dict, prompts: list[list[int]], max_new_tokens: int) -> dict[str, list]:
    """{label: [run per prompt]}, variants interleaved per prompt in rotating order (spreads machine drift)."""
    labels = list(variants)
    runs = {label: [] for label in labels}
    t_start = time.perf_counter()
    for i, ids in enumerate(prompts):
        for label in labels[i % len(labels):] + labels[: i % len(labels)]:
            runner, method = variants[label]
            runs[label].append(runner.run(method, ids, max_new_tokens))
        line = " ".join(f"{m}={len(runs[m][-1]['tokens']) / runs[m][-1]['seconds']:.1f}" for m in labels)
        print(f"[bench] prompt {i + 1}/{len(prompts)} ({len(ids)} tokens) tok/s: {line} "
              f"[{time.perf_counter() - t_start:.0f}s]", flush=True)
    return runs


def draft_step_bytes(draft) -> int:
    """Weights one draft step reads: all but the embedding table (rows are gathered, not streamed)."""
    return sum(p.numel() * p.element_size() for n, p in draft.named_parameters() if not n.startswith("embed_tokens"))


def summaries(runs: dict[str, list], variants: dict) -> list[dict]:
    """summarize() per variant plus the speed-ups over HF greedy fp32 and our plain loop of the same dtype."""
    summary = []
    for label, (runner, method) in variants.items():
        tag = label.split()[1]
        reference = runs.get(f"hf_greedy {tag}") or runs.get(f"plain {tag}") or runs[label]
        depth = {"chain": runner.chain.depth, "tree": runner.tree.depth, "tree_other_head": runner.tree.depth,
                 "tree_context": runner.tree.depth, "auto": runner.tree.depth}.get(method, 0)
        if method.startswith(VLLM_EAGLE3):
            depth = int(method[len(VLLM_EAGLE3):])
        summary.append(summarize(label, runs[label], reference, param_bytes(runner.model),
                                 draft_step_bytes(runner.draft), depth))
        vllm_plain = runs.get(f"{VLLM_PLAIN} {tag}")
        if vllm_plain is not None:  # which outputs equal which: vLLM's own greedy too
            same = sum(r["tokens"] == ref["tokens"] for r, ref in zip(runs[label], vllm_plain))
            summary[-1]["identical_to_vllm_plain"] = f"{same}/{len(vllm_plain)}"
    base = {s["method"]: s["tokens_per_s"] for s in summary}
    for s in summary:
        plain = base.get(f"plain {s['method'].split()[1]}")
        s["speedup_vs_hf_greedy"] = s["tokens_per_s"] / base["hf_greedy fp32"] if "hf_greedy fp32" in base else None
        s["speedup_vs_plain"] = s["tokens_per_s"] / plain if plain else None
    return summary


def per_prompt(runs: dict[str, list]) -> dict[str, list[dict]]:
    """The runs without their tokens (new_tokens counts them instead)."""
    return {m: [{k: v for k, v in r.items() if k != "tokens"} | {"new_tokens": len(r["tokens"])} for r in rs]
            for m, rs in runs.items()}


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        r = json.loads(Path(args.render).read_text())
        write_markdown(args.render, markdown(r["summary"], r["meta"], r["by_category"], r["costs"], r["autotune"]))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = [m for m in args.methods.split(",") if m]
    if "vllm" in methods:  # vLLM plain and vLLM + our draft at each --vllm-k
        at = methods.index("vllm")
        methods[at:at + 1] = vllm_methods([int(k) for k in args.vllm_k.split(",") if k])
    dtypes = [resolve_dtype(d, "cpu") for d in args.dtypes.split(",") if d]
    draft_path = args.draft or str(shipped_draft(args.target))
    chain = TreeConfig.chain(args.chain_depth)
    variants, tuned, costs, runners, prompts = {}, {}, {}, {}, None
    try:
        for dtype in dtypes:
            model, tokenizer, draft, eos = load_models(args.target, draft_path, dtype)
            if prompts is None:  # the same tokenizer in every dtype
                # Second turns follow the target's own greedy answer, in the first dtype measured (float32 by default).
                items, calib_items = prompt_set(args.prompts, tokenizer, args.num_prompts, args.autotune_prompts,
                                                answer=target_answerer(model, tokenizer, args.max_new_tokens))
                prompts = [prompt_ids(tokenizer, item["messages"]) for item in items]
                calib = [prompt_ids(tokenizer, item["messages"]) for item in calib_items]
            tree, tuned[SHORT[dtype]] = choose_tree(args, model, draft, eos, prompts, calib)
            runner = runners[SHORT[dtype]] = Runner(model, draft, eos, chain, tree, args.lookup_tokens)
            if any(is_vllm(m) for m in methods):
                runner.vllm = VllmRunner(str(materialize_hf_folder(args.target)), draft_path, dtype,
                                         [m for m in methods if is_vllm(m)])
            runner.tuned = tuned[SHORT[dtype]]
            for m in methods:  # warm-up: first-call costs stay out of the measurement
                runner.warm_up(m, calib[0][:64])
                variants[f"{m} {SHORT[dtype]}"] = (runner, m)
            if args.costs:
                costs[SHORT[dtype]] = measure_costs(model, draft, args.top_k)
        t_start = time.perf_counter()
        runs = measure(variants, prompts, args.max_new_tokens)
    finally:  # vLLM's engines end with the run, whatever happens
        for runner in runners.values():
            if runner.vllm is not None:
                runner.vllm.close()
    wall = round(time.perf_counter() - t_start)
    summary = summaries(runs, variants)
    trees = {tag: str(r.tree) for tag, r in runners.items()}
    meta = dict(target=args.target, draft=describe_draft(Path(draft_path)),
                machine=machine(torch.get_num_threads()), command=command("decode", argv), date=time.strftime("%Y-%m-%d %H:%M %Z"),
                prompt_set=args.prompts, prompts=len(prompts), prompt_ids=[item["id"] for item in items],
                prompt_tokens=[len(p) for p in prompts], max_new_tokens=args.max_new_tokens, trees=trees,
                chain=str(chain), wall_seconds=wall,
                note=f"Wall time {wall} s; timings on a shared machine are noisy, "
                     f"which is why methods are interleaved per prompt")
    categories = by_category(runs, [item["category"] for item in items])
    cost_table = {"context_tokens": COST_CONTEXT, "top_k": args.top_k, "by_dtype": costs} if costs else None
    result = dict(meta=meta, summary=summary, by_category=categories, costs=cost_table,
                  autotune={k: v.to_dict() for k, v in tuned.items() if v}, per_prompt=per_prompt(runs))
    path = write_json(Path(args.out) / "decode.json", result)
    write_markdown(path, markdown(summary, meta, categories, cost_table, result["autotune"]))


if __name__ == "__main__":
    main()
