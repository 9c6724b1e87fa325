"""The job's configuration: one validated dataclass (it is also the CLI, see jobs/train.py, and the MLflow params).

Its fields are flat (CLI flags, `--train` JSON overrides, MLflow params); those that belong to the draft or to the
optimiser take their defaults from `DraftConfig` and `TrainConfig`, which own them, and the recipe's others
(warm-up ratio, tokens per step) from the reference recipe (eagle_core.recipe.REFERENCE). jobs/train.py fills them
from the recipe in force instead.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from eagle_core.draft import DRAFT_KINDS, LM_HEAD_INITS, DraftConfig
from eagle_core.recipe import REFERENCE
from eagle_core.ttt import TrainConfig
from eagle_core.ttt_batch import refuse_longer_than_row
from pipelines.cli import config_from_fields

STRATEGIES = ("ddp", "fsdp")
PACK_LONGEST = "longest"  # pack_length: rows as long as each step's longest conversation


@dataclass(frozen=True)
class FeatureSource:
    """One source of a features-mode run's rows: an extraction's (or a traffic sink's) output URL, its share of each
    epoch's training rows (`weight`, normalised over the sources; `plan.mix_rows`), and the fraction of its
    conversations never read at all (`holdout`: those whose id hash falls below it, `plan.held_out_by_hash`; kept
    for an evaluation elsewhere, e.g. retraining's held-out traffic)."""

    url: str
    weight: float = 1.0
    holdout: float = 0.0


def feature_sources(features) -> list[FeatureSource]:
    """`TrainJobConfig.features` as sources: one URL (weight 1, nothing held out), or a list of URLs and
    {url, weight, holdout} dicts; checked (weights >= 0 and not all 0, holdout in [0, 1))."""
    if isinstance(features, str):
        return [FeatureSource(features)]
    if not isinstance(features, (list, tuple)) or not features:
        raise ValueError(f"features must be a URL or a non-empty list of sources, got {features!r}")
    try:
        sources = [FeatureSource(f) if isinstance(f, str) else FeatureSource(**f) for f in features]
    except TypeError as err:
        raise ValueError(f"features: a source is a URL or {{url, weight, holdout}}: {err}") from err
    if any(s.weight < 0 for s in sources) or not any(s.weight > 0 for s in sources):
        raise ValueError(f"features: weights must be >= 0 and not all 0, got {[s.weight for s in sources]}")
    if any(not 0 <= s.holdout < 1 for s in sources):
        raise ValueError(f"features: holdout must be in [0, 1), got {[s.holdout for s in sources]}")
    return sources


@dataclass
class TrainJobConfig:
    # features mode: an extraction output URL, or several mixed: a list of URLs / {url, weight, holdout}
    # (`FeatureSource`: each source's share of an epoch's training rows, and the part of it never read)
    features: str | list | None = None
    corpus: str | None = None  # streaming mode: a corpus URL ('sharegpt' = embedded); `extract` holds the rest
    extract: dict = field(default_factory=dict)  # ExtractConfig fields for streaming (target/output excluded)
    output: str = "work/train"
    target: str | None = None  # None: the manifest's target (features mode); required when streaming
    num_workers: int = 1
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    strategy: str = "ddp"  # "fsdp" shards draft, gradients and optimiser state (large drafts)
    epochs: int = 1
    max_steps: int | None = None  # stop after this many optimiser steps (None: all epochs)
    lr: float = TrainConfig.lr
    warmup_steps: int | None = None  # None: warmup_ratio of the planned steps
    warmup_ratio: float = REFERENCE.warmup_ratio
    min_lr_ratio: float = TrainConfig.min_lr_ratio
    weight_decay: float = TrainConfig.weight_decay
    max_grad_norm: float = TrainConfig.max_grad_norm
    tokens_per_batch: int = REFERENCE.tokens_per_batch  # real tokens per optimiser step, over all workers together
    # Sequence packing: each rank lays its conversations of a step into rows of this many tokens, several per row,
    # attention and TTT steps kept inside each conversation (eagle_core.ttt_batch); a longer conversation is refused
    # when the run is planned. "longest" (the default): rows as long as the step's longest conversation, so never
    # more rows nor longer ones than padding gives (1.9x faster on a CPU at mixed lengths, equal at equal ones:
    # bench/ttt_packing.py). None ("none"): one conversation per row, right-padded to the step's longest. The loss
    # is the same either way (up to float rounding), so it is no part of the training fingerprint: only the layout.
    pack_length: int | str | None = PACK_LONGEST
    # Gradient accumulation: each rank forwards and backwards its share of a step in micro-batches of at most this
    # many tokens (conversations first-fit, longest first; every rank runs as many as the fullest rank needs) and
    # sums their gradients before the one optimiser step: a step of tokens_per_batch in the activation memory of a
    # micro-batch, on the same trajectory (up to float rounding; the batch is still tokens_per_batch). None: a rank's
    # share in one forward. A longer conversation is refused when the run is planned.
    micro_batch_tokens: int | None = None
    ttt_steps: int = DraftConfig.ttt_steps
    step_decay: float = TrainConfig.step_decay
    draft_vocab_size: int = DraftConfig.draft_vocab_size
    lm_head_init: str = DraftConfig.lm_head_init
    draft_kind: str = "eagle3"  # eagle_core.draft.DRAFT_KINDS: "eagle3", "eagle3.1" (two norms), "p-eagle"
    eval_fraction: float = 0.05
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    resume: bool = False
    # worker failures Ray Train recovers from, each by restarting every worker from the last checkpoint: a node lost
    # or a worker killed costs the steps since that checkpoint, not the run
    max_failures: int = 3
    seed: int = 0
    log_every: int = 10  # progress lines on rank 0 (MLflow gets every step)
    run_name: str | None = None  # None: "train-<output folder name>"
    mlflow_experiment: str | None = "eagle3-train"
    registered_model_name: str | None = "eagle3-draft"
    init_from: str | None = None  # warm start: a draft folder whose weights seed this draft where shapes agree
    # The serving-engine gate of the export (pipelines/serving_gate.py): "auto" (jobs/train.py's default) measures
    # the exported draft's acceptance in vLLM against our decoder's chain of the same depth where vLLM is installed
    # and loads the target, else says loudly that it was skipped; "vllm" measures or fails; "off" (the default
    # here: retraining gates the same draft at its promotion, beside the champion) skips it. Its depth: k, else
    # ttt_steps. A draft below the gate leaves no export (ServingGateFailed).
    serving_gate: str = "off"
    serving_gate_k: int | None = None

    def __post_init__(self):
        if (self.features is None) == (self.corpus is None):
            raise ValueError("give exactly one of features (an extraction output) or corpus (streaming)")
        if self.features is not None:
            feature_sources(self.features)  # a malformed list is refused here, before any work
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.lm_head_init not in LM_HEAD_INITS:
            raise ValueError(f"lm_head_init must be one of {LM_HEAD_INITS}, got {self.lm_head_init!r}")
        if self.draft_kind not in DRAFT_KINDS:
            raise ValueError(f"draft_kind must be one of {sorted(DRAFT_KINDS)}, got {self.draft_kind!r}")
        self.pack_length = parse_pack_length(self.pack_length)
        if self.micro_batch_tokens is not None and (isinstance(self.micro_batch_tokens, bool) or not isinstance(
                self.micro_batch_tokens, int) or self.micro_batch_tokens < 1):
            raise ValueError(f"micro_batch_tokens must be a positive number of tokens or None, "
                             f"got {self.micro_batch_tokens!r}")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError("eval_fraction must be in [0, 1)")
        if self.corpus is not None and self.target is None:
            raise ValueError("streaming from a corpus needs --target")
        from pipelines.serving_gate import GATE_MODES

        if self.serving_gate not in GATE_MODES:
            raise ValueError(f"serving_gate must be one of {GATE_MODES}, got {self.serving_gate!r}")
        if self.serving_gate_k is not None and self.serving_gate_k < 1:
            raise ValueError(f"serving_gate_k must be >= 1, got {self.serving_gate_k}")

    def row_length(self, lengths: list[int]) -> int | None:
        """The packed row length for a step whose conversations have `lengths` (None: no packing)."""
        if self.pack_length == PACK_LONGEST:
            return max(lengths, default=1)
        return self.pack_length

    def refuse_too_long(self, lengths: list[int], names: list) -> None:
        """BadBatch naming the conversations longer than a packed row or a micro-batch can take (planning time)."""
        if isinstance(self.pack_length, int):  # "longest" and one per row fit every conversation
            refuse_longer_than_row(lengths, self.pack_length, names)
        if self.micro_batch_tokens is not None:
            refuse_longer_than_row(lengths, self.micro_batch_tokens, names, "a micro-batch", "micro_batch_tokens")

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def name(self) -> str:
        return self.run_name or f"train-{os.path.basename(self.output.rstrip('/')) or 'run'}"

    @property
    def streaming(self) -> bool:
        return self.corpus is not None

    def train_config(self, total_steps: int) -> TrainConfig:
        warmup = self.warmup_steps if self.warmup_steps is not None else int(self.warmup_ratio * total_steps)
        return config_from_fields(TrainConfig, self, warmup_steps=warmup, total_steps=total_steps)


def parse_pack_length(value) -> int | str | None:
    """`pack_length` as given (a number of tokens, "longest", None or "none"; the CLI's text too), checked."""
    if value is None or value == "none":
        return None
    if value == PACK_LONGEST:
        return value
    try:
        tokens = int(value)
    except (TypeError, ValueError):
        tokens = 0
    if tokens < 1 or (isinstance(value, float) and value != tokens):
        raise ValueError(f"pack_length must be a positive number of tokens, {PACK_LONGEST!r} or 'none', got {value!r}")
    return tokens
