"""TTT benchmarks.

  python -m bench.ttt                  # speed + peak memory: our TTT vs the naive full-mask TTT
  python -m bench.ttt --lm-head-init   # which lm_head init trains better on real SmolLM2 features

Speed: one training step (forward, backward, AdamW) of the SmolLM2-sized draft (H=576, the default draft vocab
and TTT steps of `DraftConfig`, batch 1) at each sequence length, in a fresh subprocess per (implementation, length) so
that the peak memory of one run is not hidden by another's. Peak memory is the process's peak RSS minus
its RSS just before the first step on CPU, and torch's peak allocation on CUDA. Results: bench/results/ttt.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import RESULTS, ROOT, add_draft_training_args, command, smollm2_recipe, write_json
from eagle_core.draft import DraftConfig, Eagle3Draft
from eagle_core.target import default_device, materialize_hf_folder
from eagle_core.ttt import TrainConfig, make_optimizer, ttt_forward, ttt_forward_naive

IMPLS = {"ours": ttt_forward, "naive": ttt_forward_naive}


# ---------------------------------------------------------------------------------------------------
# speed and memory of one training step


def smollm2_config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(materialize_hf_folder("smollm2-135m"))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def random_batch(tc, length: int, device: str) -> dict:
    """A batch of random features of the target `tc`'s shapes, batch 1, `length` positions."""
    g = torch.Generator().manual_seed(1)
    h = tc.hidden_size
    batch = dict(
        input_ids=torch.randint(0, tc.vocab_size, (1, length), generator=g),
        loss_mask=torch.ones(1, length, dtype=torch.long),
        aux_hidden=torch.randn(1, length, 3 * h, generator=g),
        target_last_hidden=torch.randn(1, length, h, generator=g),
        target_lm_head_weight=torch.randn(tc.vocab_size, h, generator=g) * 0.02,
    )
    return {k: v.to(device) for k, v in batch.items()}


def time_steps(step, iters: int, device: str) -> tuple[list[float], list[float]]:
    """(wall seconds, process CPU seconds) of each of `iters` calls of `step`."""
    times, cpu_times = [], []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        # CPU seconds of this process (all threads): what a step costs, whatever else the machine runs.
        cpu_times.append(time.process_time() - c0)
    return times, cpu_times


def run_one(impl: str, length: int, iters: int, warmup: int, device: str, mem_limit_gib: float) -> dict:
    """Time `iters` training steps (after `warmup` untimed ones) of `impl` at `length`; runs inside the child."""
    if device == "cpu" and mem_limit_gib > 0:
        # Fail an allocation cleanly instead of pushing a shared machine into swap or the OOM killer.
        limit = int(mem_limit_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    torch.manual_seed(0)
    tc = smollm2_config()
    recipe = smollm2_recipe()
    cfg = DraftConfig.from_target(tc, draft_vocab_size=recipe.draft_vocab_size, ttt_steps=recipe.ttt_steps)
    draft = Eagle3Draft(cfg).to(device).train()
    opt = make_optimizer(draft, TrainConfig(lr=recipe.lr))
    batch = random_batch(tc, length, device)

    def step():
        out = IMPLS[impl](draft, **batch)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        return float(out.loss)

    base_rss = _rss_bytes()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
    for _ in range(warmup):  # allocator, AdamW state, CUDA kernels
        step()
    times, cpu_times = time_steps(step, iters, device)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "impl": impl, "seq_len": length, "ttt_steps": cfg.ttt_steps, "draft_vocab_size": cfg.draft_vocab_size,
        "iters": iters, "warmup": warmup,
        "load_avg_1min_after": os.getloadavg()[0],
        "step_seconds": min(times), "step_seconds_all": times,
        "step_cpu_seconds": min(cpu_times), "threads": torch.get_num_threads(),
        "tokens_per_s": length / min(times),
        "tokens_per_cpu_s": length / min(cpu_times),
        "peak_mem_bytes": (torch.cuda.max_memory_allocated() - base_cuda) if device == "cuda"
        else peak_rss - base_rss,
        "peak_rss_bytes": peak_rss,
    }


def run_child(impl: str, length: int, args) -> dict:
    cmd = [sys.executable, "-m", "bench.ttt", "--child", impl, str(length), "--iters", str(args.iters), "--device",
           args.device, "--warmup", str(args.warmup), "--mem-limit-gib", str(args.mem_limit_gib)]
    timeout = args.timeout
    # OpenMP threads spin while waiting by default; on a shared, oversubscribed CPU that spinning costs
    # 50-80x on small ops and is billed as CPU time, so neither wall nor CPU seconds would mean anything.
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "seq_len": length, "error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["?"]
        oom = proc.returncode < 0 or "alloc" in tail[0].lower() or "memory" in tail[0].lower()
        reason = f"out of memory (limit {args.mem_limit_gib} GiB): {tail[0][:200]}" if oom else tail[0][:300]
        return {"impl": impl, "seq_len": length, "error": reason}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def speed_ratios(rows: list[dict]) -> list[dict]:
    """Per sequence length: ours against naive (CPU time, wall time, peak memory), or a note if a side failed."""
    ratios = []
    for length in sorted({r["seq_len"] for r in rows}):
        ours = next((r for r in rows if r["seq_len"] == length and r["impl"] == "ours"), {"error": "not run"})
        naive = next((r for r in rows if r["seq_len"] == length and r["impl"] == "naive"), {"error": "not run"})
        if "error" in ours or "error" in naive:
            ratios.append({"seq_len": length, "note": "one side failed; see runs"})
            continue
        ratios.append({
            "seq_len": length,
            "speedup_ours_over_naive_cpu_time": naive["step_cpu_seconds"] / ours["step_cpu_seconds"],
            "speedup_ours_over_naive_wall": naive["step_seconds"] / ours["step_seconds"],
            "peak_mem_ratio_ours_over_naive": ours["peak_mem_bytes"] / naive["peak_mem_bytes"],
            "ours_tokens_per_s": ours["tokens_per_s"], "naive_tokens_per_s": naive["tokens_per_s"],
            "ours_peak_mem_mib": ours["peak_mem_bytes"] / 2**20, "naive_peak_mem_mib": naive["peak_mem_bytes"] / 2**20,
        })
    return ratios


def bench_speed(args, out_path):
    # Runs at other lengths already in the file are kept (`--lengths 2048` can be added to a file later), if they
    # measured the same draft shape.
    previous = json.loads(Path(out_path).read_text())["runs"] if Path(out_path).is_file() else []
    recipe = smollm2_recipe()
    shape = {"ttt_steps": recipe.ttt_steps, "draft_vocab_size": recipe.draft_vocab_size}
    rows = [r for r in previous if (r["seq_len"], r["impl"]) not in {(n, i) for n in args.lengths for i in args.impls}
            and all(r.get(k) == v for k, v in shape.items())]
    for length in args.lengths:
        for impl in args.impls:
            row = run_child(impl, length, args)
            row["command"] = command("ttt")
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "what": "one TTT training step (fwd+bwd+AdamW), SmolLM2-sized draft (H=576, 9 heads, 3 kv heads), "
                f"draft vocab {shape['draft_vocab_size']}, target vocab 49152, ttt_steps {shape['ttt_steps']}, batch 1",
        "device": args.device, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "load_avg_1min_at_end": os.getloadavg()[0],
        "note": "the machine is shared (other engineers' tests ran meanwhile): the speed ratio is taken on "
                "process CPU seconds, which contention inflates far less than wall time; read wall-clock "
                "numbers with the load averages recorded per run",
        "command": "python -m bench.ttt  (per-length commands are kept in each run)",
        "peak_memory": "CPU: peak RSS minus RSS before the first step (includes allocator slack); "
                       "CUDA: torch.cuda.max_memory_allocated minus the allocation before the first step",
        "summary": speed_ratios(rows), "runs": rows,
    }
    write_json(out_path, result)
    return result


# ---------------------------------------------------------------------------------------------------
# lm_head init comparison on real SmolLM2 features


def smollm2_feature_batches(model, tokenizer, n_conversations: int, max_length: int, skip: int = 0):
    """[(batch dict)] from the first conversations of the embedded ShareGPT corpus, one per conversation."""
    from pipelines.extract import local_feature_batches

    return local_feature_batches(model, tokenizer, n_conversations, max_length, skip=skip)


def evaluate(draft, batches, head, ttt_steps):
    """Per-step accuracy over all batches (masked positions pooled), in eval mode."""
    draft.eval()
    hits = counts = 0
    with torch.no_grad():
        for b in batches:
            out = ttt_forward(draft, b["input_ids"], b["loss_mask"], b["aux_hidden"], b["last_hidden"], head,
                              ttt_steps=ttt_steps, targets=b.get("targets"))
            hits = hits + out.step_accuracies * out.step_counts
            counts = counts + out.step_counts
    return (hits / counts.clamp(min=1)).tolist()


LM_HEAD_VARIANTS = {
    "random": dict(lm_head_init="random"),
    "target_frozen": dict(lm_head_init="target", freeze_lm_head=True),
    "target_trainable": dict(lm_head_init="target", freeze_lm_head=False),
}


def lm_head_data(n_train: int, n_eval: int, max_length: int, draft_vocab_size: int):
    """(target, train batches, held-out batches, lm_head, d2t, t2d); batches carry the target's distribution."""
    from eagle_core.target import load_target
    from eagle_core.ttt import with_targets
    from eagle_core.vocab import TokenCounter, build_vocab_mapping

    model, tokenizer = load_target("smollm2-135m", device="cpu", dtype=torch.float32)
    train = smollm2_feature_batches(model, tokenizer, n_train, max_length)
    held_out = smollm2_feature_batches(model, tokenizer, n_eval, max_length, skip=n_train)
    counter = TokenCounter(model.config.vocab_size)
    for b in train:
        counter.update(b["input_ids"], b["loss_mask"])
    d2t, t2d = build_vocab_mapping(counter, draft_vocab_size)
    head = model.get_output_embeddings().weight
    # Every batch is revisited many times: compute the target's distribution once.
    train = [with_targets(b, head, d2t) for b in train]
    held_out = [with_targets(b, head, d2t) for b in held_out]
    return model, train, held_out, head, d2t, t2d


def train_variant(kw: dict, data, steps: int, ttt_steps: int, draft_vocab_size: int) -> dict:
    """Train one lm_head variant for `steps` and measure it on the training and held-out batches."""
    from eagle_core.ttt import simulated_accept_length, train_draft_steps

    model, train, held_out, head, d2t, t2d = data
    torch.manual_seed(0)
    draft = Eagle3Draft.from_target(model, draft_vocab_size=draft_vocab_size, d2t=d2t, t2d=t2d,
                                    ttt_steps=ttt_steps, **kw)
    cfg = TrainConfig(lr=smollm2_recipe().lr, warmup_steps=steps // 10, total_steps=steps, ttt_steps=ttt_steps)
    t0 = time.perf_counter()
    history = train_draft_steps(draft, train, head, cfg)
    seconds = time.perf_counter() - t0
    eval_acc = evaluate(draft, held_out, head, ttt_steps)
    return {
        "final_train_loss_avg_last_20": sum(h["loss"] for h in history[-20:]) / min(20, len(history)),
        "train_acc": evaluate(draft, train, head, ttt_steps), "held_out_acc": eval_acc,
        "held_out_accept_length": simulated_accept_length(eval_acc),
        "trainable_params": draft.num_trainable(), "seconds": seconds,
    }


def bench_lm_head_init(steps: int, out_path, n_train: int, n_eval: int, max_length: int, ttt_steps: int,
                       draft_vocab_size: int, only: list[str] | None = None):
    torch.set_num_threads(max(1, torch.get_num_threads()))
    data = lm_head_data(n_train, n_eval, max_length, draft_vocab_size)
    # Variants already in the file are kept, so they can be measured one invocation at a time.
    results = json.loads(Path(out_path).read_text())["variants"] if Path(out_path).is_file() else {}
    for name, kw in LM_HEAD_VARIANTS.items():
        if only and name not in only:
            continue
        results[name] = train_variant(kw, data, steps, ttt_steps, draft_vocab_size)
        print(name, json.dumps(results[name]), flush=True)
    train, held_out = data[1], data[2]
    result = {
        "what": f"{steps} AdamW steps (lr {smollm2_recipe().lr:g}, warm-up + cosine) on {len(train)} SmolLM2 conversations "
                f"(<= {max_length} tokens each, batch 1), ttt_steps {ttt_steps}, draft vocab {draft_vocab_size}; "
                f"accuracy = top-1 agreement with the target, per TTT step, on {len(held_out)} held-out conversations",
        "command": command("ttt"),
        "variants": results,
    }
    write_json(out_path, result)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048], help="sequence lengths to time")
    p.add_argument("--impls", nargs="+", default=["ours", "naive"], choices=list(IMPLS),
                   help="TTT implementations to time")
    p.add_argument("--iters", type=int, default=1, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: 1 on CUDA, 0 on CPU)")
    p.add_argument("--device", default=default_device(), help="torch device")
    p.add_argument("--mem-limit-gib", type=float, default=12.0, help="per-run memory cap on CPU (0 = none)")
    p.add_argument("--timeout", type=float, default=420, help="seconds per (implementation, length) run")
    p.add_argument("--out", default=None,
                   help="result JSON file (default: bench/results/ttt.json, or lm_head_init.json)")
    p.add_argument("--lm-head-init", action="store_true", help="compare lm_head initialisations instead")
    add_draft_training_args(p, steps=200, max_length=128)
    p.add_argument("--n-train", type=int, default=6, help="--lm-head-init: training conversations")
    p.add_argument("--n-eval", type=int, default=4, help="--lm-head-init: held-out conversations")
    p.add_argument("--variants", nargs="+", default=None, choices=list(LM_HEAD_VARIANTS),
                   help="lm_head inits to run (default: all)")
    p.add_argument("--child", nargs=2, metavar=("IMPL", "LENGTH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup is None:
        args.warmup = 1 if args.device == "cuda" else 0
    if args.child:
        print(json.dumps(run_one(args.child[0], int(args.child[1]), args.iters, args.warmup, args.device,
                                 args.mem_limit_gib)))
        return
    if args.lm_head_init:
        bench_lm_head_init(args.steps, args.out or RESULTS / "lm_head_init.json", args.n_train,
                           args.n_eval, args.max_length, args.ttt_steps, args.draft_vocab_size, args.variants)
        return
    bench_speed(args, args.out or RESULTS / "ttt.json")


if __name__ == "__main__":
    main()
