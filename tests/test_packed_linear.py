"""`eagle_core.packed_linear`: the target's and the draft's linear layers on packed CPU weights while our decoder runs
them (issue 55): the same products as the plain linear, the modules untouched outside the context (transformers'
own forward never runs on a pack), a weight changed in place packed again, autograd left to the plain linear, and
decoding on packs gives transformers' greedy tokens in fp32 (and the decoding tests of every family run on packs in
the dtypes `DECODE_DTYPES` packs by default)."""

import pytest
import torch

from eagle_core import packed_linear
from eagle_core.generate import generate
from eagle_core.packed_linear import available, packed_linears
from eagle_core.target import make_tiny_llama


@pytest.mark.parametrize("kernels", ["vllm", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 5])
def test_packed_products_equal_the_plain_linear(dtype, rows, kernels, monkeypatch):
    """Both packs: vLLM's oneDNN handle (where vLLM's CPU build is installed, as `make setup` installs it here) and
    torch's own."""
    if not available(dtype):
        pytest.skip(f"no packed CPU kernel for {dtype} in this torch build")
    if kernels == "vllm" and not packed_linear.vllm_kernels():
        pytest.skip("vLLM's CPU build is not installed")
    monkeypatch.setattr(packed_linear, "USE_VLLM_KERNELS", kernels == "vllm")
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 160), torch.nn.Linear(160, 48, bias=False)).to(dtype)
    x = torch.randn(2, rows, 96, generator=g).to(dtype)
    with torch.no_grad():
        plain = model(x)
        with packed_linears(model):
            assert all("forward" in m.__dict__ for m in model)  # the packs are in use
            packed = model(x)
            kind = packed_linear.OneDNNHandle if kernels == "vllm" else torch.Tensor
            assert all(isinstance(packed_linear._PACKS[kernels][m][1], kind) for m in model)
    assert all("forward" not in m.__dict__ for m in model)  # and the modules their own again
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(packed, plain, **tolerance)


def test_a_weight_changed_in_place_is_packed_again_and_autograd_takes_the_plain_linear():
    linear = torch.nn.Linear(32, 16)
    x = torch.randn(1, 32)
    with packed_linears(linear), torch.no_grad():
        before = linear(x)
        linear.weight.mul_(2)  # in place: the version counter moves
        after = linear(x)
    torch.testing.assert_close(after - linear.bias, 2 * (before - linear.bias), rtol=1e-5, atol=1e-5)
    with packed_linears(linear):
        y = linear(x.requires_grad_())
        y.sum().backward()  # the packed kernels have no backward: the plain linear ran
    assert x.grad is not None and linear.weight.grad is not None


def test_nested_contexts_share_packs_and_the_last_one_restores():
    linear = torch.nn.Linear(8, 8)
    with packed_linears(linear):
        with packed_linears(linear):
            pass
        assert "forward" in linear.__dict__  # the outer context still packs
    assert "forward" not in linear.__dict__


@torch.inference_mode()
def test_decoding_on_packs_gives_transformers_greedy_tokens_in_fp32(monkeypatch):
    """A tiny Llama, 64 greedy tokens: our plain loop on packs equals transformers' `generate` (which runs the
    modules' own forward), and equals our loop with packing off."""
    torch.manual_seed(0)
    target = make_tiny_llama(tie_word_embeddings=False)
    prompt = [[3, 17, 42, 99, 7]]
    ids = torch.tensor(prompt)
    hf = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64,
                         do_sample=False)[0, 5:].tolist()
    monkeypatch.setattr(packed_linear, "DECODE_DTYPES", {torch.float32})  # whatever the default packs
    ours = generate(target, prompt, max_new_tokens=64).tokens[0]
    monkeypatch.setattr(packed_linear, "DECODE_DTYPES", set())
    assert ours == hf == generate(target, prompt, max_new_tokens=64).tokens[0]
