"""Where a decoding round's time goes: every phase of a speculative round and of a plain step, timed in the loop.

  python -m bench.rounds                                     # bf16 where native, the tree the auto-tune picks
  python -m bench.rounds --dtype float32 --top-k 8 --depth 2 --total-tokens 8 --context-chain 0

Decodes MT-bench prompts (batch 1, greedy) with our plain loop and with one speculative mode ("tree", or
"context" when the tree has a context chain), the two interleaved per prompt. Every phase function of
`eagle_core.decoding` is wrapped by a timer while it runs (`PhaseTimer`: exclusive wall time, marked with the
device's `eagle_core.timing.Timer` -- CUDA events on a GPU, so the round runs unsynchronised -- and read at the
round's end), so the table splits a measured round into draft tree, context lookup and
graft, verify forward, acceptance, cache keeps, the draft's cache extension and the round's own bookkeeping,
and the generation loop's time outside the rounds. Beside it the cost model the auto-tune uses
(`eagle_core.autotune.round_ms`: the draft's levels and a verify forward of nodes + 1 tokens, timed in isolation on a
cache of the run's mean length, after every prompt so that the machine's drift reaches both alike) prices the same
rounds at their own widths and the run's tau: the gap between the two is what the model misses.
Writes bench/results/rounds/rounds.json and rounds.md.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.common import RESULTS, command, machine, write_json, write_markdown
from bench.decode import load_models
from eagle_core import decoding
from eagle_core.autotune import (autotune, draft_cases, head_cases, interpolate, monotone, round_ms, target_forward_cases,
                                 timed)
from eagle_core.chat import prompt_ids
from eagle_core.decoding import CONTEXT, DecodingState
from eagle_core.generate import generate
from eagle_core.kv import TargetKV
from eagle_core.lookup import ContextIndex
from eagle_core.shipped import shipped_draft
from eagle_core.target import SMOLLM2_NAME, cpu_has_native_bf16, resolve_dtype
from eagle_core.timing import timer_for
from eagle_core.tree import TreeConfig
from pipelines.prompt_sets import prompt_set

# (owner, attribute, phase): the functions a round and a plain step are made of. Module-level functions are
# wrapped where `eagle_core.decoding` looks them up; methods on their class.
PHASES = (
    (DecodingState, "step", "bookkeeping"),  # the round itself: what its phases leave is its own Python
    (DecodingState, "catch_up_draft_", "draft catch-up"),
    (decoding, "draft_tree", "draft tree"),
    (ContextIndex, "propose", "context lookup"),
    (decoding, "context_tensor", "context lookup"),
    (decoding, "graft_chain", "graft chain"),
    (decoding, "verify_hidden", "verify forward"),
    (decoding, "accept_on_path", "acceptance"),
    (decoding, "accept", "acceptance"),
    (TargetKV, "keep_new_", "target cache keep"),
    (decoding, "draft_extend", "draft extend"),
    (decoding, "chain_accept_length", "counterfactuals"),
    (decoding, "draft_accept_length", "counterfactuals"),
    (ContextIndex, "extend", "context index"),
    (decoding, "target_forward", "target forward"),  # the plain step's (the verify's is inside verify_hidden)
    (decoding, "lm_logits", "head"),
    (decoding, "sample_next", "sample"),
)
ORDER = ("draft catch-up", "context lookup", "draft tree", "graft chain", "verify forward", "target forward", "head",
         "sample", "acceptance", "target cache keep", "draft extend", "counterfactuals", "context index",
         "bookkeeping")


class PhaseTimer:
    """Exclusive wall time per (mode, phase) while installed: a phase's time excludes the wrapped phases it calls,
    so the phases of one round add up to the round. The mode is that of the enclosing `DecodingState.step`. Each
    phase is a pair of the device timer's marks; they are read when the round ends (its tokens are on the host by
    then, so reading waits for nothing)."""

    def __init__(self, device):
        self.device = device
        self.timer = timer_for(device)
        self.ms = defaultdict(float)  # (mode, phase) -> ms
        self.rounds = defaultdict(int)  # mode -> rounds
        self.widths = defaultdict(list)  # mode -> tokens of each verify forward (the chain is grafted where it matched)
        self.stack: list[list] = []  # [phase, start mark, (start, end) marks of the wrapped callees]
        self.pending: list[tuple] = []  # (mode, phase, start, end, callees) of the running round, read at its end
        self.mode = None
        self.saved: list[tuple] = []

    def wrap(self, fn, phase: str):
        @functools.wraps(fn)
        def timed_call(*args, **kwargs):
            if phase == "bookkeeping":  # DecodingState.step(self, mode)
                self.mode = args[1] if len(args) > 1 else kwargs["mode"]
                self.rounds[self.mode] += 1
            if self.mode is None:  # outside a round (prefill, warm-up): not counted
                return fn(*args, **kwargs)
            if phase == "verify forward":  # verify_hidden(target, kv, tree, aux_layer_ids)
                self.widths[self.mode].append(args[2].tokens.shape[1])
            frame = [phase, self.timer.mark(), []]
            self.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                end = self.timer.mark()
                self.stack.pop()
                self.pending.append((self.mode, phase, frame[1], end, frame[2]))
                if self.stack:
                    self.stack[-1][2].append((frame[1], end))
                if phase == "bookkeeping":
                    self.read_round()
                    self.mode = None
        return timed_call

    def read_round(self) -> None:
        """Add the ended round's exclusive phase times: each phase's span less its wrapped callees' spans."""
        seconds = self.timer.seconds
        for mode, phase, start, end, callees in self.pending:
            self.ms[(mode, phase)] += 1000 * (seconds(start, end) - sum(seconds(a, b) for a, b in callees))
        self.pending.clear()

    def __enter__(self):
        for owner, name, phase in PHASES:
            fn = owner.__dict__[name]
            self.saved.append((owner, name, fn))
            setattr(owner, name, self.wrap(fn, phase))
        return self

    def __exit__(self, *exc):
        for owner, name, fn in reversed(self.saved):
            setattr(owner, name, fn)
        self.saved.clear()

    def per_round(self, mode: str) -> dict[str, float]:
        n = max(self.rounds[mode], 1)
        return {p: self.ms[(mode, p)] / n for p in ORDER if (mode, p) in self.ms}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default=SMOLLM2_NAME, help="the target (as bench.decode)")
    p.add_argument("--draft", default=None, help="the draft folder; default: the draft shipped for --target")
    p.add_argument("--dtype", default="bfloat16" if cpu_has_native_bf16() else "float32",
                   help="dtype of target and draft (bfloat16 where the CPU has native bf16)")
    p.add_argument("--prompts", default="mtbench", help="prompt set or .jsonl file (pipelines/prompt_sets.py)")
    p.add_argument("--num-prompts", type=int, default=8, help="measured prompts")
    p.add_argument("--max-new-tokens", type=int, default=96, help="new tokens per prompt")
    p.add_argument("--top-k", type=int, default=TreeConfig.top_k, help="tree: children expanded per node")
    p.add_argument("--depth", type=int, default=TreeConfig.depth, help="tree depth (the auto-tune's deepest)")
    p.add_argument("--total-tokens", type=int, default=0, help="fixed tree size; 0 = auto-tune the tree")
    p.add_argument("--context-chain", type=int, default=None,
                   help="context chain length of a fixed tree (0 = none); the auto-tune chooses its own")
    p.add_argument("--repeats", type=int, default=3, help="passes over the cost model's isolated cases after each prompt")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    p.add_argument("--out", default=str(RESULTS / "rounds"), help="folder of rounds.json and rounds.md")
    return p.parse_args(argv)


def choose(args, model, draft, eos, prompts, calib) -> TreeConfig:
    if args.total_tokens:
        return TreeConfig(args.top_k, args.depth, args.total_tokens, context_chain=args.context_chain or 0)
    tuned = autotune(model, draft, calib, top_k=args.top_k, depth=args.depth, eos_token_id=eos,
                     context_tokens=int(sum(map(len, prompts)) / len(prompts)) + args.max_new_tokens // 2)
    tree = tuned.tree
    if args.context_chain is not None:
        tree = TreeConfig(tree.top_k, tree.depth, tree.total_tokens, path_logits=tree.path_logits,
                          context_chain=args.context_chain)
    return tree


def cost_cases(model, draft, tree: TreeConfig, context_tokens: int) -> dict:
    """The auto-tune's isolated cases of this tree's round: forwards of 1 and nodes + 1 (+ chain) tokens, the head on
    1 and nodes + 1 rows, a draft round at its depth (`eagle_core.autotune`)."""
    widths = sorted({1, tree.total_tokens + 1, tree.total_tokens + tree.context_chain + 1})
    aux = list(draft.config.aux_layer_ids)
    return {"verify": target_forward_cases(model, widths, context_tokens, aux), "head": head_cases(model, widths),
            "draft": draft_cases(draft, tree.top_k, [tree.depth], context_tokens)}


def run(args, model, draft, eos, prompts, tree: TreeConfig, cases: dict) -> tuple[PhaseTimer, dict, dict]:
    """Both methods on every prompt, interleaved (the speculative one first on even prompts), and after each prompt
    `args.repeats` passes over the cost model's isolated `cases`, so that the model is timed through the same
    drift of the machine as the loop: (phases, totals, the cases' median ms over prompts)."""
    mode = CONTEXT if tree.context_chain else "tree"
    methods = {"plain": dict(draft=None, mode="plain"), mode: dict(draft=draft, tree=tree, mode=mode)}
    totals = {m: dict(tokens=0, seconds=0.0, rounds=0, accepted=0, spec_rounds=0) for m in methods}
    costs = {family: {key: [] for key in c} for family, c in cases.items()}
    for m, kw in methods.items():  # warm-up
        generate(model, [prompts[0][:64]], max_new_tokens=4, eos_token_id=eos, **kw)
    with PhaseTimer(model.device) as timer:
        for i, ids in enumerate(prompts):
            for m in (list(methods) if i % 2 else list(methods)[::-1]):
                out = generate(model, [ids], max_new_tokens=args.max_new_tokens, eos_token_id=eos, **methods[m])
                s, t = out.stats[0], totals[m]
                t["tokens"] += s.new_tokens
                t["seconds"] += s.total_s - s.prefill_s
                t["rounds"] += s.rounds
                t["accepted"] += sum(s.accept_lengths)
                t["spec_rounds"] += len(s.accept_lengths)
            for family, ms in timed(model.device, cases, args.repeats).items():  # outside any round: not counted
                for key, v in ms.items():
                    costs[family][key].append(v)
    median = {family: {str(key): sorted(v)[len(v) // 2] for key, v in c.items()} for family, c in costs.items()}
    return timer, totals, median


def summarize(timer: PhaseTimer, totals: dict, tree: TreeConfig, costs: dict) -> dict:
    mode = CONTEXT if tree.context_chain else "tree"
    plain, spec = totals["plain"], totals[mode]
    tau = 1 + spec["accepted"] / max(spec["spec_rounds"], 1)
    loop_ms = {m: 1000 * t["seconds"] / max(t["rounds"], 1) for m, t in totals.items()}  # per round, decode only
    phases = {m: timer.per_round(m) for m in totals}
    for m, p in phases.items():  # the generation loop around the rounds: Request bookkeeping, row selection
        p["generate loop"] = loop_ms[m] - sum(p.values())
    step = loop_ms["plain"]
    forward = monotone({int(w): v for w, v in costs["verify"].items()})
    head = monotone({int(w): v for w, v in costs["head"].items()})
    draft = {tree.depth: costs["draft"][str(tree.depth)]}
    widths = timer.widths[mode]  # nodes + 1 of every round: the tree's, plus the chain where it was grafted
    model_ms = sum(round_ms(forward, head, draft, tree.depth, w - 1, tau, tree.path_logits) for w in widths) / len(widths)
    verify_model = sum(interpolate(forward, w) for w in widths) / len(widths)
    return dict(
        mode=mode, tau=tau, tokens_per_s={m: t["tokens"] / t["seconds"] for m, t in totals.items()},
        round_ms=loop_ms, phases_ms=phases,
        measured_round_in_steps=loop_ms[mode] / step,
        model_round_ms=model_ms, model_step_ms=forward[1],
        model_round_in_steps=model_ms / forward[1],
        mean_verify_width=sum(widths) / len(widths),
        model_parts_ms={"verify forward": verify_model, "draft round": draft[tree.depth],
                        "head": model_ms - verify_model - draft[tree.depth]},
        speedup=(spec["tokens"] / spec["seconds"]) / (plain["tokens"] / plain["seconds"]),
    )


def markdown(result: dict) -> str:
    meta, s = result["meta"], result["summary"]
    mode = s["mode"]
    lines = [f"# Where a round's time goes ({meta['dtype']}, {meta['tree']})", "",
             f"- command: `{meta['command']}`", f"- date: {meta['date']}", f"- machine: {meta['machine']}",
             f"- target: {meta['target']}; draft: {meta['draft']}",
             f"- prompts: {meta['prompts']} of {meta['prompt_set']}, {meta['max_new_tokens']} new tokens, batch 1, greedy; "
             f"plain and {mode} interleaved per prompt", "",
             f"{mode}: tau {s['tau']:.2f}, {s['tokens_per_s'][mode]:.2f} tokens/s against plain "
             f"{s['tokens_per_s']['plain']:.2f} ({s['speedup']:.2f}x).", "",
             "Per round (ms, exclusive: each phase without the timed phases it calls; the plain column is one plain "
             "step of our plain loop):", "",
             f"| phase | plain | {mode} | {mode}, share |", "|---|---:|---:|---:|"]
    names = [p for p in ORDER + ("generate loop",) if any(p in v for v in s["phases_ms"].values())]
    for p in names:
        a, b = s["phases_ms"]["plain"].get(p, 0.0), s["phases_ms"][mode].get(p, 0.0)
        lines.append(f"| {p} | {a:.2f} | {b:.2f} | {100 * b / s['round_ms'][mode]:.1f} % |")
    lines.append(f"| **round** | **{s['round_ms']['plain']:.2f}** | **{s['round_ms'][mode]:.2f}** | 100 % |")
    parts = s["model_parts_ms"]
    lines += ["", f"Measured: a {mode} round costs **{s['measured_round_in_steps']:.2f} plain steps** "
                  f"({s['round_ms'][mode]:.1f} / {s['round_ms']['plain']:.1f} ms; verify forwards of "
                  f"{s['mean_verify_width']:.1f} tokens on average). The auto-tune's cost model, at each round's own "
                  f"width, prices it at **{s['model_round_in_steps']:.2f}** ({s['model_round_ms']:.1f} / "
                  f"{s['model_step_ms']:.1f} ms: verify forward {parts['verify forward']:.1f}, draft round "
                  f"{parts['draft round']:.1f}, path-logits head correction {parts['head']:.1f}; timed in isolation "
                  f"on a {result['costs']['context_tokens']}-token cache after every prompt, the cases interleaved).", ""]
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, "cpu")
    draft_path = args.draft or str(shipped_draft(args.target))
    model, tokenizer, draft, eos = load_models(args.target, draft_path, dtype)
    items, calib_items = prompt_set(args.prompts, tokenizer, args.num_prompts, 3)
    prompts = [prompt_ids(tokenizer, item["messages"]) for item in items]
    calib = [prompt_ids(tokenizer, item["messages"]) for item in calib_items]
    tree = choose(args, model, draft, eos, prompts, calib)
    print(f"[rounds] {tree}", flush=True)
    context = int(sum(map(len, prompts)) / len(prompts)) + args.max_new_tokens // 2
    timer, totals, costs = run(args, model, draft, eos, prompts, tree, cost_cases(model, draft, tree, context))
    costs["context_tokens"] = context
    meta = dict(command=command("rounds", argv), date=time.strftime("%Y-%m-%d %H:%M %Z"),
                machine=machine(torch.get_num_threads()), target=args.target, draft=Path(draft_path).name,
                dtype=str(dtype).replace("torch.", ""), tree=str(tree), prompt_set=args.prompts,
                prompts=len(prompts), max_new_tokens=args.max_new_tokens)
    result = dict(meta=meta, summary=summarize(timer, totals, tree, costs), totals=totals, costs=costs)
    path = write_json(Path(args.out) / "rounds.json", result)
    write_markdown(path, markdown(result))


if __name__ == "__main__":
    main()
