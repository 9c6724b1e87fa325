import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from eagle_core.target import load_target, make_tiny_llama


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct target (float32, CPU) and its tokenizer, loaded once per session."""
    return load_target("smollm2-135m", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's tokenizer alone (no model weights loaded)."""
    from transformers import AutoTokenizer

    from eagle_core.target import materialize_hf_folder

    return AutoTokenizer.from_pretrained(materialize_hf_folder("smollm2-135m"))


@pytest.fixture
def tiny_target():
    """A random-weight 6-layer Llama (vocab 512, hidden 64) for fast unit tests."""
    return make_tiny_llama()


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """One embedded local Ray cluster for the whole session (more logical CPUs than cores: see DESIGN.md)."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")), runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}})
    yield ray
    ray.shutdown()
