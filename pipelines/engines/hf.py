"""The `hf` engine: the target in this process with transformers (the pipeline's reference engine)."""

from __future__ import annotations

from pipelines.engines import EngineConfig, EngineError, TargetEngine


class HFEngine(TargetEngine):
    name = "hf"

    @classmethod
    def check(cls, config: EngineConfig, cluster_gpus_per_node=None) -> None:
        super().check(config, cluster_gpus_per_node)
        if config.tensor_parallel_size * config.pipeline_parallel_size != 1:
            raise EngineError("the hf engine has no tensor or pipeline parallelism (a target larger than one GPU is "
                              "spread over the actor's GPUs with device_map: --gpus-per-worker); use --engine vllm "
                              "for --tensor-parallel-size / --pipeline-parallel-size")

    def __init__(self, config: EngineConfig):
        from eagle_core.target import default_device, device_map_for, load_target, resolve_aux_layer_ids

        self.config = config
        # An actor given several GPUs holds one target copy spread over them (a target larger than one GPU).
        self.model, self.tokenizer = load_target(config.target, device=default_device(), dtype=config.dtype,
                                                 device_map=device_map_for(config.gpus or 0))
        self.aux_layer_ids = resolve_aux_layer_ids(config.aux_layer_ids, self.model.config.num_hidden_layers)

    def regenerate(self, prompts, max_new_tokens, temperature, seed):
        from eagle_core.features import generate_replies

        return generate_replies(self.model, self.tokenizer, prompts, max_new_tokens, temperature, seed)

    def features(self, tokenized, aux_layer_ids, tokens_per_batch):
        from eagle_core.features import featurize

        return featurize(self.model, tokenized, aux_layer_ids, tokens_per_batch)
