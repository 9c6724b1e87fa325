"""One-process draft training straight from a corpus: the target computes features on the fly, nothing is stored.

This is how the shipped SmolLM2 draft is made on a CPU (`python -m jobs.distill`): every conversation is seen
once (ShareGPT holds far more tokens than a CPU trains on in hours, so fresh data beats epochs), the
target's features and soft labels come from a prefill of the corpus's own answers (no regeneration: a
prefill costs ~40x less per token than generating on this CPU), and training runs under bf16 autocast
where the CPU has native bf16. The loop reads top to bottom:

    vocab from token counts -> held-out set -> for each packed batch: features, one TTT step,
    log, every `checkpoint_every` steps: evaluate, save state + draft (resumable) -> final draft

The Ray jobs (`jobs/extract.py`, `jobs/train.py`) are the cluster path; this one is the single-machine path
and shares its pieces (`eagle_core.ttt.train_step`, `tokenize_conversation`, `capture_features`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eagle_core.checkpoint import save_draft
from eagle_core.draft import DraftConfig, Eagle3Draft
from eagle_core.target import capture_features, cpu_has_native_bf16, load_target
from eagle_core.ttt import (TrainConfig, load_train_state, make_optimizer, make_scheduler, train_state_dict,
                            train_step, ttt_forward)
from eagle_core.vocab import TokenCounter, build_vocab_mapping
from pipelines.cli import config_from_fields


@dataclass
class DistillConfig:
    output: str = "work/distill"
    target: str = "smollm2-135m"
    corpus: str = "sharegpt"
    max_length: int = 1024
    min_loss_tokens: int = 32
    tokens_per_batch: int = 2048  # padded tokens per optimiser step
    steps: int = 1000
    lr: float = TrainConfig.lr
    warmup_steps: int = 30
    ttt_steps: int = DraftConfig.ttt_steps
    draft_vocab_size: int = DraftConfig.draft_vocab_size
    vocab_conversations: int = 4000  # conversations whose loss tokens choose the draft vocabulary
    heldout: int = 48  # the first usable conversations, never trained on
    lm_head_init: str = "target"  # the target's rows, trainable: a head that starts where the target is
    checkpoint_every: int = 50
    threads: int | None = None
    autocast: str = "auto"  # "auto": bf16 where the CPU (or GPU) has native bf16; "off"
    feature_dtype: str = "auto"  # target dtype for features: "auto" = bfloat16 where native, else float32
    seed: int = 0
    mlflow_experiment: str | None = "eagle3-distill"


def iter_usable(tokenizer, corpus: str, max_length: int, min_loss_tokens: int):
    """Tokenized conversations of a corpus file in order, those with at least `min_loss_tokens` loss tokens."""
    from eagle_core.chat import TemplateError, tokenize_conversation
    from pipelines.data import QuarantineError, iter_file_records, normalize_record, resolve_corpus_url

    for record, error, _ in iter_file_records(resolve_corpus_url(corpus)):
        if error:
            continue
        try:
            tok = tokenize_conversation(tokenizer, normalize_record(record)[0], max_length=max_length)
        except (QuarantineError, TemplateError):
            continue
        if sum(tok.loss_mask) >= min_loss_tokens:
            yield tok.input_ids, tok.loss_mask


def pack(rows: list[tuple[list[int], list[int]]], tokens_per_batch: int):
    """Length-sorted rows grouped so that rows x longest <= tokens_per_batch; right-padded tensors."""
    rows = sorted(rows, key=lambda r: len(r[0]))
    group: list = []
    for row in rows + [None]:
        if row is not None and (len(group) + 1) * len(row[0]) <= tokens_per_batch:
            group.append(row)
            continue
        if group:
            L = max(len(r[0]) for r in group)
            ids = torch.zeros(len(group), L, dtype=torch.long)
            mask = torch.zeros(len(group), L, dtype=torch.long)
            attn = torch.zeros(len(group), L, dtype=torch.long)
            for i, (a, m) in enumerate(group):
                ids[i, :len(a)], mask[i, :len(m)], attn[i, :len(a)] = torch.tensor(a), torch.tensor(m), 1
            yield dict(input_ids=ids, loss_mask=mask, attention_mask=attn)
        group = [row] if row is not None else []


def with_features(target, batch: dict) -> dict:
    feats = capture_features(target, batch["input_ids"], batch["attention_mask"])
    return {**batch, "aux_hidden": feats.aux_hidden.float(), "last_hidden": feats.last_hidden.float()}


@torch.no_grad()
def evaluate(draft, batches: list[dict], head, step_decay: float) -> dict:
    """Held-out loss and per-step top-1 accuracy, weighted by positions."""
    draft.eval()
    hits = count = loss = 0.0
    for b in batches:
        out = ttt_forward(draft, b["input_ids"], b["loss_mask"], b["aux_hidden"], b["last_hidden"], head,
                          attention_mask=b["attention_mask"], step_decay=step_decay)
        hits = hits + out.step_accuracies * out.step_counts.clamp(min=1)
        count = count + out.step_counts
        loss += float(out.loss) * len(b["input_ids"])
    acc = (hits / count.clamp(min=1)).tolist()
    return {"heldout_loss": loss / sum(len(b["input_ids"]) for b in batches),
            **{f"heldout_acc_{k}": a for k, a in enumerate(acc)}}


class Distiller:
    def __init__(self, cfg: DistillConfig):
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        native = cpu_has_native_bf16()
        self.autocast = cfg.autocast == "auto" and native
        fdtype = torch.bfloat16 if cfg.feature_dtype == "auto" and native else torch.float32
        self.target, self.tokenizer = load_target(cfg.target, device="cpu", dtype=fdtype)
        # The head that gives soft labels stays float32 (the target distribution is the reference).
        self.head = self.target.get_output_embeddings().weight.float()
        self.out = Path(cfg.output)
        self.out.mkdir(parents=True, exist_ok=True)

    def build(self):
        cfg, state = self.cfg, self.out / "state.pt"
        counter = TokenCounter(self.target.config.vocab_size)
        for n, (ids, mask) in enumerate(iter_usable(self.tokenizer, cfg.corpus, cfg.max_length, cfg.min_loss_tokens)):
            if n >= cfg.vocab_conversations:
                break
            counter.update(torch.tensor([ids]), torch.tensor([mask]))
        d2t, t2d = build_vocab_mapping(counter, cfg.draft_vocab_size)
        torch.manual_seed(cfg.seed)
        draft = Eagle3Draft.from_target(self.target, draft_vocab_size=cfg.draft_vocab_size, d2t=d2t, t2d=t2d,
                                        ttt_steps=cfg.ttt_steps, lm_head_init=cfg.lm_head_init,
                                        freeze_lm_head=False)
        draft.float()
        tcfg = config_from_fields(TrainConfig, cfg, total_steps=cfg.steps)  # lr, warmup_steps, ttt_steps
        opt = make_optimizer(draft, tcfg)
        sched = make_scheduler(opt, tcfg)
        step, seen, run_id = 0, 0, None
        if state.is_file():
            saved = torch.load(state, weights_only=True)
            step = load_train_state(saved, draft, opt, sched)
            seen, run_id = int(saved["conversations_seen"]), saved.get("mlflow_run_id") or None
            print(f"[distill] resuming at step {step} ({seen} conversations seen)", flush=True)
        return draft, tcfg, opt, sched, step, seen, run_id

    def save(self, draft, opt, sched, step, seen, run_id, metrics):
        state = train_state_dict(draft, opt, sched, step)
        state.update(conversations_seen=seen, mlflow_run_id=run_id or "")
        tmp = self.out / "state.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.out / "state.pt")
        save_draft(draft, self.out / "draft", dtype=torch.bfloat16)
        info = {"step": step, "conversations_seen": seen, "config": asdict(self.cfg), **metrics}
        (self.out / "draft" / "training.json").write_text(json.dumps(info, indent=2) + "\n")

    def run(self):
        cfg = self.cfg
        draft, tcfg, opt, sched, step, seen, run_id = self.build()
        stream = iter_usable(self.tokenizer, cfg.corpus, cfg.max_length, cfg.min_loss_tokens)
        heldout_rows = [next(stream) for _ in range(cfg.heldout)]
        heldout = [with_features(self.target, b) for b in pack(heldout_rows, cfg.tokens_per_batch)]
        for _ in range(seen):  # resume: skip what was trained on
            next(stream)
        tracker = _Tracker(cfg, run_id)
        t0, tokens, metrics = time.perf_counter(), 0, {}
        while step < cfg.steps:
            rows = [r for _, r in zip(range(32), stream)]
            if not rows:
                print("[distill] corpus exhausted", flush=True)
                break
            seen += len(rows)
            for batch in pack(rows, cfg.tokens_per_batch):
                batch = with_features(self.target, batch)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                    metrics = train_step(draft, batch, self.head, opt, sched, tcfg)
                step += 1
                tokens += metrics["tokens"]
                metrics["tokens_per_s"] = tokens / (time.perf_counter() - t0)
                tracker.log(metrics, step)
                if step % 10 == 0:
                    accs = [round(metrics[f"acc_{k}"], 3) for k in range(cfg.ttt_steps)]
                    print(f"[distill] step {step}/{cfg.steps} loss {metrics['loss']:.3f} acc {accs} "
                          f"{metrics['tokens_per_s']:.0f} tok/s, {seen} conversations", flush=True)
                if step % cfg.checkpoint_every == 0 or step >= cfg.steps:
                    ev = evaluate(draft, heldout, self.head, tcfg.step_decay)
                    tracker.log(ev, step)
                    print(f"[distill] held-out at step {step}: "
                          + " ".join(f"{v:.3f}" for k, v in ev.items() if k.startswith("heldout_acc")), flush=True)
                    self.save(draft, opt, sched, step, seen, tracker.run_id, ev)
                if step >= cfg.steps:
                    break
        tracker.close()
        return self.out / "draft"


class _Tracker:
    """MLflow logging of a (resumable) run; a no-op without an experiment."""

    def __init__(self, cfg: DistillConfig, run_id: str | None):
        self.mlflow, self.run_id = None, run_id
        if cfg.mlflow_experiment:
            from pipelines import tracking

            self.mlflow = tracking.configure()
            exp = tracking.ensure_experiment(cfg.mlflow_experiment)
            run = self.mlflow.start_run(run_id=run_id, experiment_id=None if run_id else exp,
                                        run_name=f"distill-{Path(cfg.output).name}")
            self.run_id = run.info.run_id
            if not run_id:
                self.mlflow.log_params(asdict(cfg))

    def log(self, metrics: dict, step: int):
        if self.mlflow:
            self.mlflow.log_metrics({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def close(self):
        if self.mlflow:
            self.mlflow.end_run()
