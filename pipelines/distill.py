"""One-process draft training straight from a corpus: the target computes features on the fly, nothing is stored.

This is how the shipped SmolLM2 draft is made on a CPU (`python -m jobs.distill`): every conversation is seen
once (ShareGPT holds far more tokens than a CPU trains on in hours, so fresh data beats epochs), the
target's features and soft labels come from a prefill of the corpus's own answers by default (a prefill costs
~40x less per token than generating on this CPU; `answers="regenerated"` or `"mix"` has the target rewrite the
assistant turns first), and training runs under bf16 autocast where the CPU has native bf16. The loop reads
top to bottom:

    vocab from token counts -> held-out set -> for each chunk of 32 conversations: (regenerate) ->
    for each packed batch: features, one TTT step, log, every `checkpoint_every` steps: evaluate, save
    state + draft (resumable) -> stop at `steps` or after `cpu_minutes` of CPU time -> final draft

The Ray jobs (`jobs/extract.py`, `jobs/train.py`) are the cluster path; this one is the single-machine path
and shares its pieces (`eagle_core.ttt.train_step`, `tokenize_conversation`, `capture_features`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path

import torch

from eagle_core.checkpoint import save_draft
from eagle_core.draft import DRAFT_KINDS, DraftConfig, Eagle3Draft
from eagle_core.features import regenerate_conversations
from eagle_core.target import cpu_has_native_bf16, load_target
from eagle_core.capture import capture_features
from eagle_core.ttt import (TrainConfig, load_train_state, make_optimizer, make_scheduler, train_state_dict,
                            train_step, ttt_forward)
from eagle_core.vocab import TokenCounter, build_vocab_mapping
from eagle_core.recipe import REFERENCE
from pipelines import console
from pipelines.cli import config_from_fields, option
from pipelines.storage import commit_bytes, replace_folder
from pipelines.train.model import warm_start


@dataclass
class DistillConfig:
    """One distillation run; also its command line (`python -m jobs.distill --help`, help from each field). The
    recipe's values (lr, ttt_steps, draft_vocab_size, max_length, tokens_per_batch) default to the reference
    recipe's here; jobs.distill fills them from the target's recipe unless given."""

    output: str = option("work/distill", "output folder: state, checkpoints and the final draft (rerun to resume)")
    target: str = option("smollm2-135m", "target model: a named target, a .gguf file, an HF folder or a hub id")
    corpus: str = option("sharegpt", "corpus URL (file, folder or glob); 'sharegpt' = the embedded ShareGPT file")
    max_length: int = option(REFERENCE.max_length, "tokens per training conversation (longer ones are cut)")
    min_loss_tokens: int = option(32, "skip conversations with fewer loss-masked tokens than this")
    tokens_per_batch: int = option(REFERENCE.tokens_per_batch, "padded tokens per optimiser step")
    steps: int = option(1000, "optimiser steps of the whole run (the cosine schedule spans them)")
    lr: float = option(TrainConfig.lr, "peak learning rate (AdamW)")
    warmup_steps: int = option(30, "linear warm-up steps")
    ttt_steps: int = option(DraftConfig.ttt_steps, "training-time-test steps")
    draft_vocab_size: int = option(DraftConfig.draft_vocab_size,
                                   "draft vocabulary: the most frequent loss-masked target tokens")
    vocab_conversations: int = option(4000, "conversations whose loss tokens choose the draft vocabulary")
    heldout: int = option(48, "the first usable conversations, set aside for evaluation and never trained on")
    lm_head_init: str = option("target", "draft lm_head init: 'target' (the target's rows, trainable: a head that "
                                         "starts where the target is) or 'random'")
    draft_kind: str = option("eagle3", "eagle3, eagle3.1 (EAGLE 3.1's two norms) or p-eagle (parallel drafting): eagle_core.draft.DRAFT_KINDS")
    checkpoint_every: int = option(50, "evaluate and save state + draft every N steps")
    threads: int | None = option(None, "torch threads (default: torch's choice)")
    autocast: str = option("auto", "'auto': bf16 autocast where the CPU (or GPU) has native bf16; 'off'")
    feature_dtype: str = option("auto", "target dtype for features: 'auto' = bfloat16 where native, else float32")
    seed: int = option(0, "draft init and data order")
    mlflow_experiment: str | None = option("eagle3-distill", "MLflow experiment")
    answers: str = option("corpus", "answers to learn from: 'corpus' (the corpus's own, prefill only), "
                                    "'regenerated' (the target rewrites them first) or 'mix' (every other one)")
    regen_max_new_tokens: int = option(256, "regeneration: tokens per rewritten reply")
    cpu_minutes: float | None = option(None, "stop after this much CPU time of work, summed over resumes "
                                             "(equal-CPU comparisons)")
    init_from: str | None = option(None, "warm start: an earlier draft (folder, fsspec URL or models:/ URI) whose "
                                         "weights seed this one; a fresh optimiser")
    first_conversation: int = option(0, "start the stream at this conversation after the held-out ones")

    def __post_init__(self):
        if self.answers not in ANSWERS:
            raise ValueError(f"answers must be one of {ANSWERS}, got {self.answers!r}")


ANSWERS = ("corpus", "regenerated", "mix")


def iter_messages(corpus: str):
    """The well-formed conversations of a corpus file in order, as message lists (malformed rows skipped)."""
    from pipelines.data import iter_file_records, resolve_corpus_url
    from pipelines.records import QuarantineError, normalize_record

    for record, error, _ in iter_file_records(resolve_corpus_url(corpus)):
        if error:
            continue
        try:
            yield normalize_record(record)[0]
        except QuarantineError:
            continue


def usable(tokenizer, messages: list[dict], max_length: int, min_loss_tokens: int):
    """(input_ids, loss_mask) of a conversation with at least `min_loss_tokens` loss tokens, else None."""
    from eagle_core.chat import NoChatTemplateError, TemplateError, tokenize_conversation

    try:
        tok = tokenize_conversation(tokenizer, messages, max_length=max_length)
    except NoChatTemplateError:
        raise  # no row can be rendered: skipping them all would train on nothing, silently
    except TemplateError:
        return None
    return (tok.input_ids, tok.loss_mask) if sum(tok.loss_mask) >= min_loss_tokens else None


def iter_usable(tokenizer, corpus: str, max_length: int, min_loss_tokens: int):
    """Tokenized conversations of a corpus file in order, those with at least `min_loss_tokens` loss tokens."""
    for messages in iter_messages(corpus):
        row = usable(tokenizer, messages, max_length, min_loss_tokens)
        if row is not None:
            yield row


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
                                        freeze_lm_head=False, **DRAFT_KINDS[cfg.draft_kind])
        draft.float()
        tcfg = config_from_fields(TrainConfig, cfg, total_steps=cfg.steps)  # lr, warmup_steps, ttt_steps
        opt = make_optimizer(draft, tcfg)
        sched = make_scheduler(opt, tcfg)
        progress = Progress(seen=cfg.first_conversation)
        if state.is_file():
            saved = torch.load(state, weights_only=True)
            progress.step = load_train_state(saved, draft, opt, sched)
            progress.seen, progress.cpu_s = int(saved["conversations_seen"]), float(saved.get("cpu_s", 0.0))
            progress.tokens = int(saved.get("tokens", 0))
            progress.run_id = saved.get("mlflow_run_id") or None
            print(f"[distill] resuming at step {progress.step} ({progress.seen} conversations seen)", flush=True)
        elif cfg.init_from:  # a warm start seeds a new run only; a resumed one has its own weights
            copied = warm_start(draft, cfg.init_from)
            print(f"[distill] warm start from {cfg.init_from}: {len(copied)} tensors", flush=True)
        return draft, tcfg, opt, sched, progress

    def save(self, draft, opt, sched, progress: "Progress", metrics):
        state = train_state_dict(draft, opt, sched, progress.step)
        state.update(conversations_seen=progress.seen, mlflow_run_id=progress.run_id or "",
                     cpu_s=progress.cpu_s, tokens=progress.tokens)
        # a temporary name of this save's own (never another process's), renamed over state.pt whole
        tmp = self.out / f"state.pt.tmp-{uuid.uuid4().hex[:8]}"
        try:
            torch.save(state, tmp)
            os.replace(tmp, self.out / "state.pt")
        finally:
            tmp.unlink(missing_ok=True)
        # the draft is written beside draft/ and swapped in whole: a reader (or a failed save) sees the old or the new
        staging = self.out / f"draft.tmp-{uuid.uuid4().hex[:8]}"
        try:
            save_draft(draft, staging, dtype=torch.bfloat16)
            info = {"step": progress.step, "conversations_seen": progress.seen, "cpu_s": round(progress.cpu_s, 1),
                    "tokens": progress.tokens, "config": asdict(self.cfg), **metrics}
            commit_bytes(str(staging / "training.json"), (json.dumps(info, indent=2) + "\n").encode())
            replace_folder(staging, self.out / "draft")
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def rows(self, chunk: list[list[dict]]) -> list[tuple[list[int], list[int]]]:
        """Training rows of a chunk of conversations, with the answers `cfg.answers` asks for."""
        cfg = self.cfg
        regen = [i for i in range(len(chunk)) if cfg.answers == "regenerated" or (cfg.answers == "mix" and i % 2 == 0)]
        if regen:
            rewritten, _ = regenerate_conversations(
                self.target, self.tokenizer, [{"id": str(i), "messages": chunk[i]} for i in regen],
                max_new_tokens=cfg.regen_max_new_tokens, seed=cfg.seed, max_length=cfg.max_length)
            chunk = list(chunk)
            for i in regen:
                chunk[i] = None
            for conv in rewritten:
                chunk[int(conv["id"])] = conv["messages"]
        rows = [usable(self.tokenizer, m, cfg.max_length, cfg.min_loss_tokens) for m in chunk if m is not None]
        return [r for r in rows if r is not None]

    def heldout(self, messages) -> list[dict]:
        """The first `cfg.heldout` usable conversations with the corpus's answers, never trained on."""
        cfg, rows = self.cfg, []
        while len(rows) < cfg.heldout:
            row = usable(self.tokenizer, next(messages), cfg.max_length, cfg.min_loss_tokens)
            if row is not None:
                rows.append(row)
        return [with_features(self.target, b) for b in pack(rows, cfg.tokens_per_batch)]

    def run(self):
        cfg = self.cfg
        draft, tcfg, opt, sched, progress = self.build()
        messages = iter_messages(cfg.corpus)
        heldout = self.heldout(messages)
        for _ in range(progress.seen):  # resume: skip what was trained on
            next(messages)
        tracker = _Tracker(cfg, progress.run_id)
        progress.run_id = tracker.run_id
        progress.start()
        bar = console.progress(total=cfg.steps, initial=progress.step, desc="[distill] steps", unit="step")
        while not progress.done(cfg):
            chunk = list(islice(messages, 32))
            if not chunk:
                print("[distill] corpus exhausted", flush=True)
                break
            progress.seen += len(chunk)
            for batch in pack(self.rows(chunk), cfg.tokens_per_batch):
                batch = with_features(self.target, batch)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                    metrics = train_step(draft, batch, self.head, opt, sched, tcfg)
                progress.advance(metrics["tokens"])
                metrics["tokens_per_cpu_s"] = progress.tokens_per_cpu_s()
                tracker.log(metrics, progress.step)
                bar.set_postfix_str(f"loss {metrics['loss']:.3f}", refresh=False)
                bar.update(1)
                if progress.step % 10 == 0:
                    accs = [round(metrics[f"acc_{k}"], 3) for k in range(cfg.ttt_steps)]
                    print(f"[distill] step {progress.step}/{cfg.steps} loss {metrics['loss']:.3f} acc {accs} "
                          f"{metrics['tokens_per_cpu_s']:.0f} tok/CPU-s, {progress.seen} conversations, "
                          f"{progress.cpu_s / 60:.1f} CPU min", flush=True)
                done = progress.done(cfg)
                if progress.step % cfg.checkpoint_every == 0 or done:
                    self.checkpoint(draft, opt, sched, progress, heldout, tracker, tcfg)
                if done:
                    break
        bar.close()
        if progress.saved_at != progress.step:  # stopped between checkpoints (corpus end)
            self.checkpoint(draft, opt, sched, progress, heldout, tracker, tcfg)
        tracker.close()
        return self.out / "draft"

    def checkpoint(self, draft, opt, sched, progress, heldout, tracker, tcfg):
        ev = evaluate(draft, heldout, self.head, tcfg.step_decay)
        tracker.log(ev, progress.step)
        print(f"[distill] held-out at step {progress.step}: "
              + " ".join(f"{v:.3f}" for k, v in ev.items() if k.startswith("heldout_acc")), flush=True)
        self.save(draft, opt, sched, progress, ev)
        progress.saved_at = progress.step
        progress.start()


@dataclass
class Progress:
    """Where a (resumable) distillation stands; `cpu_s` is the process's CPU time of work summed over resumes
    (CPU time, not wall time: recipes compared at equal CPU time stay comparable on a shared or paused machine)."""
    step: int = 0
    seen: int = 0  # conversations of the corpus consumed after the held-out ones
    cpu_s: float = 0.0
    tokens: int = 0
    run_id: str | None = None
    saved_at: int = -1
    _since: float = 0.0

    def start(self):
        """Count time from now (held-out evaluation and start-up are not work)."""
        self._since = time.process_time()

    def advance(self, tokens: int):
        now = time.process_time()
        self.step, self.tokens, self.cpu_s = self.step + 1, self.tokens + tokens, self.cpu_s + now - self._since
        self._since = now

    def tokens_per_cpu_s(self) -> float:
        return self.tokens / max(self.cpu_s, 1e-9)

    def done(self, cfg: DistillConfig) -> bool:
        return self.step >= cfg.steps or (cfg.cpu_minutes is not None and self.cpu_s >= 60 * cfg.cpu_minutes)


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
