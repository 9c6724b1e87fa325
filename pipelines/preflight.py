"""A plan before the spend (`jobs/extract.py --dry-run`, `jobs/train.py --dry-run`): what a run will read, store and
use, computed without Ray, without weights and without a GPU.

    rows and tokens        the corpus read in this process (up to --limit); tokens are the chat template's, counted
                           on the first `sample_rows` usable rows and scaled to all of them
    feature bytes          4 x H x dtype bytes per token (three aux layers and the last hidden state)
    GPUs per target copy   from the weights' size in bf16 (eagle_core.recipe.gpus_for_weights) and the recipe's
    steps                  tokens x epochs / tokens_per_batch (train)
    the recipe in force    and why

The target is checked by building its model from its config on the meta device (`TargetShape.of`), the recipe
by loading and validating it; either failing stops the plan with the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from eagle_core.recipe import Recipe, TargetShape, gpus_for_weights

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Above this, storing features is the wrong default: stream them instead (jobs/train.py --corpus).
STREAMING_ABOVE_BYTES = 1 << 40  # 1 TiB
SAMPLE_ROWS = 256


@dataclass
class CorpusCount:
    rows: int  # usable conversations (well-formed, rendered by the template, with loss tokens)
    read: int  # records read
    tokens: int  # estimated over all usable rows (exact when sampled == rows)
    loss_tokens: int
    sampled: int  # rows actually tokenized

    @property
    def exact(self) -> bool:
        return self.sampled == self.rows


def count_corpus(corpus: str, tokenizer, max_length: int, limit: int | None = None,
                 sample_rows: int = SAMPLE_ROWS) -> CorpusCount:
    """Rows of a corpus (every file, in order, up to `limit` records) and their tokens under the target's chat
    template, cut at `max_length`: the first `sample_rows` usable rows are tokenized, the rest counted and scaled.
    A tokenizer without a chat template raises NoChatTemplateError (nothing could be extracted)."""
    from pipelines.data import iter_file_records, list_corpus_files, resolve_corpus_url
    from pipelines.distill import usable
    from pipelines.records import QuarantineError, normalize_record

    read = rows = sampled = tokens = loss_tokens = unsampled = 0
    for path in list_corpus_files(resolve_corpus_url(corpus)):
        for record, error, _ in iter_file_records(path, None if limit is None else limit - read):
            read += 1
            if error:
                continue
            try:
                messages = normalize_record(record)[0]
            except QuarantineError:
                continue
            if sampled >= sample_rows:
                rows += 1
                unsampled += 1
                continue
            row = usable(tokenizer, messages, max_length, 1)  # a template error skips the row, none stops
            if row is None:
                continue
            rows += 1
            sampled += 1
            tokens += len(row[0])
            loss_tokens += sum(row[1])
        if limit is not None and read >= limit:
            break
    if sampled and unsampled:
        # rows past the sample count as usable: the sample's usable share is not applied to them
        tokens = round(tokens * rows / sampled)
        loss_tokens = round(loss_tokens * rows / sampled)
    return CorpusCount(rows=rows, read=read, tokens=tokens, loss_tokens=loss_tokens, sampled=sampled)


def target_tokenizer(target: str):
    """The target's tokenizer, without its weights."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from eagle_core.target import NAMED_TARGETS, is_remote, materialize_hf_folder

    spec = str(target)
    if spec in NAMED_TARGETS or (spec.endswith(".gguf") and not is_remote(spec)):
        return AutoTokenizer.from_pretrained(materialize_hf_folder(spec))
    if not is_remote(spec) and Path(spec.removeprefix("file://")).is_dir():
        return AutoTokenizer.from_pretrained(spec.removeprefix("file://"))
    if is_remote(spec):
        raise ValueError(f"--dry-run reads a remote target's tokenizer only from a local copy; got {spec!r}")
    from huggingface_hub import snapshot_download

    return AutoTokenizer.from_pretrained(snapshot_download(spec, allow_patterns=[
        "*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]))


def feature_dtype(dtype: str, gpus: bool) -> str:
    """The dtype features are stored in: the target's compute dtype ("auto": bf16 on GPUs, on a CPU what
    eagle_core.target.resolve_dtype picks here)."""
    if dtype != "auto":
        return dtype
    if gpus:
        return "bfloat16"
    from eagle_core.target import resolve_dtype

    return str(resolve_dtype("auto", "cpu")).removeprefix("torch.")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


@dataclass
class RunPlan:
    job: str  # "extract" or "train"
    target: str
    shape: TargetShape
    recipe: Recipe
    corpus: str | None
    count: CorpusCount | None  # from the corpus (None in features mode, where `rows`/`tokens` are the manifest's)
    rows: int
    tokens: int
    dtype: str
    target_copies: int  # extraction actors (one target copy each)
    gpus_per_target: int  # in force: --gpus-per-worker, else the recipe's
    gpu_memory_gib: float
    epochs: int | None = None
    eval_fraction: float = 0.0
    tokens_per_batch: int | None = None
    max_steps: int | None = None
    pack_length: int | str | None = None  # training: packed rows of this many tokens, "longest" or None (one per row)
    micro_batch_tokens: int | None = None  # training: a worker's share of a step in micro-batches of this many tokens
    train_workers: int = 1  # training: Ray Train workers (data parallel)
    strategy: str = "ddp"
    streaming: bool = False
    recipe_max_length: int = 0  # the max length in force (rows are cut there when counted)
    has_data: bool = True  # False: a plan for target and recipe alone
    engine: str = "hf"  # what runs the target copies (pipelines.engines)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    notes: list[str] = field(default_factory=list)

    @property
    def bytes_per_token(self) -> int:
        return 4 * self.shape.hidden_size * DTYPE_BYTES[self.dtype]

    @property
    def feature_bytes(self) -> int:
        return self.bytes_per_token * self.tokens

    @property
    def gpus_needed(self) -> int:
        return gpus_for_weights(self.shape.bf16_weight_bytes, self.gpu_memory_gib)

    @property
    def steps(self) -> int | None:
        if self.job != "train":
            return None
        per_epoch = math.ceil(self.tokens * (1 - self.eval_fraction) / self.tokens_per_batch)
        total = per_epoch * self.epochs
        return min(total, self.max_steps) if self.max_steps is not None else total

    def advice(self) -> list[str]:
        from eagle_core.recipe import recipe_naming

        out = list(self.notes)
        if self.job == "train" and isinstance(self.pack_length, int) and self.count is not None and \
                self.recipe_max_length > self.pack_length:
            out.append(f"conversations are cut at {self.recipe_max_length} tokens, more than --pack-length "
                       f"{self.pack_length}: a longer one is refused when the run is planned")
        named = recipe_naming(self.target)
        if self.recipe.targets and (named is None or named.name != self.recipe.name):
            out.append(f"recipe {self.recipe.name} is for {', '.join(self.recipe.targets)}, not {self.target}")
        if self.gpus_per_target < self.gpus_needed:
            out.append(f"the target's bf16 weights ({human_bytes(self.shape.bf16_weight_bytes)}) need "
                       f"{self.gpus_needed} GPU(s) of {self.gpu_memory_gib:g} GiB per copy, not {self.gpus_per_target}:"
                       f" set --gpus-per-worker {self.gpus_needed}")
        if not self.streaming and self.feature_bytes >= STREAMING_ABOVE_BYTES:
            out.append(f"features would take {human_bytes(self.feature_bytes)}: streaming training (jobs/train.py "
                       "--corpus) computes them on the fly and stores nothing; it is the better choice here")
        elif not self.streaming and self.job == "train" and self.corpus is not None and self.epochs == 1:
            out.append("one epoch reads each feature once: streaming (--corpus) avoids storing them")
        return out

    def engine_line(self, tag: str) -> str:
        parallel = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.engine == "hf":
            return f"{tag} engine: hf (transformers in each actor)"
        from pipelines.engines.vllm import vllm_version

        how = ("one process per actor (the engine core in the actor)" if parallel == 1 else
               f"{parallel} vLLM worker processes per actor, one per GPU of the actor's node")
        return (f"{tag} engine: vllm {vllm_version() or '(not installed here)'}, tensor_parallel_size "
                f"{self.tensor_parallel_size} x pipeline_parallel_size {self.pipeline_parallel_size} = {parallel} "
                f"GPU(s) per target copy, all on one node (Ray actor num_gpus={parallel}); {how}; "
                f"{self.target_copies} copies need {self.target_copies * parallel} GPUs")

    def lines(self) -> list[str]:
        tag = f"[{self.job}]"
        s = self.shape
        rows = f"{self.rows} rows, {self.tokens:,} tokens"
        if self.count is not None:
            how = "counted" if self.count.exact else f"estimated from the first {self.count.sampled} rows"
            rows += f" ({self.count.read} records read; tokens {how}, cut at {self.recipe_max_length} each)"
        data = f"{tag} data: {self.corpus or 'features'}: {rows}" if self.has_data else f"{tag} data: none given"
        size = ""
        if self.has_data:
            size = f" -> {human_bytes(self.feature_bytes)}" + (" (streamed: nothing stored)" if self.streaming
                                                              else " on disk")
        out = [
            f"{tag} plan (dry run: nothing computed, nothing written)",
            f"{tag} target: {self.target}: {s.model_type}, {s.parameters / 1e9:.2f}B parameters, hidden "
            f"{s.hidden_size}, {s.num_hidden_layers} layers, vocabulary {s.vocab_size} (config and meta-device model "
            "load: ok)",
            f"{tag} recipe: {self.recipe.summary()}",
            f"{tag} recipe chosen: {self.recipe.why}; source: {self.recipe.source}",
            data,
            f"{tag} features: {self.bytes_per_token:,} bytes per token (4 x {s.hidden_size} x {self.dtype}){size}",
            f"{tag} GPUs per target copy: {self.gpus_per_target} in force, {self.gpus_needed} needed by "
            f"{human_bytes(s.bf16_weight_bytes)} of bf16 weights on {self.gpu_memory_gib:g} GiB GPUs; "
            + (f"{self.target_copies} target copies" if self.count is not None or not self.has_data else
               "used by extraction and serving (training from features loads only the target's embeddings and "
               "lm_head)"),
        ]
        if self.engine != "hf" or self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            out.append(self.engine_line(tag))
        if self.job == "train" and self.has_data:
            out.append(f"{tag} steps: {self.steps:,} ({self.epochs} epoch(s) of {1 - self.eval_fraction:.0%} of the "
                       f"tokens, {self.tokens_per_batch:,} tokens per step"
                       + (f", capped by --max-steps {self.max_steps}" if self.max_steps is not None else "") + ")")
        if self.job == "train":
            if isinstance(self.pack_length, int):
                rows = f"several conversations packed into each row of {self.pack_length:,} tokens"
            elif self.pack_length:
                rows = "several conversations packed into each row, as long as the step's longest conversation"
            else:
                rows = "one conversation per row, right-padded to the step's longest"
            out.append(f"{tag} rows: {rows}" + (" (--pack-length; attention kept inside each conversation)"
                                                if self.pack_length else " (--pack-length none)"))
            share = f"~{self.tokens_per_batch // self.train_workers:,} tokens" if self.tokens_per_batch else "its share"
            how = ("in one forward and backward (--micro-batch-tokens splits it)" if self.micro_batch_tokens is None
                   else f"in micro-batches of at most {self.micro_batch_tokens:,} tokens, gradients summed before the "
                   "step (--micro-batch-tokens: the same step in less activation memory)")
            out.append(f"{tag} workers: {self.train_workers} ({self.strategy}), each runs {share} of a step {how}")
        out += [f"{tag} note: {a}" for a in self.advice()]
        return out


def plan_extract(*, target: str, corpus: str, recipe: Recipe, shape: TargetShape, max_length: int,
                 limit: int | None, dtype: str, num_workers: int, gpus_per_worker: float | None,
                 gpu_memory_gib: float, job: str = "extract", streaming: bool = False, engine: str = "hf",
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, **train) -> RunPlan:
    """The plan of reading `corpus` through `target` (extraction, or training streamed from the corpus)."""
    count = count_corpus(corpus, target_tokenizer(target), max_length, limit)
    gpus = recipe.gpus_per_target if gpus_per_worker is None else gpus_per_worker
    if tensor_parallel_size * pipeline_parallel_size > 1:
        gpus = tensor_parallel_size * pipeline_parallel_size  # vllm: one GPU per tensor x pipeline rank
    train.update(engine=engine, tensor_parallel_size=tensor_parallel_size,
                 pipeline_parallel_size=pipeline_parallel_size)
    plan = RunPlan(job=job, target=target, shape=shape, recipe=recipe, corpus=corpus, count=count, rows=count.rows,
                   tokens=count.tokens, dtype=feature_dtype(dtype, bool(gpus)), target_copies=num_workers,
                   gpus_per_target=math.ceil(gpus), gpu_memory_gib=gpu_memory_gib, streaming=streaming,
                   recipe_max_length=max_length, **train)
    if not count.rows:
        plan.notes.append("no usable rows: check the corpus format and the target's chat template")
    return plan


def plan_without_data(*, target: str, recipe: Recipe, shape: TargetShape, dtype: str, num_workers: int,
                      gpus_per_worker: float | None, gpu_memory_gib: float, job: str = "train", **train) -> RunPlan:
    """The plan for a target and recipe alone: everything but rows, tokens, bytes and steps."""
    gpus = recipe.gpus_per_target if gpus_per_worker is None else gpus_per_worker
    plan = RunPlan(job=job, target=target, shape=shape, recipe=recipe, corpus=None, count=None, rows=0, tokens=0,
                   dtype=feature_dtype(dtype, bool(gpus)), target_copies=num_workers, gpus_per_target=math.ceil(gpus),
                   gpu_memory_gib=gpu_memory_gib, has_data=False, **train)
    plan.notes.append("no data given: --corpus (or --features) adds rows, tokens, feature bytes and steps")
    return plan


def plan_from_manifest(*, features: str, recipe: Recipe, shape: TargetShape, gpu_memory_gib: float,
                       **train) -> RunPlan:
    """The plan of training on an extraction output (its manifest's rows and tokens)."""
    from pipelines.feature_files import load_manifest

    manifest = load_manifest(features)
    plan = RunPlan(job="train", target=manifest.target, shape=shape, recipe=recipe, corpus=None, count=None,
                   rows=manifest.rows, tokens=manifest.tokens, dtype=manifest.dtype, target_copies=0,
                   gpus_per_target=recipe.gpus_per_target, gpu_memory_gib=gpu_memory_gib, **train)
    if manifest.target_hidden_size != shape.hidden_size:
        plan.notes.append(f"the manifest's hidden size {manifest.target_hidden_size} differs from the target's "
                          f"{shape.hidden_size}: these features were not extracted from this target")
    return plan
