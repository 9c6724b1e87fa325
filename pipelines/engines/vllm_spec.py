"""A draft as vLLM's EAGLE-3 speculator: its speculative config and its acceptance as vLLM counts it.

One home for what serving (`pipelines/serve/vllm_service.py`), the serving-engine gate of retraining and the
benchmarks ask of vLLM about a draft. vLLM counts, per drafting step of a request: one draft, `k` drafted tokens,
the accepted ones, and which positions were accepted (`SpecDecodingStats`); the mean acceptance length is
1 + accepted / drafts, the same quantity as our decoder's chain tau at depth k (one bonus token per round).
"""

from __future__ import annotations

from dataclasses import dataclass, field


# A registered version's mean acceptance length in vLLM at its k (the serving-engine evaluation): what a vLLM
# replica's drift rule compares its window with, as our decoder's compares with the version's tree `tau`.
ACCEPTANCE_TAG = "eagle3.vllm_acceptance_length"


def speculative_config(draft_folder: str, num_speculative_tokens: int) -> dict:
    """vLLM's `speculative_config` for an exported draft folder (our `save_draft` layout, which vLLM reads)."""
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    config = {"method": "eagle3", "model": str(draft_folder), "num_speculative_tokens": int(num_speculative_tokens)}
    if _draft_json(draft_folder).get("parallel_drafting"):  # a P-EAGLE draft: every depth in one forward
        config["parallel_drafting"] = True
    return config


def _draft_json(draft_folder) -> dict:
    """The draft folder's config.json (any fsspec URL; {} where there is none to read here)."""
    import json

    import fsspec

    try:
        with fsspec.open(f"{str(draft_folder).rstrip('/')}/config.json", "r") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


@dataclass
class SpecCounts:
    """Cumulative spec-decode counters (vLLM's names without the `vllm:spec_decode_` prefix)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, stats) -> None:
        """Add one `vllm.v1.spec_decode.metrics.SpecDecodingStats` (a scheduler step's)."""
        self.num_drafts += stats.num_drafts
        self.num_draft_tokens += stats.num_draft_tokens
        self.num_accepted_tokens += stats.num_accepted_tokens
        per_pos = list(stats.num_accepted_tokens_per_pos)
        if len(self.accepted_per_pos) < len(per_pos):
            self.accepted_per_pos += [0] * (len(per_pos) - len(self.accepted_per_pos))
        for i, n in enumerate(per_pos):
            self.accepted_per_pos[i] += n

    def since(self, before: "SpecCounts") -> "SpecCounts":
        per_pos = [a - (before.accepted_per_pos[i] if i < len(before.accepted_per_pos) else 0)
                   for i, a in enumerate(self.accepted_per_pos)]
        return SpecCounts(self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
                          self.num_accepted_tokens - before.num_accepted_tokens, per_pos)

    @property
    def acceptance_length(self) -> float | None:
        """1 + accepted tokens per draft (None before any draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def acceptance_per_position(self) -> list[float]:
        """The fraction of drafts whose position i was accepted."""
        return [n / self.num_drafts for n in self.accepted_per_pos] if self.num_drafts else []

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_pos": list(self.accepted_per_pos),
                "acceptance_length": self.acceptance_length,
                "acceptance_per_position": self.acceptance_per_position}


def counts_from_metrics(metrics) -> SpecCounts:
    """SpecCounts from `vllm.LLM.get_metrics()` (vllm.v1.metrics.reader: Counter / Vector snapshots)."""
    counts = SpecCounts()
    for metric in metrics:
        name = metric.name
        if name == "vllm:spec_decode_num_drafts":
            counts.num_drafts = int(metric.value)
        elif name == "vllm:spec_decode_num_draft_tokens":
            counts.num_draft_tokens = int(metric.value)
        elif name == "vllm:spec_decode_num_accepted_tokens":
            counts.num_accepted_tokens = int(metric.value)
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            counts.accepted_per_pos = [int(v) for v in metric.values]
    return counts


def greedy_acceptance(llm, prompts: list[list[int]], max_new_tokens: int,
                      eos_token_id: int | None) -> tuple[SpecCounts, list[list[int]]]:
    """Greedy decoding of token-id prompts on an offline `vllm.LLM` started with `disable_log_stats=False` (its
    `get_metrics()` holds the counters): the spec-decode counts these requests added, and each prompt's new tokens
    (the EOS that ended one included, as in `eagle_core.generate`)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    before = counts_from_metrics(llm.get_metrics())
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0,
                            stop_token_ids=[eos_token_id] if eos_token_id is not None else None)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    return counts_from_metrics(llm.get_metrics()).since(before), [list(o.outputs[0].token_ids) for o in outputs]


def acceptance_in_vllm(target_folder, draft_folder, prompts: list[list[int]], k: int, max_new_tokens: int,
                       eos_token_id: int | None, dtype: str, seed: int = 0) -> tuple[SpecCounts, list[list[int]]]:
    """Start vLLM on the target (an HF folder) with `draft_folder` as its EAGLE-3 speculator drafting `k` tokens,
    decode `prompts` greedily (`greedy_acceptance`), close it. A draft vLLM refuses to load raises here."""
    from pipelines.engines.vllm import OfflineLLM

    length = max(map(len, prompts)) + max_new_tokens + k + 8  # room for the last round's drafted tokens
    with OfflineLLM(target_folder, dtype=dtype, max_model_len=length, seed=seed, disable_log_stats=False,
                    speculative_config=speculative_config(draft_folder, k)) as engine:
        return greedy_acceptance(engine.llm, prompts, max_new_tokens, eos_token_id)
