"""`eagle_core.packed_linear`: the target's and the draft's linear layers on packed CPU weights while our decoder runs
them (issue 55): the same products as the plain linear, the modules untouched outside the context (transformers'
own forward never runs on a pack), a weight changed in place packed again, autograd left to the plain linear, and
decoding on packs gives transformers' greedy tokens in fp32 (and the decoding tests of every family run on packs in
the dtypes `DECODE_DTYPES` packs by default); sibling linears (q/k/v, gate/up) share one product."""

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
            assert all(isinstance(packed_linear._PACKS[kernels][m][2][0], kind) for m in model)
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


class _Block(torch.nn.Module):
    """An attention's q/k/v and a gated MLP's gate/up projections, as transformers' Llama names them."""

    def __init__(self, bias: bool):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(64, n, bias=bias) for n in (64, 32, 32))
        self.gate_proj, self.up_proj = torch.nn.Linear(64, 96, bias=bias), torch.nn.Linear(64, 96, bias=bias)


@pytest.mark.parametrize("kernels", ["vllm", "torch"])
@pytest.mark.parametrize("bias", [False, True])
def test_sibling_linears_share_one_product_and_each_gets_its_own_output(kernels, bias, monkeypatch):
    """q, k, v called on one input: one pack of the three weights, each output equal to its own linear's; called in
    another order, or k on another input, each still gets its own product; with autograd, the plain linears."""
    if kernels == "vllm" and not packed_linear.vllm_kernels():
        pytest.skip("vLLM's CPU build is not installed")
    monkeypatch.setattr(packed_linear, "USE_VLLM_KERNELS", kernels == "vllm")
    block = _Block(bias)
    x, other = torch.randn(1, 3, 64), torch.randn(1, 3, 64)
    with torch.no_grad():
        plain = [m(x) for m in (block.q_proj, block.k_proj, block.v_proj, block.gate_proj, block.up_proj)]
        plain_k_other = block.k_proj(other)
        with packed_linears(block):
            got = [block.q_proj(x), block.k_proj(x), block.v_proj(x), block.gate_proj(x), block.up_proj(x)]
            packs = packed_linear._PACKS[kernels]
            forwards = {m: forward for m, forward, _ in packed_linear._linears(block)}
            groups = {forwards[block.q_proj].func.__self__, forwards[block.gate_proj].func.__self__}
            assert len(groups) == 2 and all(g in packs for g in groups)  # one pack per group
            assert not any(m in packs for m in block.children())  # and none per member
            reordered = [block.v_proj(x), block.k_proj(other), block.q_proj(x), block.k_proj(x)]
            twice = [block.q_proj(x), block.q_proj(x)]  # a member called again on the same input: its product again
    for a, b in zip(got, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(reordered, [plain[2], plain_k_other, plain[0], plain[1]]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a in twice:
        torch.testing.assert_close(a, plain[0], rtol=1e-5, atol=1e-5)
    with packed_linears(block):
        y = block.k_proj(x.requires_grad_())
        y.sum().backward()
    assert x.grad is not None and block.k_proj.weight.grad is not None
    assert all(getattr(g.state, "pending", None) is None for g in groups)  # no activations kept past the context


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_llamas_rms_norm_runs_on_the_fused_kernel_with_its_values_and_gemmas_keeps_its_own(dtype):
    """Llama's RMSNorm (and Qwen3's, the same formula, on head-sized 4-d inputs) gives its own values on vLLM's
    kernel; Gemma's (1 + weight) is not taken for it."""
    if not packed_linear.vllm_kernels():
        pytest.skip("vLLM's CPU build is not installed")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    g = torch.Generator().manual_seed(0)
    model = torch.nn.ModuleList([LlamaRMSNorm(64, eps=1e-5), Qwen3RMSNorm(16, eps=1e-6), GemmaRMSNorm(64)]).to(dtype)
    for norm in model:
        norm.weight.data = torch.randn(norm.weight.shape, generator=g).to(dtype)
    x, heads = torch.randn(2, 3, 64, generator=g).to(dtype), torch.randn(2, 3, 4, 16, generator=g).to(dtype)
    inputs = (x, heads.transpose(1, 2), x)  # a transposed (non-contiguous) view, as a q_norm may get
    with torch.no_grad():
        plain = [norm(a) for norm, a in zip(model, inputs)]
        with packed_linears(model):
            assert ["forward" in norm.__dict__ for norm in model] == [True, True, False]
            fused = [norm(a) for norm, a in zip(model, inputs)]
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(fused, plain):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tolerance)
