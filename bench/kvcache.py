"""What a target forward pays to update its KV cache: transformers' concatenating layer vs ours, preallocated.

    python -m bench.kvcache                      # batch x cached tokens: 1x300, 4x1000, 8x2000; one thread

SmolLM2-135M's cache shape (30 layers, 3 kv heads of 64), fp32, one new token per forward (a decode step): the
time of the 30 layer updates alone, median of 5 runs of 20 forwards. Writes bench/results/kvcache.json and .md.
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


def main(argv=None):
    from transformers.cache_utils import DynamicLayer

    from eagle_core.kv import preallocated_layer_class

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(RESULTS / "kvcache.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for batch, cached in SHAPES:
        ms = {name: statistics.median(per_forward_ms(cls, batch, cached) for _ in range(5))
              for name, cls in (("concatenated", DynamicLayer), ("preallocated", preallocated_layer_class()))}
        rows.append({"batch": batch, "cached_tokens": cached, **{f"{k}_ms": round(v, 3) for k, v in ms.items()}})
    cmd = command("kvcache", argv)
    path = write_json(args.out, {"command": cmd, "machine": machine(args.threads), "date": time.strftime("%Y-%m-%d"),
                                 "rows": rows})
    lines = [f"KV cache update per target forward (30 layers, one new token, fp32), `{cmd}`, "
             f"{time.strftime('%Y-%m-%d')}, {machine(args.threads)}", "",
             "| batch | cached tokens | concatenated (transformers) ms | preallocated (ours) ms |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['cached_tokens']} | {r['concatenated_ms']:.2f} | {r['preallocated_ms']:.2f} |"
              for r in rows]
    write_markdown(path, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
