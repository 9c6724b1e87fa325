"""Sequence packing's cost in a TTT step: the same conversations one per row (right-padded to the longest) and packed
into rows (`eagle_core.ttt_batch.layout_batch`), teacher + forward + backward, interleaved, CPU seconds.

    python -m bench.ttt_packing                                   # 8 mixed lengths, rows of 512, SmolLM2's draft
    python -m bench.ttt_packing --lengths 256 256 256 256 --pack-length 1024 --ttt-steps 7

Random weights and features of the `--shape` (bench.ttt's table); one thread, so the figure is the step's work.
The two layouts' losses are printed too: they agree (tests/test_ttt_packing.py pins them to 1e-5 in float32).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.ttt import SHAPES, build_draft
from eagle_core.teacher import target_distribution
from eagle_core.ttt import ttt_forward
from eagle_core.ttt_batch import layout_batch


def split_conversations(batch: dict, lengths: list[int]) -> list[dict]:
    """bench.ttt's one-row random batch cut into conversations of `lengths` tokens (`layout_batch`'s input)."""
    conversations, at = [], 0
    for n in lengths:
        conversations.append({"input_ids": batch["input_ids"][0, at:at + n],
                              "loss_mask": batch["loss_mask"][0, at:at + n],
                              "aux_hidden": batch["aux_hidden"][0, at:at + n],
                              "last_hidden": batch["target_last_hidden"][0, at:at + n]})
        at += n
    return conversations


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 64, 128, 256, 96, 384, 200, 160],
                   help="the conversations' lengths in tokens")
    p.add_argument("--pack-length", type=int, default=512, help="the packed layout's row length in tokens")
    p.add_argument("--ttt-steps", type=int, default=3, help="TTT steps of the step")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2", help="the draft's shape (bench.ttt's table)")
    p.add_argument("--iters", type=int, default=4, help="timed steps per layout (the first is dropped)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    draft, _, _, batch, _ = build_draft(sum(args.lengths), "cpu", shape=args.shape)
    head = batch["target_lm_head_weight"]
    conversations = split_conversations(batch, args.lengths)
    layouts = {"one per row": layout_batch(conversations),
               f"packed into rows of {args.pack_length}": layout_batch(conversations, args.pack_length)}

    def step(b):
        targets = target_distribution(b["last_hidden"], head, draft.d2t)
        draft.zero_grad(set_to_none=True)
        out = ttt_forward(draft, b["input_ids"], b["loss_mask"], b["aux_hidden"], b["last_hidden"], head,
                          attention_mask=b["attention_mask"], position_ids=b.get("position_ids"),
                          ttt_steps=args.ttt_steps, targets=targets)
        out.loss.backward()
        return float(out.loss.detach())

    times, losses = {name: [] for name in layouts}, {}
    for _ in range(args.iters):
        for name, b in layouts.items():
            started = time.process_time()
            losses[name] = step(b)
            times[name].append(time.process_time() - started)
    print(f"{args.shape} draft, {args.ttt_steps} TTT steps, conversations {args.lengths} ({sum(args.lengths)} tokens)")
    for name, b in layouts.items():
        print(f"{name}: rows {list(b['input_ids'].shape)}, loss {losses[name]:.6f}, CPU s per step (median of "
              f"{args.iters - 1}) {statistics.median(times[name][1:]):.3f}")


if __name__ == "__main__":
    main()
