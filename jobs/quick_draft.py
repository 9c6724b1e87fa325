"""Train a quick EAGLE-3 draft for SmolLM2 on a few hundred ShareGPT conversations (single process, CPU ok).

  python jobs/quick_draft.py --out work/drafts/smollm2-quick [--conversations 300 --steps 600]

A stand-in until the Ray training job produces a real draft: features of the target on the embedded
ShareGPT corpus (original assistant turns, no regeneration), the draft vocabulary from their loss-masked
token counts, TTT training with `eagle_core.ttt`, saved with `eagle_core.checkpoint.save_draft`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle_core.checkpoint import save_draft  # noqa: E402
from eagle_core.draft import Eagle3Draft  # noqa: E402
from eagle_core.target import load_target  # noqa: E402
from eagle_core.ttt import TrainConfig, train_draft_steps  # noqa: E402
from eagle_core.vocab import TokenCounter, build_vocab_mapping  # noqa: E402


def feature_batches(model, tokenizer, n: int, max_length: int, min_loss_tokens: int = 32):
    from pipelines.extract import local_feature_batches

    return local_feature_batches(model, tokenizer, n, max_length, min_loss_tokens, progress="quick_draft")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "work" / "drafts" / "smollm2-quick"))
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--max-length", type=int, default=384)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ttt-steps", type=int, default=4)
    p.add_argument("--draft-vocab-size", type=int, default=8000)
    p.add_argument("--threads", type=int, default=1, help="1 is fastest on a shared 2-core machine")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model, tokenizer = load_target("smollm2-135m", device="cpu", dtype=torch.float32)
    t0 = time.perf_counter()
    batches = feature_batches(model, tokenizer, args.conversations, args.max_length)
    t_features = time.perf_counter() - t0
    counter = TokenCounter(model.config.vocab_size)
    for b in batches:
        counter.update(b["input_ids"], b["loss_mask"])
    d2t, t2d = build_vocab_mapping(counter, args.draft_vocab_size)
    draft = Eagle3Draft.from_target(model, draft_vocab_size=args.draft_vocab_size, d2t=d2t, t2d=t2d,
                                    ttt_steps=args.ttt_steps, lm_head_init="target")
    cfg = TrainConfig(lr=args.lr, warmup_steps=args.steps // 10, total_steps=args.steps, ttt_steps=args.ttt_steps)
    head = model.get_output_embeddings().weight

    stop_file = Path(args.out + ".STOP")  # touch it to end training early (the draft is still saved)

    def log(step, metrics):
        if step % 25 == 0 or step == args.steps:
            accs = [round(metrics[f"acc_{k}"], 3) for k in range(args.ttt_steps) if f"acc_{k}" in metrics]
            print(f"[quick_draft] step {step} loss {metrics['loss']:.3f} acc {accs} "
                  f"accept_length~{metrics.get('accept_length', 0):.2f} ({time.perf_counter() - t1:.0f}s)", flush=True)
        return stop_file.exists()

    t1 = time.perf_counter()
    history = train_draft_steps(draft, batches, head, cfg, on_step=log)
    t_train = time.perf_counter() - t1
    draft.eval()
    out = Path(args.out)
    save_draft(draft, out)
    info = dict(conversations=len(batches), max_length=args.max_length, steps=len(history), lr=args.lr,
                ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab_size, lm_head_init="target",
                feature_seconds=round(t_features), train_seconds=round(t_train),
                final_loss_avg_last_25=sum(h["loss"] for h in history[-25:]) / min(25, len(history)),
                command="python jobs/quick_draft.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    (out / "quick_draft.json").write_text(json.dumps(info, indent=2, default=str))
    print(f"[quick_draft] saved {out}: {json.dumps(info, default=str)}", flush=True)


if __name__ == "__main__":
    main()
