"""Gradient accumulation in a TTT step (`TrainJobConfig.micro_batch_tokens`): the same conversations in one batch
and in micro-batches of at most N tokens (`eagle_core.ttt.train_step` on a list, each micro-batch's teacher computed
just before its forward, as the training loop does), each layout in a fresh process: the step's peak memory above
its start, CPU seconds per step, and the loss (equal up to float rounding).

    python -m bench.ttt_accumulation                                 # 8 x 512 tokens; micro-batches of 1024 and 512
    python -m bench.ttt_accumulation --lengths 2048 2048 --micro-batch-tokens 2048

Random weights and features of the `--shape` (bench.ttt's table), float32, one thread. Peak memory is the process's
resident high-water mark, reset just before the timed steps (/proc/self/clear_refs), minus the resident size then.
Writes bench/results/ttt-accumulation.json and .md (command, machine, date inside).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.common import machine, write_json, write_markdown
from bench.ttt import SHAPES

OUT = Path("bench/results/ttt-accumulation")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def child(lengths: list[int], micro_batch_tokens: int | None, shape: str, ttt_steps: int, iters: int) -> dict:
    """One layout's steps in this process (after one untimed step: AdamW's state, the allocator)."""
    import torch

    from bench.ttt import build_draft
    from bench.ttt_packing import split_conversations
    from eagle_core.teacher import with_targets
    from eagle_core.ttt import TrainConfig, make_optimizer, make_scheduler, train_step
    from eagle_core.ttt_batch import layout_batch, pack_rows

    torch.set_num_threads(1)
    draft, _, _, batch, _ = build_draft(sum(lengths), "cpu", shape=shape)
    head = batch["target_lm_head_weight"]
    conversations = split_conversations(batch, lengths)
    del batch
    groups = [list(range(len(lengths)))] if micro_batch_tokens is None else pack_rows(lengths, micro_batch_tokens)
    micro = [layout_batch([conversations[i] for i in sorted(g)], max(lengths[i] for i in g)) for g in groups]
    cfg = TrainConfig(lr=1e-4, ttt_steps=ttt_steps, total_steps=iters + 1)
    optimizer = make_optimizer(draft, cfg)
    scheduler = make_scheduler(optimizer, cfg)

    def step() -> float:
        return train_step(draft, micro, head, optimizer, scheduler, cfg,
                          prepare=lambda b: with_targets(b, head, draft.d2t))["loss"]

    step()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:  # resets the resident high-water mark (VmHWM)
        f.write("5")
    base = _status_bytes("VmRSS")
    times, losses = [], []
    for _ in range(iters):
        started = time.process_time()
        losses.append(step())
        times.append(time.process_time() - started)
    return {"micro_batch_tokens": micro_batch_tokens, "micro_batches": [list(b["input_ids"].shape) for b in micro],
            "cpu_s_per_step": statistics.median(times), "cpu_s_all": times, "first_timed_loss": losses[0],
            "peak_mem_bytes": _status_bytes("VmHWM") - base}


def markdown(result: dict) -> str:
    rows = result["runs"]
    whole = rows[0]
    lines = [f"# Gradient accumulation in a TTT step ({result['date']})", "",
             f"Command: `{result['command']}`", "",
             f"Machine: {result['machine']}; torch {result['torch']}; float32.", "",
             f"{result['shape']} draft, {result['ttt_steps']} TTT steps, conversations {result['lengths']} "
             f"({sum(result['lengths'])} tokens, packed rows as long as the longest of each batch); each layout in "
             f"its own process, median of {result['iters']} steps after one untimed.", "",
             "| layout | batches [rows, length] | step peak memory MiB | CPU s per step | loss |",
             "|---|---|---:|---:|---:|"]
    for r in rows:
        name = "one batch" if r["micro_batch_tokens"] is None else f"micro-batches of <= {r['micro_batch_tokens']}"
        lines.append(f"| {name} | {r['micro_batches']} | {r['peak_mem_bytes'] / 2**20:,.0f} | "
                     f"{r['cpu_s_per_step']:.2f} | {r['first_timed_loss']:.6f} |")
    lines += ["", "Peak memory relative to one batch: " + ", ".join(
        f"{r['micro_batch_tokens']}: {r['peak_mem_bytes'] / whole['peak_mem_bytes']:.2f}x" for r in rows[1:]) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512] * 8, help="the conversations' lengths in tokens")
    p.add_argument("--micro-batch-tokens", type=int, nargs="+", default=[1024, 512],
                   help="the micro-batch sizes measured beside one batch")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2", help="the draft's shape (bench.ttt's table)")
    p.add_argument("--ttt-steps", type=int, default=3, help="TTT steps of the step")
    p.add_argument("--iters", type=int, default=2, help="timed steps per layout (after one untimed)")
    p.add_argument("--out", default=str(OUT), help="result path without suffix (.json and .md are written)")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)  # one layout, inside a subprocess
    args = p.parse_args(argv)
    if args.child is not None:
        result = child(args.lengths, args.child or None, args.shape, args.ttt_steps, args.iters)
        print(json.dumps(result))
        return
    import torch

    runs = []
    for micro in [0] + args.micro_batch_tokens:
        cmd = [sys.executable, "-m", "bench.ttt_accumulation", "--child", str(micro), "--shape", args.shape,
               "--ttt-steps", str(args.ttt_steps), "--iters", str(args.iters), "--lengths", *map(str, args.lengths)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        r = runs[-1]
        print(f"micro_batch_tokens {r['micro_batch_tokens']}: batches {r['micro_batches']}, peak "
              f"{r['peak_mem_bytes'] / 2**20:,.0f} MiB, {r['cpu_s_per_step']:.2f} CPU s per step, loss "
              f"{r['first_timed_loss']:.6f}", flush=True)
    result = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "command": " ".join(["python -m bench.ttt_accumulation", *(argv if argv is not None else sys.argv[1:])]),
              "machine": machine(threads=1), "torch": torch.__version__,
              "shape": args.shape, "ttt_steps": args.ttt_steps, "lengths": args.lengths, "iters": args.iters,
              "runs": runs}
    write_json(Path(args.out).with_suffix(".json"), result)
    write_markdown(Path(args.out), markdown(result))


if __name__ == "__main__":
    main()
