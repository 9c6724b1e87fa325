"""GPU smoke test: the CUDA paths of eagle_core on one GPU, in a few minutes, with torch + transformers only.

    python tools/gpu_smoke.py            (or: make gpu-smoke)

No Ray, no MLflow, nothing from pipelines/: it runs on a bare CUDA box with torch and transformers. On a
machine without CUDA it says so and exits 0 (there is nothing to check). Checks, on a tiny random Llama
target (eagle_core.target.make_tiny_llama):

1. feature capture in bf16: the aux layers + final hidden state (eagle_core.capture.capture_features) are
   bf16, finite, and equal to transformers' own output_hidden_states;
2. a short TTT training run (eagle_core.ttt) on those features, on sequences the target itself sampled:
   the loss falls;
3. lossless tree decoding in fp32 (TF32 off): eagle_core.generate.generate with the trained draft gives the
   plain greedy loop's tokens (draft=None). Different kernel shapes sum in different orders, so a divergence
   is accepted only at a near-tie of the plain run (top-2 logits within 1e-4, the rule of
   tests/test_generate_smollm2.py); anything else fails;
4. bf16 decoding: the share of greedy tokens the tree run agrees on with the plain bf16 loop before the first
   divergence, and the mean accept length tau (reported, not asserted: bf16 ties are wide);
5. a world-size-1 torch.distributed NCCL all_reduce on a CUDA tensor.

Prints one summary line per check and a final JSON line; exits 1 if a check failed.

`--cpu-dry-run` runs the same code on the CPU with smaller sizes and gloo instead of NCCL (no GPU claim is
made): tests/test_gpu_smoke.py uses it so that the script keeps up with eagle_core's APIs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NEEDS_CUDA = "gpu-smoke: needs a CUDA GPU (torch.cuda.is_available() is False); nothing to check here, skipping"

# A small but not trivial target: every kernel path runs, the whole smoke test takes seconds on a GPU.
TARGET = dict(vocab_size=2048, hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=512, seed=0)
PROMPTS, PROMPT_LEN, SAMPLE_LEN = 64, 16, 112  # training sequences: 16 random tokens + 112 sampled by the target
TRAIN_STEPS, BATCH = 300, 16
DECODE_PROMPTS, MAX_NEW = 8, 64
TIE = 1e-4
DEVICE = "cuda"
DRY_RUN = dict(PROMPTS=8, SAMPLE_LEN=24, TRAIN_STEPS=20, BATCH=4, DECODE_PROMPTS=2, MAX_NEW=12,
               TARGET={**TARGET, "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "intermediate_size": 128})


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _tiny_target(dtype):
    from eagle_core.target import make_tiny_llama

    return make_tiny_llama(dtype=dtype, **TARGET).to(DEVICE)


def _random_prompts(n, length, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def check_features(target_bf16) -> tuple[dict, list]:
    """Sample training sequences with the bf16 target, capture their features in bf16."""
    from eagle_core.generate import generate
    from eagle_core.target import default_aux_layer_ids
    from eagle_core.capture import capture_features

    prompts = _random_prompts(PROMPTS, PROMPT_LEN, TARGET["vocab_size"], seed=1)
    sampled = generate(target_bf16, prompts, max_new_tokens=SAMPLE_LEN, temperature=0.8, seed=0)
    seqs = [p + t for p, t in zip(prompts, sampled.tokens)]
    length = min(len(s) for s in seqs)
    ids = torch.tensor([s[:length] for s in seqs], device=DEVICE)
    aux_ids = default_aux_layer_ids(TARGET["num_hidden_layers"])
    batches = []
    for i in range(0, len(ids), BATCH):
        chunk = ids[i:i + BATCH]
        feats = capture_features(target_bf16, chunk, aux_layer_ids=aux_ids)
        loss_mask = torch.zeros_like(chunk)
        loss_mask[:, PROMPT_LEN:] = 1  # the target's own continuation
        batches.append({"input_ids": chunk, "loss_mask": loss_mask, "aux_hidden": feats.aux_hidden,
                        "last_hidden": feats.last_hidden})
    with torch.no_grad():
        hs = target_bf16(input_ids=ids[:2], output_hidden_states=True).hidden_states
    first = batches[0]
    want = torch.cat([hs[j] for j in aux_ids], dim=-1)
    same = torch.equal(first["aux_hidden"][:2], want)
    ok = (first["aux_hidden"].dtype == torch.bfloat16 and same
          and all(torch.isfinite(b["aux_hidden"].float()).all() for b in batches))
    return {"ok": bool(ok), "dtype": str(first["aux_hidden"].dtype), "rows": len(ids), "tokens_per_row": length,
            "aux_layer_ids": aux_ids, "equals_output_hidden_states": bool(same)}, batches


def check_training(target_fp32, batches) -> tuple[dict, object]:
    from eagle_core.draft import Eagle3Draft
    from eagle_core.ttt import TrainConfig, train_draft_steps
    from eagle_core.vocab import TokenCounter, build_vocab_mapping

    counter = TokenCounter(TARGET["vocab_size"])
    for b in batches:
        counter.update(b["input_ids"].cpu(), b["loss_mask"].cpu())
    draft_vocab = TARGET["vocab_size"] // 2
    d2t, t2d = build_vocab_mapping(counter, draft_vocab)
    torch.manual_seed(0)
    draft = Eagle3Draft.from_target(target_fp32, draft_vocab_size=draft_vocab, d2t=d2t, t2d=t2d, ttt_steps=4,
                                    lm_head_init="target")
    fp32_batches = [{k: (v.float() if v.is_floating_point() else v) for k, v in b.items()} for b in batches]
    cfg = TrainConfig(lr=2e-3, warmup_steps=20, total_steps=TRAIN_STEPS, ttt_steps=4)
    head = target_fp32.get_output_embeddings().weight
    t0 = time.perf_counter()
    history = train_draft_steps(draft, fp32_batches, head, cfg)
    _sync()
    seconds = time.perf_counter() - t0
    draft.eval()
    first = sum(h["loss"] for h in history[:10]) / 10
    last = sum(h["loss"] for h in history[-10:]) / 10
    acc0 = sum(h.get("acc_0", 0.0) for h in history[-10:]) / 10
    return {"ok": bool(last < first and all(map(lambda h: h["loss"] == h["loss"], history))),
            "steps": len(history), "loss_first10": round(first, 4), "loss_last10": round(last, 4),
            "acc_0_last10": round(acc0, 3), "seconds": round(seconds, 1)}, draft


def _top2_gap(target, prefix: list[int]) -> float:
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prefix], device=DEVICE)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def check_lossless_fp32(target_fp32, draft) -> dict:
    from eagle_core.generate import generate
    from eagle_core.tree import TreeConfig

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    prompts = _random_prompts(DECODE_PROMPTS, PROMPT_LEN, TARGET["vocab_size"], seed=7)
    tree = TreeConfig(top_k=4, depth=5, total_tokens=24)
    plain = generate(target_fp32, prompts, draft=None, max_new_tokens=MAX_NEW)
    spec = generate(target_fp32, prompts, draft=draft, tree=tree, max_new_tokens=MAX_NEW)
    identical, ties, failures = 0, [], []
    for i, (a, b) in enumerate(zip(plain.tokens, spec.tokens)):
        if a == b:
            identical += 1
            continue
        pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        gap = _top2_gap(target_fp32, prompts[i] + a[:pos])
        (ties if gap < TIE else failures).append({"prompt": i, "position": pos, "top2_gap": gap})
    taus = [s.tau for s in spec.stats]
    return {"ok": not failures, "identical": f"{identical}/{len(prompts)}", "near_tie_divergences": ties,
            "failures": failures, "tau": round(sum(taus) / len(taus), 3), "tree": tree.__dict__}


def check_bf16_agreement(target_bf16, draft) -> dict:
    from eagle_core.generate import generate
    from eagle_core.tree import TreeConfig

    draft16 = copy.deepcopy(draft).to(torch.bfloat16)
    draft16.set_target_embeddings(target_bf16.get_input_embeddings().weight)
    prompts = _random_prompts(DECODE_PROMPTS, PROMPT_LEN, TARGET["vocab_size"], seed=7)
    plain = generate(target_bf16, prompts, draft=None, max_new_tokens=MAX_NEW)
    spec = generate(target_bf16, prompts, draft=draft16, tree=TreeConfig(top_k=4, depth=5, total_tokens=24),
                    max_new_tokens=MAX_NEW)
    agreed = total = 0
    for a, b in zip(plain.tokens, spec.tokens):
        prefix = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agreed += prefix
        total += len(a)
    taus = [s.tau for s in spec.stats]
    return {"ok": True, "token_agreement_before_first_divergence": round(agreed / max(total, 1), 3),
            "tau": round(sum(taus) / len(taus), 3)}


def check_nccl() -> dict:
    import torch.distributed as dist

    backend = "nccl" if DEVICE == "cuda" else "gloo"
    if backend == "nccl" and not dist.is_nccl_available():
        return {"ok": False, "error": "torch.distributed has no NCCL backend in this build"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        x = torch.arange(4, dtype=torch.float32, device=DEVICE) + 1
        dist.all_reduce(x)  # sum over one rank: unchanged
        _sync()
        ok = torch.equal(x.cpu(), torch.tensor([1.0, 2.0, 3.0, 4.0]))
        version = ".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else "-"
    finally:
        dist.destroy_process_group()
    return {"ok": bool(ok), "backend": backend, "nccl": version}


def main(argv=None) -> int:
    global DEVICE
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-dry-run", action="store_true", help="exercise the script on the CPU (small sizes, gloo)")
    args = p.parse_args(argv)
    if args.cpu_dry_run:
        DEVICE = "cpu"
        globals().update(DRY_RUN)
    elif not torch.cuda.is_available():
        print(NEEDS_CUDA, flush=True)
        return 0
    import transformers

    started = time.perf_counter()
    torch.manual_seed(0)
    device = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (dry run)"
    print(f"[gpu-smoke] {device}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
          f"transformers {transformers.__version__}", flush=True)
    results = {}

    def run(name, fn, *args):
        t0 = time.perf_counter()
        try:
            out = fn(*args)
        except Exception as err:  # a smoke test reports every check, even after one breaks
            out = ({"ok": False, "error": f"{type(err).__name__}: {err}"}, None)
            if name not in ("features", "training"):
                out = out[0]
        result = out[0] if isinstance(out, tuple) else out
        result["seconds"] = result.get("seconds", round(time.perf_counter() - t0, 1))
        results[name] = result
        print(f"[gpu-smoke] {name:10s} {'ok  ' if result['ok'] else 'FAIL'} "
              f"{json.dumps({k: v for k, v in result.items() if k != 'ok'})}", flush=True)
        return out[1] if isinstance(out, tuple) else None

    target_bf16 = _tiny_target(torch.bfloat16)
    target_fp32 = _tiny_target(torch.float32)
    batches = run("features", check_features, target_bf16)
    draft = run("training", check_training, target_fp32, batches) if batches else None
    if draft is not None:
        run("lossless", check_lossless_fp32, target_fp32, draft)
        run("bf16", check_bf16_agreement, target_bf16, draft)
    run("nccl", check_nccl)
    ok = all(r["ok"] for r in results.values()) and draft is not None
    summary = {"ok": ok, "device": device, "seconds": round(time.perf_counter() - started, 1),
               "peak_memory_mib": round(torch.cuda.max_memory_allocated() / 2**20) if DEVICE == "cuda" else None,
               **{name: r["ok"] for name, r in results.items()}}
    print(f"[gpu-smoke] {'PASSED' if ok else 'FAILED'} {json.dumps(summary)}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
