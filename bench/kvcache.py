"""What decoding pays for its KV caches at growing batch x context: the target's and the draft's.

    python -m bench.kvcache                      # batch x cached tokens: 1x300, 4x1000, 8x2000; one thread

Target: SmolLM2-135M's cache shape (30 layers, 3 kv heads of 64), fp32, one new token per forward (a decode
step): the time of the 30 layer updates alone, transformers' concatenating layer vs ours, preallocated; median
of 5 runs of 20 forwards. Draft: a whole draft round of the shipped draft (fp32) on that context: its cache
extended by 3 committed tokens, then a top-k 8, depth 6 tree; median of 5 rounds. Its cache work cannot be
timed apart from the draft's arithmetic, so compare this row across commits (the README quotes before/after).
Writes bench/results/kvcache.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import RESULTS, command, machine, write_json, write_markdown

SHAPES = ((1, 300), (4, 1000), (8, 2000))


def per_forward_ms(layer_class, batch: int, cached: int, layers: int = 30, forwards: int = 20) -> float:
    stack = [layer_class() for _ in range(layers)]
    for layer in stack:
        layer.update(torch.randn(batch, 3, cached, 64), torch.randn(batch, 3, cached, 64))
    new = torch.randn(batch, 3, 1, 64)
    start = time.perf_counter()
    for _ in range(forwards):
        for layer in stack:
            layer.update(new, new)
    return 1000 * (time.perf_counter() - start) / forwards


@torch.inference_mode()
def draft_round_ms(draft, batch: int, cached: int, rounds: int = 5) -> float:
    """Median time of a draft round (extend the cache by 3 tokens, grow a top-k 8, depth 6 tree) on `cached`."""
    from eagle_core.decoding import draft_extend
    from eagle_core.kv import DraftKV
    from eagle_core.tree import TreeConfig, draft_tree

    g = torch.Generator().manual_seed(0)
    cfg = draft.config

    def features(n):
        aux = torch.randn(batch, n, 3 * cfg.target_hidden_size, generator=g)
        return aux, torch.randint(0, cfg.target_vocab_size, (batch, n), generator=g), torch.full((batch,), n)

    dkv = DraftKV(batch, "cpu")
    draft_extend(draft, dkv, *features(cached))
    times = []
    for _ in range(rounds + 1):
        new = features(3)
        start = time.perf_counter()
        hidden = draft_extend(draft, dkv, *new)
        draft_tree(draft, dkv, hidden, torch.zeros(batch, dtype=torch.long), TreeConfig(8, 6, 32))
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:])


def main(argv=None):
    from transformers.cache_utils import DynamicLayer

    from bench.common import SHIPPED_DRAFT
    from eagle_core.checkpoint import load_draft
    from eagle_core.kv import preallocated_layer_class
    from eagle_core.target import load_target

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", default=str(RESULTS / "kvcache.json"), help="result JSON file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    draft = load_draft(SHIPPED_DRAFT, target=load_target("smollm2-135m", device="cpu", dtype=torch.float32)[0],
                       dtype=torch.float32).eval()
    rows = []
    for batch, cached in SHAPES:
        ms = {name: statistics.median(per_forward_ms(cls, batch, cached) for _ in range(5))
              for name, cls in (("concatenated", DynamicLayer), ("preallocated", preallocated_layer_class()))}
        ms["draft_round"] = draft_round_ms(draft, batch, cached)
        rows.append({"batch": batch, "cached_tokens": cached, **{f"{k}_ms": round(v, 3) for k, v in ms.items()}})
    cmd = command("kvcache", argv)
    path = write_json(args.out, {"command": cmd, "machine": machine(args.threads), "date": time.strftime("%Y-%m-%d"),
                                 "rows": rows})
    lines = [f"KV caches: the target's update per forward (30 layers, one new token, fp32) and a whole draft round "
             f"(extend by 3, tree top-k 8 depth 6, fp32), `{cmd}`, {time.strftime('%Y-%m-%d')}, {machine(args.threads)}",
             "", "| batch | cached tokens | target: concatenated (transformers) ms | target: preallocated (ours) ms "
             "| draft round ms |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['cached_tokens']} | {r['concatenated_ms']:.2f} | {r['preallocated_ms']:.2f} "
              f"| {r['draft_round_ms']:.1f} |" for r in rows]
    write_markdown(path, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
