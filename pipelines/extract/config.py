"""What an extraction is configured with (`ExtractConfig`), and the engine each of its actors runs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from eagle_core.recipe import REFERENCE


@dataclass
class ExtractConfig:
    corpus: str = "sharegpt"
    output: str = "work/features"
    target: str = "smollm2-135m"
    limit: int | None = None
    max_length: int = REFERENCE.max_length  # tokens per conversation (eagle_core/recipes/reference.toml)
    regenerate: bool = True
    # 'hf': the actor's own target generates (batches of regen_batch_size); 'openai:URL': an OpenAI-compatible
    # server does (vLLM, SGLang, jobs/serve.py), a whole shard's turn in flight at once (pipelines.regenerate)
    regenerate_with: str = "hf"
    # What runs the target in each actor (pipelines.engines): 'hf' (transformers, the reference) or 'vllm' (its
    # engine; tensor_parallel_size x pipeline_parallel_size GPUs per actor, on one node).
    engine: str = "hf"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_new_tokens: int = 512
    temperature: float = 0.0
    seed: int = 0
    aux_layer_ids: list[int] | None = None
    dtype: str = "auto"
    num_workers: int = 1
    gpus_per_worker: float | None = None  # None: 1 when the cluster has GPUs, else 0; > 1: device_map over them
    cpus_per_worker: float = 1.0
    tokens_per_batch: int = 8192
    rows_per_shard: int = 64
    regen_batch_size: int = 16
    mlflow_experiment: str | None = "eagle3-extract"
    # Earlier extraction outputs of the same target and settings: a planned shard committed there is copied
    # (features and regenerated conversations) instead of being computed again. Retraining at growing data
    # scales uses it: shard k of a prefix of the corpus is shard k of the whole.
    reuse_from: list[str] = field(default_factory=list)
    # An output made by other inputs or settings (its fingerprint differs) is refused, naming the differing fields;
    # overwrite=True deletes its shards, regenerated conversations and manifest first.
    overwrite: bool = False

    def __post_init__(self):
        from pipelines.engines import EngineError, check_engine_name
        from pipelines.regenerate import parse_regenerate_with

        check_engine_name(self.engine)  # clear errors before any work
        if parse_regenerate_with(self.regenerate_with) and self.engine != "hf":
            raise EngineError(f"--engine {self.engine} regenerates with its own engine; --regenerate-with openai:URL "
                              "(a serving engine regenerates) goes with --engine hf")
        if self.engine == "hf" and self.tensor_parallel_size * self.pipeline_parallel_size != 1:
            raise EngineError("tensor and pipeline parallelism need --engine vllm (the hf engine spreads a target "
                              "over an actor's GPUs with device_map: --gpus-per-worker)")

    def engine_config(self, gpus: float = 0):
        """The engine each actor runs (pipelines.engines.EngineConfig)."""
        from pipelines.engines import EngineConfig

        return EngineConfig(target=self.target, dtype=self.dtype, engine=self.engine, aux_layer_ids=self.aux_layer_ids,
                            max_length=self.max_length + (self.max_new_tokens if self.regenerate else 1), gpus=gpus,
                            tensor_parallel_size=self.tensor_parallel_size,
                            pipeline_parallel_size=self.pipeline_parallel_size, seed=self.seed)

    def to_dict(self) -> dict:
        return asdict(self)
