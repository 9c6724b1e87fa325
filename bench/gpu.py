"""GPU benchmark: our decoding and training kernels on 8B-shaped random-weight targets, torch + transformers only.

  python -m bench.gpu                    # one CUDA GPU, about 10 minutes at most (see --budget-s)
  python -m bench.gpu --tiny             # tiny shapes, on the CPU when there is no GPU (what the test runs)

Nothing is downloaded and nothing outside torch, transformers and eagle_core is imported (no Ray, MLflow or
pyarrow), so it runs on a bare CUDA box with no network. The targets have the published shapes of Llama-3.1-8B
and Qwen3-8B (bf16) and random weights: built from transformers' config classes on the meta device, then
materialised on the GPU and filled with random numbers there. Speed does not depend on the weights' values.

Per target:
* verify: our verify forward (`eagle_core.verify.verify_tree`: `eagle_core.kv.target_forward` with a tree mask,
  aux capture, lm_head on every node) of 1-64 new tokens on a cache of `--context-tokens`, and transformers' own
  forward of the same tokens (its DynamicCache, logits of every token), each against its one-token time; and our
  verify again with the kv heads repeated as transformers attends on a GPU (`eagle_core.attention.folds_gqa` off);
* plain: our plain step (`eagle_core.decoding.plain_step`) against transformers' one-token forward;
* static: the static path (`eagle_core.static_kv`): its plain step and its verify step (forward, acceptance and
  keep) at every width, uncompiled and, with `--compile MODE`, compiled (`torch.compile(fullgraph=True,
  dynamic=False)`, MODE "reduce-overhead" capturing CUDA graphs), each against the eager plain step; and 32 greedy
  plain steps of each against the eager loop's tokens (`tokens_equal_eager`), with the compile time;
* draft: one draft level of an EAGLE-3 draft of the target's shape (`eagle_core.autotune.draft_cases` at depth 1
  and 7 of the recipes' top-k 10: (t7 - t1) / 6);
  all of these timed together, round-robin (`eagle_core.autotune.timed`, the CPU cost table's timer), so a
  drift lands on every case alike;
* extraction: `eagle_core.capture.capture_features` on a batch, tokens/s and peak memory.
Then TTT: one training step (`eagle_core.ttt.train_step`: target distribution, TTT forward, backward, AdamW) of
the Llama-3.1-8B-shaped draft (fp32 weights, bf16 autocast on CUDA, as the training job runs it) on random
bf16 features of 2k, 4k and 8k tokens: tokens/s and peak memory. An out-of-memory error is recorded for its
length and the run goes on.

Every timing waits for the GPU (`torch.cuda.synchronize`, through `eagle_core.timing.clock`). A time budget
(`--budget-s`, from the start) is checked before each part; what it leaves out is listed under `skipped`. Writes
one JSON file and its Markdown twin (default bench/results/gpu.json and gpu.md) with the command, the machine and
the date inside. Exits 1 if a part failed with an error other than out-of-memory, after writing the file.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.common import RESULTS, command, machine, write_json, write_markdown
from eagle_core import attention
from eagle_core.autotune import draft_cases, target_forward_cases, timed
from eagle_core.decoding import plain_step, prefill
from eagle_core.timing import clock
from eagle_core.draft import DraftConfig, Eagle3Draft
from eagle_core.kv import TargetKV, _cache_kwarg
from eagle_core.static_kv import StaticKV
from eagle_core.static_rows import StaticConfig, inductor
from eagle_core.target import default_aux_layer_ids
from eagle_core.capture import capture_features
from eagle_core.teacher import with_targets
from eagle_core.tree import tree_from_parents
from eagle_core.ttt import TrainConfig, make_optimizer, make_scheduler, train_step, ttt_forward
from eagle_core.verify import SamplingConfig

NEEDS_CUDA = ("bench.gpu: needs a CUDA GPU (torch.cuda.is_available() is False); "
              "`python -m bench.gpu --tiny` runs the same code on the CPU with tiny shapes")

# The published shapes (the models' config.json on the hub); weights are random.
TARGETS = {
    "llama3.1-8b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)),
    "qwen3-8b": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)),
}
# --tiny: the same families, shapes a CPU runs in seconds (6 layers: the default aux layers 2, 3, 3 exist).
# The rope settings stay the published ones (Llama's llama3 scaling included): they cost nothing at any size.
TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=2)
TTT_TARGET = "llama3.1-8b"  # the draft whose training step is measured

DEFAULTS = dict(widths=(1, 2, 4, 8, 16, 32, 48, 64), context_tokens=1024, repeats=15, top_k=10, depth=7,
                draft_vocab_size=32000, ttt_steps=7, ttt_lengths=(2048, 4096, 8192), train_steps=3,
                extract_batch=4, extract_tokens=2048, extract_repeats=3, budget_s=540.0)
TINY = dict(DEFAULTS, widths=(1, 4, 16, 64), context_tokens=64, repeats=2, draft_vocab_size=256,
            ttt_lengths=(32, 64, 128), train_steps=2, extract_batch=2, extract_tokens=64, extract_repeats=2,
            budget_s=120.0)


# ---- time budget and failures ---------------------------------------------------------------------------------

class Budget:
    """Seconds since the start against a limit; `allows(what)` is asked before each part and records a refusal."""

    def __init__(self, seconds: float):
        self.seconds, self.started, self.skipped = seconds, time.perf_counter(), []

    def used(self) -> float:
        return time.perf_counter() - self.started

    def allows(self, what: str) -> bool:
        if self.used() < self.seconds:
            return True
        self.skipped.append({"what": what, "why": f"time budget: {self.used():.0f} s used of {self.seconds:.0f} s"})
        print(f"[bench.gpu] skipped {what}: time budget spent", flush=True)
        return False


def is_oom(err: BaseException) -> bool:
    """CUDA's allocator raises OutOfMemoryError; cuBLAS and some kernels report the same as a RuntimeError."""
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower() \
        or "CUBLAS_STATUS_ALLOC_FAILED" in str(err)


def failure(err: BaseException) -> dict:
    """What a failed part records: out-of-memory is a result (the shape does not fit), anything else a bug."""
    line = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:400]
    if is_oom(err):
        return {"error": line, "out_of_memory": True}
    traceback.print_exc()
    return {"error": line, "out_of_memory": False}


def free_memory() -> None:
    """Give cached blocks back after a part's tensors are gone (a failed part's frames are released by then)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def attempt(fn, *args) -> dict:
    """fn(*args), or its failure; memory is freed either way (outside the except block, where the traceback,
    which holds the failed frames' tensors, is gone)."""
    try:
        out = fn(*args)
    except Exception as err:  # one part's failure is recorded; the other parts still run
        out = failure(err)
    free_memory()
    return out


# ---- memory ---------------------------------------------------------------------------------------------------

def _gib(n: int) -> float:
    return round(n / 2**30, 3)


class PeakMemory:
    """torch's peak allocation on CUDA over a block, and how far it rose above what was allocated at its start;
    None on the CPU (the process RSS would mix in every earlier part)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc):
        return False

    def record(self) -> dict:
        if not self.cuda:
            return {"peak_memory_gib": None, "peak_above_resident_gib": None}
        peak = torch.cuda.max_memory_allocated(self.device)
        return {"peak_memory_gib": _gib(peak), "peak_above_resident_gib": _gib(peak - self.start)}


# ---- targets --------------------------------------------------------------------------------------------------

def target_config(name: str, tiny: bool):
    """The transformers config of target `name` (its published shape, or TINY_SHAPE), SDPA attention."""
    import transformers

    class_name, shape = TARGETS[name]
    shape = {**shape, **TINY_SHAPE} if tiny else shape
    config = getattr(transformers, class_name)(**shape)
    config._attn_implementation = "sdpa"  # what eagle_core's decoding runs on (eagle_core.attention.our_attention)
    return config


@torch.no_grad()
def random_init_(model, std: float = 0.02) -> None:
    """Fill a materialised (`to_empty`) model: norms' weights 1, every other weight N(0, std), biases 0, and the
    rotary frequencies recomputed (`to_empty` leaves buffers as garbage) by building the rotary module again."""
    for module in model.modules():
        is_norm = "Norm" in type(module).__name__
        for pname, param in module.named_parameters(recurse=False):
            if pname == "bias":
                param.zero_()
            elif is_norm:
                param.fill_(1.0)
            else:
                param.normal_(0.0, std)
        if "inv_freq" in module._buffers:
            device = module._buffers["inv_freq"].device
            with torch.device(device):  # rotary modules take (config) in transformers 5, (config, device=None) in 4
                fresh = type(module)(module.config)
            for bname, buf in fresh._buffers.items():
                module._buffers[bname] = buf.to(device)
            if "original_inv_freq" in vars(module):  # transformers 4 keeps it as a plain attribute
                module.original_inv_freq = fresh.original_inv_freq.to(device)
        elif module._buffers:  # a buffer this function does not know how to fill would stay garbage
            raise TypeError(f"{type(module).__name__} has buffers {sorted(module._buffers)} random_init_ cannot fill")


def build_target(name: str, tiny: bool, device: torch.device, dtype: torch.dtype):
    """A random-weight causal LM of target `name`'s shape: built on the meta device (no memory, no init), then
    materialised on `device` in `dtype` and filled there (an 8B model's 16 GB never pass through the host)."""
    import transformers

    config = target_config(name, tiny)
    model_class = getattr(transformers, TARGETS[name][0].replace("Config", "ForCausalLM"))
    with torch.device("meta"):
        model = model_class(config)
    model = model.to(dtype).to_empty(device=device)
    random_init_(model, std=config.initializer_range)
    model.eval().requires_grad_(False)
    return model


def shape_of(config) -> dict:
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim")
    return {k: getattr(config, k) for k in keys}


# ---- the parts ------------------------------------------------------------------------------------------------

def decode_costs(model, draft, opts, device: torch.device) -> dict:
    """Our verify forward and transformers' forward at every width, our plain step, the draft at depth 1 and
    `opts.depth`, all timed interleaved; each forward also as a ratio to its own one-token time."""
    from transformers import DynamicCache

    widths, context = list(opts.widths), opts.context_tokens
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, context + max(widths)), generator=g).to(device)
    cache_kw = _cache_kwarg(model)
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=ids[:, :context], use_cache=True, **{cache_kw: cache})

    def transformers_forward(width):  # logits of every new token, then the cache cropped back
        return (lambda: model(input_ids=ids[:, context: context + width], use_cache=True, logits_to_keep=0,
                              **{cache_kw: cache}),
                lambda: cache.crop(-width))  # a negative count: the tokens removed (transformers 4 and 5)

    aux = list(draft.config.aux_layer_ids)
    kv = TargetKV(1, device)
    with torch.inference_mode():
        prefill(model, kv, [ids[0, :context].tolist()], aux)
    token = ids[0, context: context + 1]
    depths = sorted({1, opts.depth})
    static_checks, static_cases = static_path(model, opts, ids, context, aux)
    verify_cases = target_forward_cases(model, widths, context, aux)
    ms = timed(device, {
        "verify": verify_cases,
        "verify, kv heads repeated": {w: (repeating_kv_heads(run), reset) for w, (run, reset) in verify_cases.items()},
        "transformers": {w: transformers_forward(w) for w in widths},
        "plain": {1: (lambda: plain_step(model, kv, token, SamplingConfig(), None, aux),
                      lambda: kv.truncate_(context))},
        "draft": draft_cases(draft, opts.top_k, depths, context), **static_cases}, opts.repeats)
    verify, hf = ms["verify"], ms["transformers"]
    static = {name: {"plain_step_ms": ms[f"{name} plain"][1],
                     "plain_over_eager": ms[f"{name} plain"][1] / ms["plain"][1],
                     "verify_ms": {str(w): ms[f"{name} verify"][w] for w in widths},
                     "verify_over_eager_plain_step": {str(w): ms[f"{name} verify"][w] / ms["plain"][1]
                                                      for w in widths},
                     **static_checks[name]} for name in static_checks}
    level = (ms["draft"][depths[-1]] - ms["draft"][depths[0]]) / max(depths[-1] - depths[0], 1)
    return {
        "context_tokens": context, "repeats": opts.repeats,
        "verify": {"ms": {str(w): verify[w] for w in widths},
                   "over_one_token": {str(w): verify[w] / verify[1] for w in widths},
                   # the CPU cost table's measure: a round's verify against the plain step it replaces
                   "over_plain_step": {str(w): verify[w] / ms["plain"][1] for w in widths}},
        "transformers_forward": {"ms": {str(w): hf[w] for w in widths},
                                 "over_one_token": {str(w): hf[w] / hf[1] for w in widths}},
        "verify_over_transformers": {str(w): verify[w] / hf[w] for w in widths},
        # the same verify attending as transformers does on a GPU (kv heads repeated): what `folded_gqa_sdpa` saves
        "verify_kv_heads_repeated_ms": {str(w): ms["verify, kv heads repeated"][w] for w in widths},
        "plain": {"our_step_ms": ms["plain"][1], "transformers_forward_ms": hf[1],
                  "ours_over_transformers": ms["plain"][1] / hf[1]},
        "draft": {"top_k": opts.top_k, "depth_ms": {str(d): ms["draft"][d] for d in depths},
                  "level_ms": level, "draft_vocab_size": draft.config.draft_vocab_size},
        "static": static,
    }


def repeating_kv_heads(run):
    """`run` with the grouped-query fold off (`eagle_core.attention.GQA_FOLD_DEVICES` empty): a masked attention of
    2+ queries on a GPU then repeats the kv heads, as transformers does. On a CPU it changes nothing (SDPA's own
    grouped-query path runs first)."""
    def repeated():
        devices, attention.GQA_FOLD_DEVICES = attention.GQA_FOLD_DEVICES, frozenset()
        try:
            return run()
        finally:
            attention.GQA_FOLD_DEVICES = devices
    return repeated


def static_path(model, opts, ids, context: int, aux) -> tuple[dict, dict]:
    """({variant: {tokens_equal_eager, compile_s}}, timing cases) of the static path: "static" (uncompiled) and,
    with --compile, "compiled". Each variant's cache is prefilled with the same context; 32 greedy plain steps from
    it are held against the eager loop's tokens (the compiled variant compiles there, timed), then the cases time
    a plain step and a verify step of every width, each rolled back after (`truncate_`)."""
    greedy, widths, steps = SamplingConfig(), list(opts.widths), 32
    prompt, first = [ids[0, :context].tolist()], ids[0, context: context + 1]
    variants = {"static": StaticConfig(capacity=context + steps + 2 * max(widths))}
    if opts.compile != "none":
        mode = None if opts.compile == "default" else opts.compile
        variants["compiled"] = StaticConfig(capacity=context + steps + 2 * max(widths), compile=inductor(mode))
    trees = {w: tree_from_parents(ids[:, context: context + w], torch.clamp(torch.arange(w) - 1, min=0)[None].to(
        ids.device)) for w in widths}  # chains: a verify's cost depends on its width, not its shape

    def greedy_tokens(kv) -> tuple[list[int], float]:
        with torch.inference_mode():
            prefill(model, kv, prompt, aux)
            token, out, t0 = first, [], clock(ids.device)
            for _ in range(steps):
                token, _ = plain_step(model, kv, token, greedy, None, aux)
                out.append(int(token))
            seconds = clock(ids.device) - t0
        kv.truncate_(context)
        return out, seconds

    eager_tokens, _ = greedy_tokens(TargetKV(1, ids.device))
    checks, cases = {}, {}
    for name, config in variants.items():
        kv = StaticKV(model, 1, config)
        tokens, seconds = greedy_tokens(kv)
        checks[name] = {"tokens_equal_eager": tokens == eager_tokens, "greedy_steps": steps,
                        "first_steps_s": seconds}  # includes the compilation for "compiled"
        cases[f"{name} plain"] = {1: (lambda kv=kv: plain_step(model, kv, first, greedy, None, aux),
                                      lambda kv=kv: kv.truncate_(context))}
        cases[f"{name} verify"] = {w: (lambda kv=kv, w=w: kv.verify(trees[w], greedy, None, aux, w),
                                       lambda kv=kv: kv.truncate_(context)) for w in widths}
    return checks, cases


def extraction(model, opts, device: torch.device) -> dict:
    """`capture_features` (aux layers + final hidden state, no lm_head) on a batch of random tokens."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (opts.extract_batch, opts.extract_tokens), generator=g).to(device)
    aux = default_aux_layer_ids(model.config.num_hidden_layers)
    capture_features(model, ids, aux_layer_ids=aux)  # warm-up
    times = []
    with PeakMemory(device) as mem:
        for _ in range(opts.extract_repeats):
            t0 = clock(device)
            feats = capture_features(model, ids, aux_layer_ids=aux)
            times.append(clock(device) - t0)
            del feats
    seconds = sorted(times)[len(times) // 2]
    return {"batch": opts.extract_batch, "tokens_per_row": opts.extract_tokens, "aux_layer_ids": aux,
            "ms": 1000 * seconds, "tokens_per_s": ids.numel() / seconds, **mem.record()}


def target_part(name: str, opts, device: torch.device, budget: Budget) -> dict:
    """Build target `name`, time its decoding costs and its extraction; everything it built is freed on return."""
    t0 = time.perf_counter()
    model = build_target(name, opts.tiny, device, torch.bfloat16)
    out = {"config_class": TARGETS[name][0], "shape": shape_of(model.config), "dtype": "bfloat16",
           "parameters": sum(p.numel() for p in model.parameters()),
           "attention": model.config._attn_implementation, "build_s": round(time.perf_counter() - t0, 2)}
    print(f"[bench.gpu] {name}: built {out['parameters'] / 1e6:,.1f} M parameters in {out['build_s']} s", flush=True)
    if budget.allows(f"{name} decoding costs"):
        with torch.device(device):  # the draft's layers are created on the device, not filled on the host
            draft = Eagle3Draft.from_target(model, draft_vocab_size=opts.draft_vocab_size)
        draft = draft.to(torch.bfloat16).eval()
        draft.set_target_embeddings(model.get_input_embeddings().weight)
        out["decode"] = attempt(decode_costs, model, draft, opts, device)
        del draft
        free_memory()
        print(f"[bench.gpu] {name}: decode {json.dumps(out['decode'])[:300]}", flush=True)
    if budget.allows(f"{name} extraction"):
        out["extraction"] = attempt(extraction, model, opts, device)
        print(f"[bench.gpu] {name}: extraction {json.dumps(out['extraction'])}", flush=True)
    return out


def ttt_draft(opts, device: torch.device):
    """The draft of TTT_TARGET's shape in fp32 (the training job's master weights), with random frozen target
    embeddings and a random target lm_head (fp32, as the job loads them), wired as `Eagle3Draft.from_target`
    wires them."""
    tc = target_config(TTT_TARGET, opts.tiny)
    cfg = DraftConfig.from_target(tc, draft_vocab_size=opts.draft_vocab_size, ttt_steps=opts.ttt_steps)
    g = torch.Generator(device=device).manual_seed(3)
    with torch.device(device):
        embed = torch.randn(tc.vocab_size, tc.hidden_size, generator=g) * 0.02
        head = torch.randn(tc.vocab_size, tc.hidden_size, generator=g) * 0.02
        draft = Eagle3Draft(cfg, embed)
    return draft, head, tc


def ttt_step(draft, head, tc, length: int, opts, device: torch.device) -> dict:
    """Training steps at `length` tokens (batch 1): one untimed (AdamW's state is created there), then the
    median of `opts.train_steps`; the target distribution is computed inside the step, as the training job does."""
    g = torch.Generator(device=device).manual_seed(length)
    features = torch.bfloat16  # what extraction writes on a GPU
    batch = {"input_ids": torch.randint(0, tc.vocab_size, (1, length), generator=g, device=device),
             "loss_mask": torch.ones(1, length, dtype=torch.long, device=device),
             "aux_hidden": torch.randn(1, length, 3 * tc.hidden_size, generator=g, device=device).to(features),
             "last_hidden": torch.randn(1, length, tc.hidden_size, generator=g, device=device).to(features)}
    cfg = TrainConfig(total_steps=opts.train_steps + 1, ttt_steps=opts.ttt_steps)
    optimizer = make_optimizer(draft, cfg)
    scheduler = make_scheduler(optimizer, cfg)

    def forward(d, *args, **kwargs):  # the training job's objective: bf16 autocast on CUDA
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            return ttt_forward(d, *args, **kwargs)

    def step():
        return train_step(draft, with_targets(batch, head, draft.d2t), head, optimizer, scheduler, cfg,
                          forward=forward)

    step()
    times, losses = [], []
    with PeakMemory(device) as mem:
        for _ in range(opts.train_steps):
            t0 = clock(device)
            metrics = step()
            times.append(clock(device) - t0)
            losses.append(metrics["loss"])
    seconds = sorted(times)[len(times) // 2]
    return {"tokens": length, "step_ms": 1000 * seconds, "tokens_per_s": length / seconds,
            "loss_finite": all(x == x and abs(x) != float("inf") for x in losses), **mem.record()}


def ttt_part(opts, device: torch.device, budget: Budget) -> dict:
    draft, head, tc = ttt_draft(opts, device)
    out = {"draft_of": TTT_TARGET, "draft_shape": {k: getattr(draft.config, k) for k in (
               "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "draft_vocab_size", "target_vocab_size", "ttt_steps")},
           "trainable_parameters": draft.num_trainable(), "weights": "float32",
           "autocast": "bfloat16" if device.type == "cuda" else None, "features": "bfloat16", "batch": 1,
           "timed_steps": opts.train_steps, "by_length": {}}
    for length in opts.ttt_lengths:
        if not budget.allows(f"TTT step at {length} tokens"):
            continue
        draft.zero_grad(set_to_none=True)  # each length starts from the weights alone (no earlier gradients)
        free_memory()
        result = attempt(ttt_step, draft, head, tc, length, opts, device)
        out["by_length"][str(length)] = result
        print(f"[bench.gpu] TTT {length} tokens: {json.dumps(result)}", flush=True)
    return out


# ---- the report -----------------------------------------------------------------------------------------------

def machine_info(device: torch.device) -> dict:
    import transformers

    info = {"line": machine(), "device": device.type, "cpu_cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=_gib(props.total_memory), gpu_count=torch.cuda.device_count())
    return info


def _num(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _failed(part: dict) -> str | None:
    return f"failed: {part['error']}" if "error" in part else None


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# GPU benchmark{' (tiny shapes)' if result['tiny'] else ''}", "",
             f"`{result['command']}` on {m.get('gpu', m['line'])} ({m['device']}), {result['date']}; torch "
             f"{m['torch']} (CUDA {m['cuda']}), transformers {m['transformers']}. Random-weight bf16 targets of "
             f"{'tiny' if result['tiny'] else 'the published'} shapes; {result['elapsed_s']:.0f} s of a "
             f"{result['budget_s']:.0f} s budget.", ""]
    for name, t in result["targets"].items():
        s = t.get("shape", {})
        lines += [f"## {name}", ""]
        if "error" in t:
            lines += [_failed(t), ""]
            continue
        lines += [f"{t['parameters'] / 1e6:,.1f} M parameters ({s['num_hidden_layers']} layers, hidden "
                  f"{s['hidden_size']}, vocabulary {s['vocab_size']}), built in {t['build_s']} s.", ""]
        d = t.get("decode")
        if d and "error" not in d:
            widths = list(d["verify"]["ms"])
            lines += [f"Forward of N new tokens on a {d['context_tokens']}-token cache (median of {d['repeats']}, "
                      "interleaved):", "",
                      "| forward | " + " | ".join(f"{w} tok" for w in widths) + " |",
                      "|---|" + "---:|" * len(widths),
                      "| ours (verify), ms | " + " | ".join(_num(d["verify"]["ms"][w]) for w in widths) + " |",
                      "| ours, × one token | " + " | ".join(_num(d["verify"]["over_one_token"][w]) for w in widths)
                      + " |",
                      "| ours, × our plain step | "
                      + " | ".join(_num(d["verify"]["over_plain_step"][w]) for w in widths) + " |",
                      "| ours, kv heads repeated (transformers' GPU attention), ms | "
                      + " | ".join(_num(d.get("verify_kv_heads_repeated_ms", {}).get(w)) for w in widths) + " |",
                      "| transformers, ms | " + " | ".join(_num(d["transformers_forward"]["ms"][w]) for w in widths)
                      + " |",
                      "| transformers, × one token | "
                      + " | ".join(_num(d["transformers_forward"]["over_one_token"][w]) for w in widths) + " |",
                      "", f"Our plain step {_num(d['plain']['our_step_ms'])} ms against transformers' one-token "
                      f"forward {_num(d['plain']['transformers_forward_ms'])} ms "
                      f"({_num(d['plain']['ours_over_transformers'])}×). One draft level (top-k "
                      f"{d['draft']['top_k']}, draft vocabulary {d['draft']['draft_vocab_size']}): "
                      f"{_num(d['draft']['level_ms'])} ms.", ""]
            for name, st in d.get("static", {}).items():
                same = "equal" if st["tokens_equal_eager"] else "DIFFER FROM"
                lines += [f"Static path ({name}): plain step {_num(st['plain_step_ms'])} ms "
                          f"({_num(st['plain_over_eager'])}× the eager step); verify step (forward, acceptance, keep) "
                          + ", ".join(f"{w} tok {_num(st['verify_ms'][w])} ms" for w in widths)
                          + f"; {st['greedy_steps']} greedy steps {same} the eager loop's tokens (first steps "
                          f"{_num(st['first_steps_s'])} s).", ""]
        elif d:
            lines += [f"Decoding costs {_failed(d)}", ""]
        e = t.get("extraction")
        if e and "error" not in e:
            lines += [f"Extraction (`capture_features`, batch {e['batch']} × {e['tokens_per_row']} tokens): "
                      f"{e['tokens_per_s']:.0f} tokens/s, peak memory {_num(e['peak_memory_gib'])} GiB.", ""]
        elif e:
            lines += [f"Extraction {_failed(e)}", ""]
    ttt = result.get("ttt")
    if ttt and "error" not in ttt:
        ds = ttt["draft_shape"]
        lines += [f"## TTT training step, {ttt['draft_of']}-shaped draft", "",
                  f"Hidden {ds['hidden_size']}, draft vocabulary {ds['draft_vocab_size']}, {ds['ttt_steps']} TTT "
                  f"steps, {ttt['trainable_parameters'] / 1e6:,.2f} M trainable parameters; fp32 weights, autocast "
                  f"{ttt['autocast']}, batch 1, median of {ttt['timed_steps']} steps.", "",
                  "| tokens | step ms | tokens/s | peak GiB | above resident GiB |", "|---:|---:|---:|---:|---:|"]
        for length, r in ttt["by_length"].items():
            if "error" in r:
                kind = "out of memory" if r["out_of_memory"] else "failed"
                lines.append(f"| {length} | {kind}: {r['error'][:80]} | | | |")
            else:
                lines.append(f"| {length} | {_num(r['step_ms'], 1)} | {r['tokens_per_s']:.0f} | "
                             f"{_num(r['peak_memory_gib'])} | {_num(r['peak_above_resident_gib'])} |")
        lines.append("")
    elif ttt:
        lines += ["## TTT training step", "", _failed(ttt), ""]
    if result["skipped"]:
        lines += ["## Skipped", ""] + [f"- {s['what']}: {s['why']}" for s in result["skipped"]] + [""]
    return "\n".join(lines)


def errors(result: dict) -> list[str]:
    """Every part that failed with something other than out-of-memory (those are results, not bugs)."""
    found = []

    def walk(node, where):
        if isinstance(node, dict):
            if "error" in node and not node.get("out_of_memory"):
                found.append(f"{where}: {node['error']}")
            for k, v in node.items():
                walk(v, f"{where}.{k}" if where else k)

    walk(result, "")
    return found


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes (seconds on a CPU; on the CPU when there is no GPU): the test's run")
    p.add_argument("--out", type=Path, default=None,
                   help="result JSON (the Markdown beside it); default bench/results/gpu.json, gpu-tiny.json with "
                        "--tiny")
    p.add_argument("--targets", default=",".join(TARGETS),
                   help=f"comma-separated, of {', '.join(TARGETS)} (empty: none, only the TTT steps)")
    p.add_argument("--widths", type=_ints, default=None, help="verify widths in tokens (default 1,2,4,...,64)")
    p.add_argument("--context-tokens", type=int, default=None, help="cache length of the decoding costs")
    p.add_argument("--ttt-lengths", type=_ints, default=None, help="TTT step lengths (default 2048,4096,8192)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds from the start after which the remaining parts are skipped (default 540)")
    p.add_argument("--no-ttt", action="store_true", help="skip the TTT training steps")
    p.add_argument("--compile", default="none", choices=("none", "default", "reduce-overhead", "max-autotune"),
                   help="also time the static path compiled with torch.compile in this mode (reduce-overhead: "
                        "CUDA graphs); default none")
    args = p.parse_args(argv)
    base = TINY if args.tiny else DEFAULTS
    for key, value in base.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.targets = [t for t in args.targets.split(",") if t]
    unknown = set(args.targets) - set(TARGETS)
    if unknown:
        p.error(f"unknown targets {sorted(unknown)}; choose from {', '.join(TARGETS)}")
    if 1 not in args.widths:
        p.error("--widths must include 1 (every width is compared with the one-token forward)")
    return args


def main(argv=None) -> int:
    opts = parse_args(argv)
    budget = Budget(opts.budget_s)
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    elif opts.tiny:
        device = torch.device("cpu")
    else:
        print(NEEDS_CUDA, flush=True)
        return 0
    out = opts.out or RESULTS / ("gpu-tiny.json" if opts.tiny else "gpu.json")
    torch.manual_seed(0)
    result = {"benchmark": "bench.gpu", "command": command("gpu", argv),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "tiny": opts.tiny,
              "machine": machine_info(device), "budget_s": opts.budget_s,
              "settings": {k: getattr(opts, k) for k in DEFAULTS if k != "budget_s"},
              "targets": {}, "ttt": None, "skipped": budget.skipped}
    print(f"[bench.gpu] {result['machine']['line']}; torch {torch.__version__}; budget {opts.budget_s:.0f} s",
          flush=True)
    for name in opts.targets:
        if budget.allows(f"{name} (build, decoding costs, extraction)"):
            result["targets"][name] = attempt(target_part, name, opts, device, budget)
    if opts.no_ttt:
        result["skipped"].append({"what": "TTT training steps", "why": "--no-ttt"})
    elif budget.allows("TTT training steps"):
        result["ttt"] = attempt(ttt_part, opts, device, budget)
    result["elapsed_s"] = round(budget.used(), 1)
    result["failures"] = errors(result)
    write_json(out, result)
    write_markdown(out, markdown(result))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
