"""The Markdown of `bench.decode`'s result (bench/results/decode.md): the summary table, per category, the cost
table and the auto-tune's tau curve. `python -m bench.decode --render decode.json` rewrites it from the JSON."""

from __future__ import annotations

COST_WIDTHS = (1, 2, 4, 8, 16, 32)  # tokens per forward of the cost table

def category_markdown(table: dict[str, dict[str, dict]]) -> list[str]:
    first = next(iter(table.values()))
    # HF prompt lookup beside ours: the peer that needs no draft, per category (tau n/a: HF does not report it)
    labels = [label for label in first if label.split()[0] in ("hf_prompt_lookup", "tree", "tree_context", "auto")]
    if not labels or "hf_greedy fp32" not in first:
        return []
    lines = ["Per category (speed-up over HF greedy fp32 on the same prompts):", "",
             "| category | prompts | " + " | ".join(f"tau {m} | speed-up {m}" for m in labels) + " |",
             "|---|---:|" + "---:|---:|" * len(labels)]
    for category, row in table.items():
        cells = " | ".join((f"{row[m]['tau']:.2f}" if "tau" in row[m] else "n/a")
                           + f" | {row[m]['speedup_vs_hf_greedy']:.2f}x" for m in labels)
        lines.append(f"| {category} | {row[labels[0]]['prompts']} | {cells} |")
    return lines + [""]


def cost_markdown(costs: dict) -> list[str]:
    lines = ["Costs (ms, median; context of {} tokens): a forward of N new tokens, bare transformers vs our "
             "verification (tree mask, aux capture, logits of every node).".format(costs["context_tokens"]), "",
             "| dtype | forward | " + " | ".join(f"{w} tok" for w in COST_WIDTHS) + " | our plain step | "
             "draft level (top-k {}) |".format(costs["top_k"]),
             "|---|---|" + "---:|" * (len(COST_WIDTHS) + 2)]
    for tag, c in costs["by_dtype"].items():
        for name, key in (("transformers", "bare_ms"), ("ours (verify)", "verify_ms")):
            cells = " | ".join(f"{c[key][str(w)]:.1f}" for w in COST_WIDTHS)
            extra = f" | {c['plain_step_ms']:.1f} | {c['draft_level_ms']:.1f}" if key == "verify_ms" else " | | "
            lines.append(f"| {tag} | {name} | {cells}{extra} |")
    lines.append("")
    for tag, c in costs["by_dtype"].items():
        step, widest = c["plain_step_ms"], max(w for w in COST_WIDTHS if w <= 16)
        lines.append(f"- {tag}: our {widest}-token verify costs {c['verify_ms'][str(widest)] / step:.2f}x our plain "
                     f"step; our plain step costs {step / c['bare_ms']['1']:.2f}x transformers' 1-token forward.")
    return lines + ["", "All of one dtype's costs are timed interleaved, call by call in rotating order, so their "
                    "ratios hold while the machine's speed drifts.", ""]


CURVE_SHAPES = ("1/4", "2/8", "3/16", "4/16", "6/32")  # depth/nodes: the auto-tuned sizes and the larger ones


def tau_curve(tuned: dict) -> list[dict]:
    """Speed-up over our plain loop as a function of tau, from an auto-tune's measured costs: a round of shape
    depth/nodes costs (draft time at that depth + a forward of nodes + 1 tokens; with path logits the head's
    share is tau one-row heads) = a + b * tau one-token forwards, so speed-up(tau) = tau / (a + b * tau); per
    shape: the cost at this draft's tau (calibration), its speed-up and the tau that 1.3x and 2x would take."""
    from eagle_core.autotune import round_ms

    def ints(d):
        return {int(k): v for k, v in d.items()}

    forward, draft = ints(tuned["forward_ms_monotone"]), ints(tuned["draft_ms"])
    head = ints(tuned.get("head_ms") or {})  # absent from runs recorded before path logits (head on every node)
    path = bool(tuned.get("path_logits"))
    rows = []
    for shape in CURVE_SHAPES:
        depth, size = map(int, shape.split("/"))
        if shape not in tuned["tau"] or depth not in draft:
            continue
        a = round_ms(forward, head, draft, depth, size, 0.0, path) / forward[1]
        b = round_ms(forward, head, draft, depth, size, 1.0, path) / forward[1] - a
        tau = tuned["tau"][shape]
        needed = {x: x * a / (1 - x * b) if x * b < 1 else float("inf") for x in (1.3, 2.0)}
        rows.append(dict(shape=shape, round_cost=a + b * tau, tau=tau, speedup=tau / (a + b * tau),
                         tau_for_1_3x=needed[1.3], tau_for_2x=needed[2.0], path_logits=path))
    return rows


def curve_markdown(autotune: dict) -> list[str]:
    lines = ["Speed-up against tau, from the auto-tune's measured costs (round cost in one-token forwards of the "
             "target; speed-up = tau / round cost; tau of this draft from the auto-tune's calibration run):", "",
             "| dtype | tree depth/nodes | head | round cost | tau of this draft | speed-up | tau for 1.3x | tau for 2x |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for tag, tuned in autotune.items():
        for r in tau_curve(tuned):
            head = "path" if r["path_logits"] else "all nodes"
            lines.append(f"| {tag} | {r['shape']} | {head} | {r['round_cost']:.2f} | {r['tau']:.2f} | {r['speedup']:.2f}x | "
                         f"{r['tau_for_1_3x']:.2f} | {r['tau_for_2x']:.2f} |")
    return lines + [""]


def markdown(summary: list[dict], meta: dict, categories: dict | None = None, costs: dict | None = None,
             autotune: dict | None = None) -> str:
    lines = [f"# Decoding benchmark: {meta['target']} on {meta['machine']}", "",
             f"`{meta['command']}`", "",
             f"{meta.get('date', '')}", "",
             f"{meta['prompts']} prompts of the set `{meta.get('prompt_set', 'mtbench')}` (pipelines/prompt_sets.py; chat "
             f"template), greedy, max_new_tokens {meta['max_new_tokens']}, batch 1, methods interleaved per prompt. Draft: {meta['draft']}. "
             f"Trees (auto-tuned per dtype): {meta['trees']}, chain: {meta['chain']}. {meta['note']}.", "",
             "| method | tau | tokens/s | vs HF greedy fp32 | vs our plain (same dtype) | GB/s | "
             "identical to HF greedy (same dtype) | identical to vLLM plain | agreement | acceptance per position | "
             "rounds tree/context/chain/plain/vllm |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for s in summary:
        tau = f"{s['tau']:.2f}" if "tau" in s else "n/a"
        bw = f"{s['bandwidth_GBps']:.2f}" if "bandwidth_GBps" in s else "n/a"
        ratio = lambda x: f"{x:.2f}x" if x is not None else "n/a"  # noqa: E731
        modes = "/".join(str(s["modes"].get(m, 0)) for m in ("tree", "context", "chain", "plain", "vllm")) \
            if "modes" in s else ""
        positions = " / ".join(f"{a:.2f}" for a in s.get("acceptance_per_position", []))
        lines.append(f"| {s['method']} | {tau} | {s['tokens_per_s']:.2f} | {ratio(s['speedup_vs_hf_greedy'])} | "
                     f"{ratio(s['speedup_vs_plain'])} | {bw} | {s['identical_to_hf_greedy']} | "
                     f"{s.get('identical_to_vllm_plain', 'n/a')} | {s['agreement_with_hf_greedy']:.3f} | {positions} | "
                     f"{modes} |")
    lines += ["", "tau = tokens committed per speculative round (accepted draft tokens + the bonus token); for "
              "vLLM + EAGLE-3, its mean acceptance length (the same quantity, per verification step). Acceptance "
              "per position d = the fraction of rounds whose accept length reached d. vLLM rows: its offline engine "
              "in this process, eager, same threads (bench/vllm_runner.py). GB/s = "
              "weights read per second (target weights per target forward + draft weights per draft step; "
              "n/a where HF does not expose its forward count). Agreement = matching prefix with HF greedy of the "
              "same dtype over its length; bf16 cannot be bit-identical (a batched forward rounds differently, "
              "so near-ties flip).", ""]
    lines += category_markdown(categories) if categories else []
    lines += cost_markdown(costs) if costs else []
    lines += curve_markdown(autotune) if autotune else []
    return "\n".join(lines)
