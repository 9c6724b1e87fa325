"""The deployment's settings: one plain dataclass, filled from the CLI, a Serve config YAML or a test.

Every field is a plain value so the whole config travels as a dict through `serve run` / `serve deploy`
(`applications[].args`) and into the replica's constructor.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from eagle_core.tree import TreeConfig


@dataclass
class ServeConfig:
    # ---- models --------------------------------------------------------------------------------------------
    target: str = "smollm2-135m"  # short name, HF folder, .gguf, or models:/<name>@<alias>
    draft: str | None = None  # draft folder or models:/<name>@<alias>; None = plain decoding
    model_name: str = ""  # the id clients send as `model`; default: derived from target/draft
    device: str | None = None  # None = cuda when available, else cpu
    dtype: str = "auto"  # bf16 where native (GPUs, CPUs with avx512_bf16/AMX), else fp32; float32 = bit-exact
    # ---- tree (EAGLE-2) ------------------------------------------------------------------------------------
    top_k: int = 8
    depth: int = 6
    total_tokens: int = 32
    # ---- batching and load fallback (see engine.choose_mode) -----------------------------------------------
    max_batch_size: int = 16  # requests decoded together
    max_waiting: int = 16  # admitted but not decoding yet; a request beyond that gets 503 at once
    # Which decoding mode a round uses at batch size B (a wide tree over many rows costs more target
    # compute than it saves). "auto": the mode with the best measured tokens/s at this batch size
    # (engine.ModeChooser; re-measured every `explore_every` rounds). "static": full trees while
    # B <= tree_max_batch, chains of `depth` tokens while B <= chain_max_batch, plain above.
    mode_policy: str = "auto"
    explore_every: int = 16
    tree_max_batch: int = 2
    chain_max_batch: int = 4
    # ---- limits ----------------------------------------------------------------------------------------
    max_context: int = 2048  # prompt + completion tokens, capped by the target's max_position_embeddings
    max_tokens_limit: int = 512  # the largest max_tokens a request may ask for
    default_max_tokens: int = 16  # OpenAI's default for /v1/completions; chat uses the same
    max_body_bytes: int = 1 << 20
    # ---- HTTP ------------------------------------------------------------------------------------------
    api_key: str | None = None  # bearer token; None = no auth (loopback only by default)
    torch_threads: int = 0  # 0 = leave torch's default

    def __post_init__(self):
        self.tree  # validates top_k / depth / total_tokens
        if self.mode_policy not in ("auto", "static"):
            raise ValueError(f"mode_policy must be 'auto' or 'static', got {self.mode_policy!r}")
        if self.max_batch_size < 1 or self.max_waiting < 0:
            raise ValueError("max_batch_size must be >= 1 and max_waiting >= 0")
        if not 0 < self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError("default_max_tokens must be in 1..max_tokens_limit")

    @property
    def tree(self) -> TreeConfig:
        return TreeConfig(self.top_k, self.depth, self.total_tokens)

    @property
    def served_name(self) -> str:
        if self.model_name:
            return self.model_name
        base = self.target.rstrip("/").split("/")[-1]
        return f"{base}-eagle3" if self.draft else base

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "ServeConfig":
        d = dict(d or {})
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:  # a typo in a YAML would otherwise silently serve something else
            raise ValueError(f"unknown ServeConfig fields: {sorted(unknown)}")
        return cls(**d)


@dataclass
class DeploymentOptions:
    """What Ray Serve needs to place and scale replicas (kept apart from what a replica does)."""

    num_replicas: int | str = 1  # or "auto" with autoscaling_config
    num_cpus: float = 1.0
    num_gpus: float | None = None  # None = 1 when the cluster has GPUs, else 0
    max_ongoing_requests: int = 64  # above the engine's capacity, so the engine's own 503 answers first
    # The router's queue (requests not yet handed to a replica); beyond it Serve answers 503 itself, with
    # a plain-text body. Deep enough that normally the engine's OpenAI-format 503 answers first.
    max_queued_requests: int = 64
    autoscaling_config: dict | None = field(default=None)
    pythonpath: str | None = None  # added to the replicas' PYTHONPATH (they don't see the driver's)
