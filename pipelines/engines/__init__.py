"""What runs a target for the pipeline: one interface, `TargetEngine`, two implementations.

- `hf` (`pipelines.engines.hf`): the target in this process with transformers, the reference; every family of the
  matrix (docs/targets.md), `device_map` over several GPUs for a target larger than one.
- `vllm` (`pipelines.engines.vllm`): vLLM's engine in this process (its CPU build here, its CUDA build on GPU
  fleets), tensor and pipeline parallelism, features through its `extract_hidden_states` speculative method.

An engine does two things for a stage: `regenerate` (generate from token ids, greedy or sampled) and `features`
(the aux layers' hidden states and the last layer's, after the final norm, for tokenised rows). Stages ask
`make_engine(EngineConfig)` for one and never branch on the engine's name. Every engine is a context manager and
`close()`s what it started: vLLM's engine core may run in child processes that otherwise outlive their parent
(`pipelines.engines.vllm`: closed in `finally`, at exit and on SIGTERM).

`engine_fingerprint` is what an engine adds to the extraction fingerprint: nothing for `hf` (the reference, so that
outputs made before engines existed stay valid), its name and version otherwise, so that features of different
engines are never mixed in one output or one training run without an error naming the field.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass

ENGINES = {"hf": "pipelines.engines.hf:HFEngine", "vllm": "pipelines.engines.vllm:VllmEngine"}


class EngineError(ValueError):
    """An engine that cannot run what was asked of it, said before any work."""


@dataclass
class EngineConfig:
    """What an engine needs to load a target (the extraction's settings it shares)."""

    target: str = "smollm2-135m"
    dtype: str = "auto"  # "auto": bf16 where native, else fp32
    engine: str = "hf"
    aux_layer_ids: list[int] | None = None  # None: the target's default (eagle_core.target.resolve_aux_layer_ids)
    max_length: int = 2048  # the longest sequence an engine must hold (prompt + reply, or a tokenised row)
    gpus: float = 0  # GPUs this process holds; hf spreads a copy over more than one with device_map
    tensor_parallel_size: int = 1  # vllm only
    pipeline_parallel_size: int = 1  # vllm only
    # vllm only: run the engine core in a child process (vLLM's default); None: only where tensor x pipeline
    # parallel > 1 needs worker processes anyway, so a single-GPU or CPU engine leaves no process behind
    engine_core_process: bool | None = None
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def check_engine_name(name: str) -> str:
    if name not in ENGINES:
        raise EngineError(f"unknown engine {name!r}; choose one of {sorted(ENGINES)}")
    return name


def engine_class(name: str):
    module, _, cls = ENGINES[check_engine_name(name)].partition(":")
    return getattr(importlib.import_module(module), cls)


def check_engine(config: EngineConfig, cluster_gpus_per_node: list[float] | None = None) -> None:
    """Everything that can be said about `config` before any weights load: the engine's name, that it is installed,
    that it can load this target, and that the GPUs it asks for exist on one node (`cluster_gpus_per_node`: the
    GPUs of each node, None when unknown). Raises EngineError naming the problem and the remedy."""
    engine_class(config.engine).check(config, cluster_gpus_per_node)


def make_engine(config: EngineConfig) -> "TargetEngine":
    return engine_class(config.engine)(config)


def engine_fingerprint(name: str) -> dict | None:
    return engine_class(name).fingerprint()


def gpus_per_copy(config: EngineConfig) -> float:
    """GPUs one target copy of this engine occupies: the tensor x pipeline parallel size for vllm, `gpus` for hf."""
    return engine_class(config.engine).gpus_per_copy(config)


class TargetEngine:
    """The interface. `tokenizer` is the target's (transformers) tokenizer: stages build prompts with its chat
    template (`eagle_core.chat`), so every engine sees exactly the same token ids."""

    name = "?"
    tokenizer = None
    model = None  # the transformers model where the engine holds one (hf), else None
    aux_layer_ids: list[int] | None = None  # the aux layers it captures: config.aux_layer_ids resolved for the target

    @classmethod
    def check(cls, config: EngineConfig, cluster_gpus_per_node: list[float] | None = None) -> None:
        for field in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(config, field) < 1:
                raise EngineError(f"{field} must be >= 1, got {getattr(config, field)}")

    @classmethod
    def fingerprint(cls) -> dict | None:
        return None

    @classmethod
    def gpus_per_copy(cls, config: EngineConfig) -> float:
        return config.gpus

    def regenerate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> list:
        """One `eagle_core.features.Reply` per prompt (token ids): greedy when temperature is 0, else sampled with
        `seed` (a seed gives the same replies again on the same engine)."""
        raise NotImplementedError

    def features(self, tokenized: list[tuple[str, list[int], list[int]]], aux_layer_ids: list[int],
                 tokens_per_batch: int) -> list:
        """`eagle_core.features.FeatureRow` per (id, input_ids, loss_mask), in input order, in the engine's dtype."""
        raise NotImplementedError

    def close(self) -> None:
        """End what the engine started (processes, threads, temporary files); idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
