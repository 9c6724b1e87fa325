"""Prototype measurement (issue 55's next lever; not part of the package): the static plain step compiled by Inductor
with vLLM's oneDNN product in the graph and attention over the used cache length, against our eager plain step,
SmolLM2, one prompt, 96 greedy tokens, 3 interleaved repetitions; then a profile of the compiled step.

    DIRECT=1 NOGUARD=1 CPPW=1 python bench/results/cpu-speed/compiled_prototype.py bf16 length

argv[1]: bf16 | fp32. argv[2]: "length" routes the compiled attention through `eagle3x::sdpa_used` (SDPA over the
slots up to the last one the mask allows, found from the mask), anything else: SDPA over the whole capacity (2048).
DIRECT=1: the graph calls vLLM's `_C::onednn_mm` itself (a fake kernel registered for it) instead of a Python
custom op wrapping it. NOGUARD=1: dynamo keeps no guards on the modules (`skip_guard_on_all_nn_modules_unsafe`).
CPPW=1: Inductor's C++ wrapper instead of its Python one. Results: compiled_prototype.md beside this file."""
import sys, time, functools, torch
import eagle_core.attention as att
from eagle_core.target import load_target
from eagle_core.generate import generate
from eagle_core import packed_linear as pl
from eagle_core.static_rows import StaticConfig, inductor
dtype = torch.bfloat16 if sys.argv[1] == "bf16" else torch.float32
length_op = sys.argv[2] == "length"
torch.set_num_threads(2)
pl.vllm_kernels()

@torch.library.custom_op("eagle3x::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype)
    torch.ops._C.onednn_mm(out, x.reshape(-1, x.shape[-1]), bias, handle)
    return out

@onednn_linear.register_fake
def _(x, handle, bias, n):
    return x.new_empty((*x.shape[:-1], n))

@torch.library.custom_op("eagle3x::sdpa_used", mutates_args=())
def sdpa_used(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    used = int((mask == 0).flatten(0, 2).any(0).nonzero().max()) + 1
    return torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :used], v[:, :, :used], attn_mask=mask[..., :used],
                                                            scale=scale, enable_gqa=q.shape[1] != k.shape[1])

@sdpa_used.register_fake
def _(q, k, v, mask, scale):
    return torch.empty_like(q)

if length_op:
    original = att._transformers_attention
    def patched(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if query.device.type == "cpu" and torch.compiler.is_compiling():
            out = torch.ops.eagle3x.sdpa_used(query, key, value, attention_mask[:, :, :, : key.shape[-2]], scaling)
            return out.transpose(1, 2).contiguous(), None
        return original(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    att._transformers_attention = patched

import os
DIRECT = os.environ.get("DIRECT") == "1"
if DIRECT:
    torch.library.register_fake("_C::onednn_mm")(lambda c, a, bias, h: None)
def fwd(handle, bias, n, x):
    if DIRECT:
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype)
        torch.ops._C.onednn_mm(out, x.reshape(-1, x.shape[-1]), bias, handle)
        return out
    return torch.ops.eagle3x.onednn_linear(x, handle, bias, n)
if os.environ.get("CPPW") == "1":
    import torch._inductor.config as ic
    ic.cpp_wrapper = True
GUARDS = os.environ.get("NOGUARD") == "1"

model, tok = load_target("smollm2-135m", device="cpu", dtype=dtype)
ids = tok.apply_chat_template([{"role": "user", "content": "Write a short story about a robot learning to paint."}], add_generation_prompt=True, return_dict=True)["input_ids"]

FORWARDS = {}
def patch():
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            if m not in FORWARDS:
                pack, bias = pl._packed(m, [m])
                FORWARDS[m] = functools.partial(fwd, pack.handle, bias, m.out_features)
            m.__dict__["forward"] = FORWARDS[m]

comp = inductor()
if GUARDS:
    comp = lambda step: torch.compile(step, fullgraph=True, dynamic=False, options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
static = StaticConfig(capacity=2048, compile=comp)
ref = generate(model, [ids], max_new_tokens=96).tokens[0]
patch()
t = time.perf_counter(); generate(model, [ids], max_new_tokens=8, static=static); print("first (compile) s %.1f" % (time.perf_counter() - t))
res = {"eager": [], "static": []}
for rep in range(3):
    for name in res:
        if name == "static":
            patch()
        t = time.perf_counter(); r = generate(model, [ids], max_new_tokens=96, static=static if name == "static" else None)
        res[name].append(1000 * (time.perf_counter() - t) / 96)
        if rep == 0: print(name, "same tokens" if r.tokens[0] == ref else "DIFFERENT")
for k, v in res.items(): print(k, ["%.1f" % x for x in v], "min %.1f" % min(v))
from torch.profiler import profile, ProfilerActivity
patch()
with profile(activities=[ProfilerActivity.CPU]) as p:
    generate(model, [ids], max_new_tokens=64, static=static)
ka = p.key_averages()
for e in sorted(ka, key=lambda e: -e.self_cpu_time_total)[:8]:
    print("%-60s %7.3f ms/token %6.1f calls/token" % (e.key[:60], e.self_cpu_time_total/1000/64, e.count/64))
