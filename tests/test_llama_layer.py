"""`eagle_core.llama_layer`: Llama-style decoder layers run as one function on the packed kernels inside
`packed_linears` (issue 55): taken for the layers it reproduces only (Llama's, Mistral's, Qwen2's, Qwen3's), the same
logits as transformers' own layers, and the layer's own forward wherever a hook, autograd or another source asks
for it."""

import pytest
import torch

from eagle_core import llama_layer, packed_linear
from eagle_core.llama_layer import LayerPlan
from eagle_core.packed_linear import packed_linears
from family_helpers import SUPPORTED, tiny_family_model


def _layers(model):
    return list(model.model.layers)


TAKEN = {"llama", "mistral", "mistral-window", "qwen2", "qwen2-window", "qwen3"}


def test_only_the_reproduced_layers_are_taken():
    """Source compared: Llama's, Mistral's, Qwen2's and Qwen3's layers are (with or without a sliding window); every
    other family of the decoder's matrix keeps its own forward (each differs in its layer, norms, MLP or experts)."""
    for name in SUPPORTED:
        plans = [LayerPlan.of(layer) for layer in _layers(tiny_family_model(name))]
        assert plans and all((p is not None) == (name in TAKEN) for p in plans), name


def _fused_runs(model, monkeypatch):
    """A counter of the model's layers that ran `layer_forward` since: those whose input norm it called (a layer
    running its own forward calls the norm module instead)."""
    ran = set()
    norm_forward = llama_layer.rms_norm_forward

    def spy(norm, x):
        ran.add(norm)
        return norm_forward(norm, x)

    monkeypatch.setattr(llama_layer, "rms_norm_forward", spy)
    return lambda: sum(layer.input_layernorm in ran for layer in _layers(model))


@pytest.mark.parametrize("family", ["llama", "mistral-window", "qwen2-window", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_forward_gives_the_models_own_logits(dtype, family, monkeypatch):
    """A tiny model of each reproduced kind (Qwen2's q/k/v with biases, Qwen3's q/k norms, a sliding window) over a
    prompt and then one more token on its cache: inside the context every layer runs as `layer_forward` and the logits
    equal the model's own forward's."""
    if not packed_linear.available(dtype):
        pytest.skip(f"no packed CPU kernel for {dtype} in this torch build")
    model = tiny_family_model(family, dtype=dtype)
    ids = torch.tensor([[5, 9, 31, 7, 2, 64, 11, 40, 3, 17, 23, 8]])  # past the sliding window (8)

    def run():
        out = model(ids[:, :-1], use_cache=True)
        return torch.cat([out.logits, model(ids[:, -1:], past_key_values=out.past_key_values).logits], dim=1)

    with torch.no_grad():
        own = run()
        fused_runs = _fused_runs(model, monkeypatch)
        with packed_linears(model):
            fused = run()
            assert fused_runs() == len(_layers(model))
    assert all("forward" not in layer.__dict__ for layer in _layers(model))  # the layers their own again
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(fused.float(), own.float(), **tolerance)


def test_a_hook_on_a_submodule_or_autograd_runs_the_layers_own_forward(monkeypatch):
    """A forward hook on one layer's MLP is called (that layer runs its own forward, the others stay fused), with the
    same logits; under autograd the layers' own forward runs and gradients reach the weights."""
    model = tiny_family_model("llama")
    ids = torch.tensor([[5, 9, 31, 7]])
    seen = []
    layers = _layers(model)
    with torch.no_grad():
        own = model(ids).logits
        handle = layers[1].mlp.register_forward_hook(lambda m, args, out: seen.append(out.shape))
        fused_runs = _fused_runs(model, monkeypatch)
        try:
            with packed_linears(model):
                hooked = model(ids).logits
                assert fused_runs() == len(layers) - 1  # the others ran fused
        finally:
            handle.remove()
    assert seen == [torch.Size([1, 4, model.config.hidden_size])]
    torch.testing.assert_close(hooked, own, rtol=1e-5, atol=1e-5)
    model.requires_grad_(True)
    with packed_linears(model):
        model(ids).logits.sum().backward()
    assert all(layer.self_attn.q_proj.weight.grad is not None for layer in layers)


def test_a_layer_whose_forward_differs_from_the_reproduced_source_keeps_its_own():
    """A Llama layer class with another forward (as a transformers release that changes Llama's would be) is not
    taken: the fast path reproduces one text, named by its hash (`REPRODUCED`)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    class ScaledLayer(LlamaDecoderLayer):
        def forward(self, hidden_states, **kwargs):
            return 2 * super().forward(hidden_states, **kwargs)

    model = tiny_family_model("llama")
    layer = model.model.layers[0]
    assert LayerPlan.of(layer) is not None
    layer.__class__ = ScaledLayer
    assert LayerPlan.of(layer) is None
