"""TTT benchmarks.

  python -m bench.ttt                  # speed + peak memory: our TTT vs the naive full-mask TTT
  python -m bench.ttt --lengths 2048 4096 --impls ours specforge --reference /tmp/specforge --dtypes float32 bfloat16
                                       # speed + peak memory: our TTT vs SpecForge's own TTT training step
  python -m bench.ttt --lm-head-init   # which lm_head init trains better on real SmolLM2 features

  python -m bench.ttt --shape llama3.1-8b --impls ours specforge specforge-flex --lengths 2048 4096 8192 16384 \
      --dtypes bfloat16 --device cuda --iters 3 --timeout 100 --reference /tmp/specforge
                                       # the GPU comparison of issue 40 (one H200); add --profile 15 for kernels

Speed: one training step (forward, loss = sum_k 0.8**k * step loss k, backward, AdamW) of the draft of `--shape`
(`SHAPES`: a target's published hidden size, heads, kv heads, intermediate size and vocabulary, with its recipe's
draft vocab and TTT steps; default the SmolLM2 one, `tiny` for a CPU test; random weights, batch 1) at each
sequence length and dtype, in a fresh subprocess per (implementation, length, dtype) so that the peak memory of one run is not hidden
by another's. Peak memory is the process's peak RSS minus its RSS just before the first step on CPU, and torch's peak
allocation on CUDA. Results: bench/results/ttt.json and its table ttt.md (`--out` elsewhere); every finished run is
written at once, and a run that fails (out of memory under `--mem-limit-gib`, past `--timeout`) is recorded as such.

Implementations: "ours" = `eagle_core.ttt.ttt_forward`; "naive" = `eagle_core.ttt_naive.ttt_forward_naive` (the full (K*L)^2 mask);
"specforge" = SpecForge's own `OnlineEagle3Model` (specforge/algorithms/eagle3/model.py) with its draft
`LlamaForCausalLMEagle3` (specforge/modeling/draft/llama3_eagle.py), attention backend "sdpa" ("specforge-flex":
its "flex_attention" backend, which needs CUDA: torch has no FlexAttention backward on a CPU), TTT length = our
ttt_steps, its compact teacher (the teacher computed from the target's last hidden state inside the step, as ours
does). It is imported at run time from the checkout given by `--reference DIR` (or $SPECFORGE_DIR); no SpecForge code
is kept in this repository. A checkout from a git mirror without a work tree:

  mkdir -p /tmp/specforge && git -C <mirror> archive HEAD | tar -x -C /tmp/specforge

(such an export is no git checkout: pass `--reference-commit <commit>` to have the commit recorded). On a CPU, what
cannot run there is substituted, and the result file lists it (`SPECFORGE_SUBSTITUTIONS`): SpecForge's package
`__init__` files are replaced by empty packages (they import GPU-only algorithms), and, where Triton or CUDA is
missing, its Triton loss kernel `specforge.core.loss.LogSoftmaxLoss` by `EagerLogSoftmaxLoss` below, the same
function in eager PyTorch (the result's `specforge.loss` says which ran).
`--profile N`: one more step under torch.profiler after the timed ones; its top N ops go into the result.

Both sides get the same weights (our draft's state_dict loaded into SpecForge's draft), the same random batch, a
draft vocabulary that holds every target argmax of the batch (SpecForge drops positions whose target is outside the
draft vocab, ours counts them: with this vocab both count the same positions), the same AdamW. bfloat16 = the way
pipelines/distill.py trains: float32 weights, `torch.autocast(bfloat16)` around the whole step, for both sides.
Before timing, a harness check (float32, `--check-length` tokens, not timed) runs both on the same inputs and
records the per-step losses, logits and gradients of each side and their differences.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
import time
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import (RESULTS, ROOT, add_draft_training_args, command, machine, smollm2_recipe, write_json,
                          write_markdown)
from eagle_core.draft import DraftConfig, Eagle3Draft
from eagle_core.target import cpu_has_native_bf16, default_device
from eagle_core.ttt import TrainConfig, make_optimizer, shift_tokens, ttt_forward
from eagle_core.ttt_naive import ttt_forward_naive

TTT_FORWARDS = {"ours": ttt_forward, "naive": ttt_forward_naive}
# SpecForge's step with each of its attention backends that runs on one device without flash-attn: "specforge" =
# "sdpa" (materialised [heads, L, L] scores, what its docs use), "specforge-flex" = "flex_attention" (a block mask,
# torch's compiled flex kernel past 128 tokens)
SPECFORGE_BACKENDS = {"specforge": "sdpa", "specforge-flex": "flex_attention"}
IMPLS = (*TTT_FORWARDS, *SPECFORGE_BACKENDS)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
STEP_DECAY = 0.8  # loss = sum_k 0.8**k * loss_k: ours (TrainConfig.step_decay) and SpecForge's training strategy
PREWARM_TOKENS = 32  # an untimed forward+backward at this length before the memory baseline (compiles SpecForge's
# torch.compile'd helpers; done for every implementation alike); no optimizer step, so AdamW's state stays in the peak
SPECFORGE_PACKAGES = ("specforge", "specforge.modeling", "specforge.modeling.draft", "specforge.core",
                      "specforge.algorithms", "specforge.algorithms.eagle3")
SPECFORGE_SUBSTITUTIONS = [
    "package __init__ files of " + ", ".join(SPECFORGE_PACKAGES) + " not run: empty package modules with __path__ "
    "into the checkout stand in for them (they import every algorithm and draft, some GPU-only); "
    "specforge.modeling.draft gets the one name model.py imports from it, Eagle3DraftModel (from its base.py)",
    "specforge.core.loss (imports triton; LogSoftmaxLoss is a Triton kernel) replaced, where Triton or CUDA is missing, by a module whose LogSoftmaxLoss "
    "is bench.ttt.EagerLogSoftmaxLoss: per row -sum(target * log_softmax(logits.float())), 0 where position_mask is "
    "0, mean over all B*T rows; it saves what the kernel saves (logits, target, mask and one log-sum-exp per row), "
    "works in blocks of rows, and its backward writes the gradient into the saved logits in place, as the kernel does",
]


# ---------------------------------------------------------------------------------------------------
# the drafts measured (`--shape`)


@dataclass(frozen=True)
class Shape:
    """The target a draft is built for: its published shapes (a transformers LlamaConfig's keyword arguments: the
    draft layer is a Llama layer for every target), where they come from, and the recipe that gives the draft
    vocabulary and TTT steps (or both given here, for a shape without a recipe)."""
    source: str
    target: dict
    recipe: str | None = None
    draft_vocab_size: int | None = None
    ttt_steps: int | None = None


SHAPES = {
    "smollm2": Shape(
        "HuggingFaceTB/SmolLM2-135M-Instruct config.json (the embedded target smollm2-135m)",
        dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
             vocab_size=49152, num_hidden_layers=30, rms_norm_eps=1e-5, rope_theta=100000.0,
             max_position_embeddings=8192),
        recipe="smollm2-135m-instruct"),
    "llama3.1-8b": Shape(
        "meta-llama/Llama-3.1-8B-Instruct config.json",
        dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
             vocab_size=128256, num_hidden_layers=32, rms_norm_eps=1e-5, rope_theta=500000.0,
             max_position_embeddings=131072,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}),
        recipe="llama3.1-8b-instruct"),
    "qwen3-8b": Shape(
        "Qwen/Qwen3-8B config.json",
        dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
             vocab_size=151936, num_hidden_layers=36, rms_norm_eps=1e-6, rope_theta=1000000.0,
             max_position_embeddings=40960),
        recipe="qwen3-8b"),
    # A shape a CPU runs in seconds (the test suite's): no published model; 7 TTT steps as every recipe.
    "tiny": Shape("bench.ttt's own tiny shape (no published model)",
                  dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                       vocab_size=512, num_hidden_layers=6, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=4096),
                  draft_vocab_size=256, ttt_steps=7),
}


def target_config(shape: str):
    """A transformers LlamaConfig of `shape`'s target (random weights are built from it; no model files)."""
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPES[shape].target, tie_word_embeddings=False)


def shape_settings(shape: str) -> dict:
    """draft_vocab_size, ttt_steps and lr of `shape`: its recipe's (eagle_core/recipes/), else the table's."""
    s = SHAPES[shape]
    if s.recipe is None:
        return {"draft_vocab_size": s.draft_vocab_size, "ttt_steps": s.ttt_steps, "lr": TrainConfig.lr}
    from eagle_core.recipe import load_recipe

    r = load_recipe(s.recipe)
    return {"draft_vocab_size": r.draft_vocab_size, "ttt_steps": r.ttt_steps, "lr": r.lr}


def describe_shape(shape: str) -> str:
    """The draft `shape` builds, in words: what a result's header says ran."""
    s, t, settings = SHAPES[shape], SHAPES[shape].target, shape_settings(shape)
    return (f"the {shape} draft (hidden {t['hidden_size']}, {t['num_attention_heads']} heads, "
            f"{t['num_key_value_heads']} kv heads, head dim {t['head_dim']}, intermediate {t['intermediate_size']}, "
            f"target vocab {t['vocab_size']}, from {s.source}), draft vocab {settings['draft_vocab_size']} and "
            f"ttt_steps {settings['ttt_steps']} (" + (f"recipe {s.recipe}" if s.recipe else "bench.ttt's table") + ")")


# ---------------------------------------------------------------------------------------------------
# SpecForge, imported at run time from a checkout


class EagerLogSoftmaxLoss(torch.autograd.Function):
    """Eager PyTorch version of SpecForge's Triton `LogSoftmaxLoss.apply(logits, target_p, position_mask)`.

    logits, target: [B, T, V]; position_mask: [B, T, 1]. Loss = mean over the B*T rows of
    mask_row * -sum_v target_v * log_softmax(logits)_v (float32). Backward: (softmax * sum(target) - target) * mask
    * grad / (B*T), written into the saved logits tensor (in the logits' dtype) like the kernel, so no second
    [B*T, V] tensor is kept. Blocks of `rows` rows bound the float32 temporaries.
    """

    rows = 1024

    @staticmethod
    def forward(ctx, logits, target, position_mask):
        B, T, V = logits.shape
        flat = logits.contiguous().view(B * T, V)
        target_flat = target.contiguous().view(B * T, V)
        mask = position_mask.contiguous().view(B * T).bool()
        loss = torch.zeros(B * T, dtype=torch.float32, device=logits.device)
        lse = torch.zeros(B * T, dtype=torch.float32, device=logits.device)
        for a in range(0, B * T, EagerLogSoftmaxLoss.rows):
            r = slice(a, a + EagerLogSoftmaxLoss.rows)
            x = flat[r].float()
            lse[r] = torch.logsumexp(x, dim=-1)
            row_loss = -(target_flat[r].float() * (x - lse[r, None])).sum(-1)
            loss[r] = torch.where(mask[r], row_loss, 0.0)  # the kernel skips masked rows (their loss stays 0)
        ctx.save_for_backward(logits.detach(), target, position_mask, lse)
        return loss.mean()

    @staticmethod
    def backward(ctx, grad_output):
        logits, target, position_mask, lse = ctx.saved_tensors
        B, T, V = logits.shape
        flat = logits.contiguous().view(B * T, V)
        target_flat = target.contiguous().view(B * T, V)
        mask = position_mask.contiguous().view(B * T).bool()
        g = grad_output.float() / (B * T)
        for a in range(0, B * T, EagerLogSoftmaxLoss.rows):
            r = slice(a, a + EagerLogSoftmaxLoss.rows)
            t = target_flat[r].float()
            grad = (torch.exp(flat[r].float() - lse[r, None]) * t.sum(-1, keepdim=True) - t) * g
            flat[r] = torch.where(mask[r, None], grad, 0.0).to(flat.dtype)
        return flat.view(B, T, V), None, None


def triton_loss_runs(device: str) -> bool:
    """Whether SpecForge's own Triton loss kernel can run for `device`: a CUDA device and an importable triton."""
    return str(device).startswith("cuda") and importlib.util.find_spec("triton") is not None


def specforge_loss_note(device: str) -> str:
    """Which SpecForge loss runs for `device`, in words (recorded in every result)."""
    if triton_loss_runs(device):
        return "SpecForge's own Triton kernel (specforge.core.loss.LogSoftmaxLoss)"
    return ("bench.ttt.EagerLogSoftmaxLoss, the eager stand-in for SpecForge's Triton kernel (no "
            + ("triton" if str(device).startswith("cuda") else "CUDA") + " here)")


def import_specforge(root, device: str = "cpu") -> tuple[type, type, list[str]]:
    """(OnlineEagle3Model, LlamaForCausalLMEagle3, notes) from the SpecForge checkout `root`, without running its
    package __init__ files, with its Triton loss where `triton_loss_runs(device)` and the eager stand-in elsewhere
    (`SPECFORGE_SUBSTITUTIONS`). notes: import warnings."""
    root = Path(root).resolve()
    if not (root / "specforge/algorithms/eagle3/model.py").is_file():
        raise FileNotFoundError(f"{root} is not a SpecForge checkout (no specforge/algorithms/eagle3/model.py)")
    loaded = sys.modules.get("specforge.algorithms.eagle3.model")
    if loaded is not None:
        if not Path(loaded.__file__).resolve().is_relative_to(root):
            raise RuntimeError(f"SpecForge already imported from {loaded.__file__}, not from {root}")
        draft = sys.modules["specforge.modeling.draft.llama3_eagle"]
        return loaded.OnlineEagle3Model, draft.LlamaForCausalLMEagle3, []
    for name in SPECFORGE_PACKAGES:
        package = types.ModuleType(name, "empty stand-in for a SpecForge package __init__ (bench.ttt)")
        package.__path__ = [str(root.joinpath(*name.split(".")))]
        sys.modules[name] = package
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, package)
    if triton_loss_runs(device):
        importlib.import_module("specforge.core.loss")  # the real module: torch and triton only
    else:
        loss = types.ModuleType("specforge.core.loss", "bench.ttt's eager stand-in for SpecForge's Triton loss kernel")
        loss.LogSoftmaxLoss = EagerLogSoftmaxLoss
        sys.modules["specforge.core.loss"] = sys.modules["specforge.core"].loss = loss
    base = importlib.import_module("specforge.modeling.draft.base")
    sys.modules["specforge.modeling.draft"].Eagle3DraftModel = base.Eagle3DraftModel
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llama = importlib.import_module("specforge.modeling.draft.llama3_eagle")
        model = importlib.import_module("specforge.algorithms.eagle3.model")
    notes = sorted({f"import warning: {w.message}" for w in caught if "specforge" in str(w.filename)})
    return model.OnlineEagle3Model, llama.LlamaForCausalLMEagle3, notes


def specforge_commit(root, given: str | None = None) -> str:
    """The checkout's git commit where `root` is the top of a git work tree, else `given`, else a note."""
    root = Path(root).resolve()
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=30)
        if top.returncode == 0 and Path(top.stdout.strip()).resolve() == root:
            return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                  timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return given or f"unknown ({root} is not a git checkout and no --reference-commit was given)"


def specforge_config(cfg: DraftConfig):
    """A transformers LlamaConfig of our draft's shapes, as SpecForge's draft reads it."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=cfg.target_vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        hidden_act=cfg.hidden_act, tie_word_embeddings=False,
        rope_parameters={**(cfg.rope_scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta})
    config.draft_vocab_size = cfg.draft_vocab_size
    config.target_hidden_size = cfg.target_hidden_size
    return config


def copy_weights(draft: Eagle3Draft, sf_draft) -> dict:
    """Load our draft's state_dict (weights, d2t, t2d) into SpecForge's draft, by name (both use the export names),
    and freeze what ours freezes. Returns what did not map, each way."""
    ours, theirs = draft.state_dict(), sf_draft.state_dict()
    mapped = {k: v for k, v in ours.items() if k in theirs and theirs[k].shape == v.shape}
    sf_draft.load_state_dict(mapped, strict=False)
    trainable = {name: p.requires_grad for name, p in draft.named_parameters()}
    for name, p in sf_draft.named_parameters():
        p.requires_grad_(trainable.get(name, p.requires_grad))
    return {"mapped": sorted(mapped), "ours_not_mapped": sorted(set(ours) - set(mapped)),
            "specforge_not_loaded": sorted(set(theirs) - set(mapped))}


def specforge_inputs(batch: dict) -> dict:
    """Our batch as SpecForge's EAGLE-3 strategy hands it to `OnlineEagle3Model.forward` (compact teacher).

    SpecForge shifts input ids and the target's last hidden state left by one (TargetHead.preprocess) and counts
    column t of step k when loss_mask[t+k] is set; ours counts it when loss_mask[t+k+2] is (the token it predicts):
    its loss mask here is ours shifted left by two, so both count the same columns."""
    last = batch["target_last_hidden"]
    return dict(
        input_ids=shift_tokens(batch["input_ids"], 1),
        attention_mask=torch.ones_like(batch["input_ids"]),
        target=None,
        loss_mask=shift_tokens(batch["loss_mask"], 2)[..., None],
        hidden_states=batch["aux_hidden"],
        target_hidden_for_compact=F.pad(last[:, 1:], (0, 0, 0, 1)),
        target_head_weight=batch["target_lm_head_weight"],
    )


# ---------------------------------------------------------------------------------------------------
# speed and memory of one training step


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def random_batch(tc, length: int, device: str, seed: int = 1) -> dict:
    """A batch of random features of the target `tc`'s shapes, batch 1, `length` positions."""
    g = torch.Generator().manual_seed(seed)
    h = tc.hidden_size
    batch = dict(
        input_ids=torch.randint(0, tc.vocab_size, (1, length), generator=g),
        loss_mask=torch.ones(1, length, dtype=torch.long),
        aux_hidden=torch.randn(1, length, 3 * h, generator=g),
        target_last_hidden=torch.randn(1, length, h, generator=g),
        target_lm_head_weight=torch.randn(tc.vocab_size, h, generator=g) * 0.02,
    )
    return {k: v.to(device) for k, v in batch.items()}


@torch.no_grad()
def covering_vocab(batch: dict, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(d2t, t2d, covers_all): a draft vocab holding every full-vocab argmax of the batch's target (float32), then
    the lowest other ids. covers_all is False only when the batch has more distinct argmaxes than the vocab holds."""
    from eagle_core.vocab import build_vocab_mapping

    w = batch["target_lm_head_weight"]
    hidden = batch["target_last_hidden"].flatten(0, 1).to(w.dtype)
    argmax = torch.cat([F.linear(h, w).argmax(-1) for h in hidden.split(512)])
    counts = torch.bincount(argmax.cpu(), minlength=w.shape[0])
    d2t, t2d = build_vocab_mapping(counts, draft_vocab_size)
    return d2t.to(w.device), t2d.to(w.device), bool(t2d[argmax.cpu()].all())


def build_draft(length: int, device: str, seed: int = 1, shape: str = "smollm2"):
    """(our draft, its DraftConfig, target config, batch at `length`, vocab covers every target) of `shape`."""
    torch.manual_seed(0)
    tc = target_config(shape)
    settings = shape_settings(shape)
    cfg = DraftConfig.from_target(tc, draft_vocab_size=settings["draft_vocab_size"], ttt_steps=settings["ttt_steps"])
    with torch.device(device):  # built where it runs: an 8B-shaped draft initialised on a CPU takes seconds
        draft = Eagle3Draft(cfg).train()
    batch = random_batch(tc, length, device, seed)
    d2t, t2d, covers = covering_vocab(batch, cfg.draft_vocab_size)
    draft.set_vocab(d2t, t2d)
    return draft, cfg, tc, batch, covers


def build_specforge(draft: Eagle3Draft, cfg: DraftConfig, reference, device: str, backend: str = "sdpa"):
    """(OnlineEagle3Model around SpecForge's draft holding our draft's weights, that draft, weight report, notes)."""
    OnlineEagle3Model, LlamaForCausalLMEagle3, notes = import_specforge(reference, device)
    with torch.device(device):
        sf_draft = LlamaForCausalLMEagle3(specforge_config(cfg), attention_backend=backend)
    report = copy_weights(draft, sf_draft)
    sf_draft.to(device).train()
    model = OnlineEagle3Model(sf_draft, length=cfg.ttt_steps, attention_backend=backend)
    return model, sf_draft, report, notes


def specforge_loss(plosses, weights=None):
    """SpecForge's training strategy's loss: sum_i 0.8**i * plosses[i] (times `weights[i]` when given)."""
    return sum(STEP_DECAY ** i * p * (1 if weights is None else weights[i]) for i, p in enumerate(plosses))


def autocast_for(dtype: str, device: str):
    """bfloat16: autocast around the whole step, float32 weights (pipelines/distill.py); float32: nothing."""
    if dtype == "bfloat16":
        return torch.autocast(device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def time_steps(step, iters: int, device: str) -> tuple[list[float], list[float]]:
    """(wall seconds, process CPU seconds) of each of `iters` calls of `step`."""
    times, cpu_times = [], []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        # CPU seconds of this process (all threads): what a step costs, whatever else the machine runs.
        cpu_times.append(time.process_time() - c0)
    return times, cpu_times


def default_mem_limit_gib(share: float = 0.85, most: float = 20.0) -> float:
    """`share` of MemAvailable now, at most `most` GiB (12 GiB where /proc/meminfo cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 12.0
    return round(min(most, share * kib / 2**20), 1)


def _limit_memory(device: str, mem_limit_gib: float):
    if device == "cpu" and mem_limit_gib > 0:
        # Fail an allocation cleanly instead of pushing a shared machine into swap or the OOM killer.
        limit = int(mem_limit_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def run_one(impl: str, length: int, iters: int, warmup: int, device: str, mem_limit_gib: float,
            dtype: str = "float32", reference=None, shape: str = "smollm2", profile: int = 0) -> dict:
    """Time `iters` training steps (after `warmup` untimed ones) of `impl` at `length`; runs inside the child.
    `profile` > 0: one more step under torch.profiler, its top `profile` ops in the result (`profile_step`)."""
    _limit_memory(device, mem_limit_gib)
    draft, cfg, tc, batch, covers = build_draft(length, device, shape=shape)
    small = random_batch(tc, PREWARM_TOKENS, device, seed=2)
    extra = {}
    if impl in SPECFORGE_BACKENDS:
        model, params_of, report, notes = build_specforge(draft, cfg, reference, device, SPECFORGE_BACKENDS[impl])
        extra = {"weights_not_mapped": report["ours_not_mapped"] + report["specforge_not_loaded"],
                 "import_notes": notes, "specforge_attention_backend": SPECFORGE_BACKENDS[impl],
                 "specforge_loss": specforge_loss_note(device)}
        del draft
        inputs, small_inputs = specforge_inputs(batch), specforge_inputs(small)

        def forward(b):
            plosses = model(**b)[0]
            return specforge_loss(plosses)
    else:
        params_of = draft
        inputs, small_inputs = batch, small
        fn = TTT_FORWARDS[impl]

        def forward(b):
            return fn(draft, **b).loss
    opt = make_optimizer(params_of, TrainConfig(lr=shape_settings(shape)["lr"]))

    def step():
        with autocast_for(dtype, device):
            loss = forward(inputs)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return float(loss.detach())

    with autocast_for(dtype, device):  # compiles what SpecForge compiles; no optimizer step (no AdamW state yet)
        forward(small_inputs).backward()
    opt.zero_grad(set_to_none=True)
    graphs_prewarm = _compiled_graphs()
    gc.collect()
    base_rss = _rss_bytes()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
    load_before = os.getloadavg()[0]
    for _ in range(warmup):  # allocator, AdamW state, CUDA kernels
        step()
    times, cpu_times = time_steps(step, iters, device)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak_mem = (torch.cuda.max_memory_allocated() - base_cuda) if device == "cuda" else peak_rss - base_rss
    if profile:
        extra["profile_step"] = profile_step(step, device, profile)
    return {
        "impl": impl, "seq_len": length, "dtype": dtype, "shape": shape, "ttt_steps": cfg.ttt_steps,
        "draft_vocab_size": cfg.draft_vocab_size, "vocab_covers_every_target": covers,
        "iters": iters, "warmup": warmup, "prewarm_tokens": PREWARM_TOKENS,
        "load_avg_1min_before": load_before, "load_avg_1min_after": os.getloadavg()[0],
        "step_seconds": min(times), "step_seconds_all": times,
        "step_cpu_seconds": min(cpu_times), "threads": torch.get_num_threads(),
        "tokens_per_s": length / min(times),
        "tokens_per_cpu_s": length / min(cpu_times),
        "peak_mem_bytes": peak_mem,
        "peak_rss_bytes": peak_rss,
        # torch.compile'd graphs (SpecForge's helpers): a count that grows in the timed steps means compile time in them
        "compiled_graphs_after_prewarm": graphs_prewarm, "compiled_graphs_after_steps": _compiled_graphs(),
        **extra,
    }


def profile_step(step, device: str, top: int) -> dict:
    """One `step` under torch.profiler: its `top` ops by self time on the device (CUDA kernels and the ops that
    launch them) or on the CPU, with calls and milliseconds. Run after the timed steps: profiling slows a step."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    total = sum(getattr(e, key) for e in events)  # microseconds; self times do not overlap
    rows = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:top]
    return {"sorted_by": key, "total_self_ms": total / 1e3,
            "top": [{"name": e.key, "calls": e.count, "self_ms": getattr(e, key) / 1e3,
                     "share": getattr(e, key) / total if total else 0.0} for e in rows]}


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 when both are 0)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float((a - b).norm())


def harness_check(reference, length: int, device: str, tolerance: float = 1e-3, shape: str = "smollm2") -> dict:
    """Ours and SpecForge's step on the same weights and inputs, float32, not timed: per-step losses (SpecForge's
    mean over B*T rows rescaled to a mean over the counted rows, as ours), accuracies, logits of every step, and
    the gradient of every trainable weight for ours' loss (SpecForge's plosses reweighted to ours' normalisation)."""
    draft, cfg, tc, batch, covers = build_draft(length, device, shape=shape)
    model, sf_draft, report, notes = build_specforge(draft, cfg, reference, device)
    ours = ttt_forward(draft, **batch, return_logits=True)
    ours.loss.backward()
    captured = []
    compute_logits = sf_draft.compute_logits

    def capture(hidden):
        logits = compute_logits(hidden)
        captured.append(logits.detach().clone())  # the loss's backward overwrites logits with their gradient
        return logits

    sf_draft.compute_logits = capture
    plosses, _, acces, _, denoms, *_ = model(**specforge_inputs(batch))
    B, L = batch["input_ids"].shape
    counts = ours.step_counts
    scale = [B * L / float(c) for c in counts]  # SpecForge divides each step's summed loss by B*T, ours by its count
    specforge_loss(plosses, scale).backward()
    sf_means = torch.stack([p.detach() * s for p, s in zip(plosses, scale)])
    step_loss_rel = ((sf_means - ours.step_losses).abs() / ours.step_losses.abs()).tolist()
    logits_rel = [_rel(s.detach(), o.detach()) for s, o in zip(captured, ours.logits)]
    sf_params = dict(sf_draft.named_parameters())
    grad_rel = {name: _rel(sf_params[name].grad, p.grad) for name, p in draft.named_parameters()
                if p.requires_grad and p.grad is not None and sf_params.get(name) is not None
                and sf_params[name].grad is not None}
    worst = max([*step_loss_rel, *logits_rel, *grad_rel.values()])
    return {
        "what": f"float32, {length} tokens, batch 1, same weights and inputs, not timed; relative differences: "
                "|specforge - ours| / |ours| per step loss, ||specforge - ours|| / ||ours|| for each step's logits "
                "[B, L, draft vocab] and each trainable weight's gradient of ours' loss",
        "seq_len": length, "shape": shape, "specforge_loss": specforge_loss_note(device), "tolerance": tolerance, "ok": worst < tolerance, "max_relative_difference": worst,
        "vocab_covers_every_target": covers,
        "ours_step_losses": ours.step_losses.tolist(), "specforge_step_losses_rescaled": sf_means.tolist(),
        "specforge_plosses_as_returned": [float(p.detach()) for p in plosses],
        "step_counts_ours": counts.tolist(), "step_counts_specforge": [float(d) for d in denoms],
        "ours_step_accuracies": ours.step_accuracies.tolist(), "specforge_step_accuracies": [float(a) for a in acces],
        "step_loss_relative_difference": step_loss_rel, "logits_relative_difference": logits_rel,
        "grad_relative_difference": grad_rel, "weights": report, "import_notes": notes,
    }


def _child_env(impl: str) -> dict:
    # OpenMP threads spin while waiting by default; on a shared, oversubscribed CPU that spinning costs
    # 50-80x on small ops and is billed as CPU time, so neither wall nor CPU seconds would mean anything.
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # SpecForge's torch.compile'd helpers: compile in this process (no pool of compile workers on a shared CPU).
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    return env


def _run(cmd: list[str], what: dict, timeout: float, mem_limit_gib: float) -> dict:
    """The child's JSON line, or `what` plus an error (timeout, out of memory, crash)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_child_env(what["impl"]),
                              cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {**what, "error": f"timed out after {timeout:g} s"}
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        oom = proc.returncode < 0 or "alloc" in tail[0].lower() or "memory" in tail[0].lower()
        reason = f"out of memory (limit {mem_limit_gib} GiB): {tail[0][:200]}" if oom else tail[0][:300]
        return {**what, "error": reason}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {**what, "error": f"no result line in the output: {proc.stdout.strip()[-200:]!r}"}


def run_child(impl: str, length: int, args, dtype: str = "float32") -> dict:
    cmd = [sys.executable, "-m", "bench.ttt", "--child", impl, str(length), "--dtype", dtype, "--iters",
           str(args.iters), "--device", args.device, "--warmup", str(args.warmup), "--mem-limit-gib",
           str(args.mem_limit_gib), "--shape", args.shape, "--profile", str(args.profile)]
    if impl in SPECFORGE_BACKENDS:
        cmd += ["--reference", str(args.reference)]
    return _run(cmd, {"impl": impl, "seq_len": length, "dtype": dtype}, args.timeout, args.mem_limit_gib)


def run_check(args) -> dict:
    cmd = [sys.executable, "-m", "bench.ttt", "--check-child", str(args.check_length), "--device", args.device,
           "--reference", str(args.reference), "--mem-limit-gib", str(args.mem_limit_gib), "--shape", args.shape]
    return _run(cmd, {"impl": "specforge", "seq_len": args.check_length, "dtype": "float32"}, args.timeout,
                args.mem_limit_gib)


def _key(impl: str) -> str:
    return impl.replace("-", "_")  # "specforge-flex" -> summary keys "specforge_flex_..."


def _own_numbers(row: dict) -> dict:
    impl = _key(row["impl"])
    if "error" in row:
        return {f"{impl}_error": row["error"]}
    return {f"{impl}_tokens_per_s": row["tokens_per_s"], f"{impl}_tokens_per_cpu_s": row["tokens_per_cpu_s"],
            f"{impl}_peak_mem_mib": row["peak_mem_bytes"] / 2**20}


def _versus(ours: dict | None, other: dict | None) -> dict:
    """Ours against `other` (speedups > 1 = ours faster; memory ratio < 1 = ours smaller), or why not."""
    if ours is None or other is None:
        return {}
    name = _key(other["impl"])
    failed = [f"{r['impl']} failed" for r in (ours, other) if "error" in r]
    if failed:
        return {f"vs_{name}_note": " and ".join(failed) + "; see runs"}
    return {
        f"speedup_ours_over_{name}_cpu_time": other["step_cpu_seconds"] / ours["step_cpu_seconds"],
        f"speedup_ours_over_{name}_wall": other["step_seconds"] / ours["step_seconds"],
        f"peak_mem_ratio_ours_over_{name}": ours["peak_mem_bytes"] / other["peak_mem_bytes"],
    }


def speed_ratios(rows: list[dict]) -> list[dict]:
    """Per (sequence length, dtype): each implementation's own numbers (or its error), and ours against naive and
    against SpecForge where both ran (a note where a side failed). Rows without a dtype are float32 ones."""
    by_key: dict[tuple[int, str], dict[str, dict]] = {}
    for r in rows:
        by_key.setdefault((r["seq_len"], r.get("dtype", "float32")), {})[r["impl"]] = r
    summary = []
    for (length, dtype), runs in sorted(by_key.items(), key=lambda kv: (kv[0][0], list(DTYPES).index(kv[0][1])
                                                                         if kv[0][1] in DTYPES else 99)):
        entry = {"seq_len": length, "dtype": dtype}
        for impl in IMPLS:
            if impl in runs:
                entry.update(_own_numbers(runs[impl]))
        for other in ("naive", *SPECFORGE_BACKENDS):
            entry.update(_versus(runs.get("ours"), runs.get(other)))
        summary.append(entry)
    return summary


def _fmt(x, spec: str = ".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def markdown(result: dict) -> str:
    """ttt.md: the summary as tables (ours vs SpecForge, ours vs naive), the harness check, what was substituted."""
    lines = [f"# TTT training step: ours vs SpecForge and naive ({result['device']})", "",
             f"`{result['command']}`", "",
             f"{result['date']}; {result['machine']}; torch {result['torch']}; load average (1 min) at the end "
             f"{result['load_avg_1min_at_end']:.2f}", "", result["what"] + ".", ""]
    summary = result["summary"]
    for other, title in (("specforge", "ours vs SpecForge (sdpa)"),
                         ("specforge_flex", "ours vs SpecForge (flex_attention)"), ("naive", "ours vs naive")):
        entries = [s for s in summary if any(k in s for k in (f"{other}_tokens_per_s", f"{other}_error",
                                                              f"vs_{other}_note"))]
        if not entries:
            continue
        lines += [f"## {title}", "",
                  f"| length | dtype | ours tok/s | {other} tok/s | speed-up wall | ours tok/CPU-s | {other} tok/CPU-s "
                  f"| speed-up CPU | ours peak MiB | {other} peak MiB | memory ours/{other} |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for s in entries:
            g = s.get
            lines.append(
                f"| {s['seq_len']} | {s['dtype']} | {_fmt(g('ours_tokens_per_s'), '.2f')} | "
                f"{_fmt(g(f'{other}_tokens_per_s'), '.2f')} | {_fmt(g(f'speedup_ours_over_{other}_wall'), '.2f')} | "
                f"{_fmt(g('ours_tokens_per_cpu_s'), '.2f')} | {_fmt(g(f'{other}_tokens_per_cpu_s'), '.2f')} | "
                f"{_fmt(g(f'speedup_ours_over_{other}_cpu_time'), '.2f')} | {_fmt(g('ours_peak_mem_mib'), '.0f')} | "
                f"{_fmt(g(f'{other}_peak_mem_mib'), '.0f')} | {_fmt(g(f'peak_mem_ratio_ours_over_{other}'), '.2f')} |")
        own = ("ours_error", f"{other}_error", f"vs_{other}_note")
        notes = [f"- {s['seq_len']} {s['dtype']}: " + "; ".join(f"{k}: {s[k]}" for k in own if k in s)
                 for s in entries if any(k in s for k in own)]
        lines += ["", "Speed-up = the other side's step time / ours (> 1: ours faster); memory = ours' peak / the "
                  "other's (< 1: ours smaller).", *([""] + notes if notes else []), ""]
    profiled = [r for r in result.get("runs", []) if r.get("profile_step")]
    if profiled:
        lines += ["## Profile of one step", "",
                  "torch.profiler over one more step after the timed ones (`--profile N`): the top ops by self time "
                  "(on the device where it is CUDA, else on the CPU); share = of the step's summed self time.", ""]
        for r in profiled:
            prof = r["profile_step"]
            lines += [f"### {r['impl']}, {r['seq_len']} tokens, {r['dtype']} ({prof['sorted_by']}, "
                      f"{prof['total_self_ms']:.1f} ms in all)", "", "| op | calls | self ms | share |",
                      "|---|---:|---:|---:|"]
            lines += [f"| `{e['name'][:80]}` | {e['calls']} | {e['self_ms']:.2f} | {e['share']:.1%} |"
                      for e in prof["top"]]
            lines.append("")
    check = result.get("harness_check")
    if check:
        lines += ["## Harness check", ""]
        if "error" in check:
            lines += [f"Failed to run: {check['error']}", ""]
        else:
            lines += [f"{check['what']}. Largest: {check['max_relative_difference']:.2e} (tolerance "
                      f"{check['tolerance']:g}): {'ok' if check['ok'] else 'NOT OK'}.", "",
                      "| step | ours loss | SpecForge loss (rescaled) | rel. diff | logits rel. diff |",
                      "|---:|---:|---:|---:|---:|"]
            for k, (a, b, d, lg) in enumerate(zip(check["ours_step_losses"], check["specforge_step_losses_rescaled"],
                                                  check["step_loss_relative_difference"],
                                                  check["logits_relative_difference"])):
                lines.append(f"| {k} | {a:.6f} | {b:.6f} | {d:.1e} | {lg:.1e} |")
            worst_grad = max(check["grad_relative_difference"].values())
            lines += ["", f"Gradients, largest relative difference: {worst_grad:.1e}.", ""]
    if result.get("specforge"):
        sf = result["specforge"]
        lines += ["## SpecForge", "", f"Checkout {sf['reference']}, commit {sf['commit']}. {sf['how']}", "",
                  f"Its loss here: {sf['loss']}.", *([f"Its flex_attention backend: {sf['flex_note']}.", ""]
                                                    if sf.get("flex_note") else [""]),
                  "Substituted on this machine:", "", *[f"- {s}" for s in sf["substitutions"]], ""]
    lines += [f"Peak memory: {result['peak_memory']}. Note: {result['note']}.", ""]
    return "\n".join(lines)


def bench_speed(args, out_path):
    # Runs already in the file at other (length, impl, dtype) are kept (`--lengths 2048` can be added to a file
    # later), if they measured the same draft shape.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # what the children run with (`_child_env`), in `machine`
    previous = json.loads(Path(out_path).read_text()) if Path(out_path).is_file() else {}
    settings = shape_settings(args.shape)
    same_draft = {"ttt_steps": settings["ttt_steps"], "draft_vocab_size": settings["draft_vocab_size"]}
    planned = {(n, i, d) for n in args.lengths for i in args.impls for d in args.dtypes}
    rows = [r for r in previous.get("runs", [])
            if (r["seq_len"], r["impl"], r.get("dtype", "float32")) not in planned
            and r.get("shape", "smollm2") == args.shape and all(r.get(k) == v for k, v in same_draft.items())]
    result = {
        "what": "one TTT training step (forward, loss = sum_k 0.8**k * loss_k, backward, AdamW) of "
                f"{describe_shape(args.shape)}, batch 1, random features and weights; each (implementation, length, "
                "dtype) in its own process",
        "shape": {"name": args.shape, **SHAPES[args.shape].target, **settings, "source": SHAPES[args.shape].source},
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "command": command("ttt", args.argv),
        "device": args.device, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": machine(torch.get_num_threads()), "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "load_avg_1min_at_start": os.getloadavg()[0],
        "mem_limit_gib": args.mem_limit_gib, "timeout_s": args.timeout,
        "dtypes": "float32: float32 weights and math; bfloat16: float32 weights, torch.autocast(bfloat16) around "
                  "the whole step (forward, backward, AdamW) as pipelines/distill.py trains, for every implementation",
        "note": "the machine may be shared: the speed ratios on process CPU seconds are inflated far less by "
                "contention than wall time; read wall-clock numbers with the load averages recorded per run",
        "peak_memory": "CPU: peak RSS minus RSS before the first step (includes allocator slack and AdamW's state); "
                       "CUDA: torch.cuda.max_memory_allocated minus the allocation before the first step",
    }
    backends = [SPECFORGE_BACKENDS[i] for i in args.impls if i in SPECFORGE_BACKENDS]
    if backends:
        result["specforge"] = {
            "reference": str(Path(args.reference).resolve()),
            "commit": specforge_commit(args.reference, args.reference_commit),
            "version": _read(Path(args.reference) / "version.txt"),
            "attention_backends": backends,
            "loss": specforge_loss_note(args.device),
            "how": "OnlineEagle3Model(LlamaForCausalLMEagle3(LlamaConfig of our draft's shapes, attention_backend="
                   "B), length=ttt_steps, attention_backend=B) for each backend B above, with our draft's weights, its compact teacher "
                   "(target_hidden_for_compact = the target's last hidden state shifted left by one, as its "
                   "TargetHead.preprocess does, target_head_weight = the target's lm_head), loss = sum_i 0.8**i * "
                   "plosses[i] (its Eagle3TrainStrategy); its torch.compile'd helpers (RMSNorm, rotary embedding) "
                   "compiled by inductor in the untimed pre-warm step (TORCHINDUCTOR_COMPILE_THREADS=1; "
                   "each run records its count of compiled graphs); torch.optim.AdamW with our settings over its "
                   "trainable weights (the embedding frozen, as ours); its loss mask = ours shifted left by two (it "
                   "masks column t of step k by loss_mask[t+k], ours by loss_mask[t+k+2]). SpecForge's own trainer "
                   "keeps bf16 weights with float32 master copies (specforge/optimizer.py BF16Optimizer); here both "
                   "sides keep float32 weights and autocast, so the comparison is like for like",
            "substitutions": SPECFORGE_SUBSTITUTIONS[:1] + ([] if triton_loss_runs(args.device)
                                                            else SPECFORGE_SUBSTITUTIONS[1:]),
        }
        if "flex_attention" in backends:
            result["specforge"]["flex_note"] = flex_note(args.device)
        check = run_check(args)
        result["harness_check"] = check
        print(json.dumps({"harness_check": {k: check.get(k) for k in ("ok", "max_relative_difference", "error")}}),
              flush=True)

    def write(final: bool = False):
        result.update(load_avg_1min_at_end=os.getloadavg()[0], summary=speed_ratios(rows), runs=rows)
        write_json(out_path, result)
        if final:
            write_markdown(out_path, markdown(result))
        else:
            Path(out_path).with_suffix(".md").write_text(markdown(result))

    for length in args.lengths:
        for dtype in args.dtypes:
            for impl in args.impls:
                row = run_child(impl, length, args, dtype)
                row["command"] = command("ttt", args.argv)
                rows.append(row)
                print(json.dumps(row), flush=True)
                write()  # every finished run is on disk, whatever happens to the next one
    write(final=True)
    return result


def flex_note(device: str) -> str:
    """Whether SpecForge's flex_attention backend can run here, in words: it needs torch's flex_attention, which
    past 128 tokens SpecForge compiles (inductor: Triton on CUDA, its C++ template on a CPU)."""
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention: it cannot run here"
    if str(device).startswith("cuda"):
        return "torch.nn.attention.flex_attention imports; compiled to Triton past 128 tokens"
    return (f"torch.nn.attention.flex_attention imports on this CPU, but torch {torch.__version__} has no "
            "FlexAttention backward on a CPU (NotImplementedError), so SpecForge's training step cannot run with it "
            "here; its runs are recorded with that error. It is measured where there is a CUDA device")


def _read(path: Path) -> str | None:
    return path.read_text().strip() if path.is_file() else None


# ---------------------------------------------------------------------------------------------------
# lm_head init comparison on real SmolLM2 features


def smollm2_feature_batches(model, tokenizer, n_conversations: int, max_length: int, skip: int = 0):
    """[(batch dict)] from the first conversations of the embedded ShareGPT corpus, one per conversation."""
    from pipelines.extract import local_feature_batches

    return local_feature_batches(model, tokenizer, n_conversations, max_length, skip=skip)


def evaluate(draft, batches, head, ttt_steps):
    """Per-step accuracy over all batches (masked positions pooled), in eval mode."""
    draft.eval()
    hits = counts = 0
    with torch.no_grad():
        for b in batches:
            out = ttt_forward(draft, b["input_ids"], b["loss_mask"], b["aux_hidden"], b["last_hidden"], head,
                              ttt_steps=ttt_steps, targets=b.get("targets"))
            hits = hits + out.step_accuracies * out.step_counts
            counts = counts + out.step_counts
    return (hits / counts.clamp(min=1)).tolist()


LM_HEAD_VARIANTS = {
    "random": dict(lm_head_init="random"),
    "target_frozen": dict(lm_head_init="target", freeze_lm_head=True),
    "target_trainable": dict(lm_head_init="target", freeze_lm_head=False),
}


def lm_head_data(n_train: int, n_eval: int, max_length: int, draft_vocab_size: int):
    """(target, train batches, held-out batches, lm_head, d2t, t2d); batches carry the target's distribution."""
    from eagle_core.target import load_target
    from eagle_core.teacher import with_targets
    from eagle_core.vocab import TokenCounter, build_vocab_mapping

    model, tokenizer = load_target("smollm2-135m", device="cpu", dtype=torch.float32)
    train = smollm2_feature_batches(model, tokenizer, n_train, max_length)
    held_out = smollm2_feature_batches(model, tokenizer, n_eval, max_length, skip=n_train)
    counter = TokenCounter(model.config.vocab_size)
    for b in train:
        counter.update(b["input_ids"], b["loss_mask"])
    d2t, t2d = build_vocab_mapping(counter, draft_vocab_size)
    head = model.get_output_embeddings().weight
    # Every batch is revisited many times: compute the target's distribution once.
    train = [with_targets(b, head, d2t) for b in train]
    held_out = [with_targets(b, head, d2t) for b in held_out]
    return model, train, held_out, head, d2t, t2d


def train_variant(kw: dict, data, steps: int, ttt_steps: int, draft_vocab_size: int) -> dict:
    """Train one lm_head variant for `steps` and measure it on the training and held-out batches."""
    from eagle_core.ttt import simulated_accept_length, train_draft_steps

    model, train, held_out, head, d2t, t2d = data
    torch.manual_seed(0)
    draft = Eagle3Draft.from_target(model, draft_vocab_size=draft_vocab_size, d2t=d2t, t2d=t2d,
                                    ttt_steps=ttt_steps, **kw)
    cfg = TrainConfig(lr=smollm2_recipe().lr, warmup_steps=steps // 10, total_steps=steps, ttt_steps=ttt_steps)
    t0 = time.perf_counter()
    history = train_draft_steps(draft, train, head, cfg)
    seconds = time.perf_counter() - t0
    eval_acc = evaluate(draft, held_out, head, ttt_steps)
    return {
        "final_train_loss_avg_last_20": sum(h["loss"] for h in history[-20:]) / min(20, len(history)),
        "train_acc": evaluate(draft, train, head, ttt_steps), "held_out_acc": eval_acc,
        "held_out_accept_length": simulated_accept_length(eval_acc),
        "trainable_params": draft.num_trainable(), "seconds": seconds,
    }


def bench_lm_head_init(steps: int, out_path, n_train: int, n_eval: int, max_length: int, ttt_steps: int,
                       draft_vocab_size: int, only: list[str] | None = None):
    torch.set_num_threads(max(1, torch.get_num_threads()))
    data = lm_head_data(n_train, n_eval, max_length, draft_vocab_size)
    # Variants already in the file are kept, so they can be measured one invocation at a time.
    results = json.loads(Path(out_path).read_text())["variants"] if Path(out_path).is_file() else {}
    for name, kw in LM_HEAD_VARIANTS.items():
        if only and name not in only:
            continue
        results[name] = train_variant(kw, data, steps, ttt_steps, draft_vocab_size)
        print(name, json.dumps(results[name]), flush=True)
    train, held_out = data[1], data[2]
    result = {
        "what": f"{steps} AdamW steps (lr {smollm2_recipe().lr:g}, warm-up + cosine) on {len(train)} SmolLM2 conversations "
                f"(<= {max_length} tokens each, batch 1), ttt_steps {ttt_steps}, draft vocab {draft_vocab_size}; "
                f"accuracy = top-1 agreement with the target, per TTT step, on {len(held_out)} held-out conversations",
        "command": command("ttt"),
        "variants": results,
    }
    write_json(out_path, result)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048], help="sequence lengths to time")
    p.add_argument("--impls", nargs="+", default=["ours", "naive"], choices=list(IMPLS),
                   help="TTT implementations to time (specforge needs --reference)")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES),
                   default=["float32", "bfloat16"] if cpu_has_native_bf16() else ["float32"],
                   help="float32, and/or bfloat16 autocast over float32 weights (default: both where bf16 is "
                        "native, else float32)")
    p.add_argument("--reference", default=os.environ.get("SPECFORGE_DIR"),
                   help="a SpecForge checkout for --impls specforge (default: $SPECFORGE_DIR)")
    p.add_argument("--reference-commit", default=None,
                   help="the checkout's commit, recorded where --reference is not a git checkout (an exported tree)")
    p.add_argument("--shape", default="smollm2", choices=list(SHAPES),
                   help="the target whose draft is measured: its published shapes (bench.ttt.SHAPES), its recipe's "
                        "draft vocabulary and TTT steps; random weights, no model files ('tiny': seconds on a CPU)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timed steps, profile one more (torch.profiler) and keep its top N ops in the "
                        "result (0 = off)")
    p.add_argument("--check-length", type=int, default=64, help="tokens of the (untimed) SpecForge harness check")
    p.add_argument("--iters", type=int, default=1, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: 1 on CUDA, 0 on CPU)")
    p.add_argument("--device", default=default_device(), help="torch device")
    p.add_argument("--mem-limit-gib", type=float, default=None,
                   help="per-run memory cap on CPU (0 = none; default: 85%% of the memory available at the start, "
                        "at most 20 GiB: SpecForge's step at 4096 tokens keeps 7 [9, L, L] float32 attention "
                        "tensors, and bf16 a copy of each)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per (implementation, length, dtype) run")
    p.add_argument("--out", default=None,
                   help="result JSON file (default: bench/results/ttt.json, or lm_head_init.json)")
    p.add_argument("--lm-head-init", action="store_true", help="compare lm_head initialisations instead")
    add_draft_training_args(p, steps=200, max_length=128)
    p.add_argument("--n-train", type=int, default=6, help="--lm-head-init: training conversations")
    p.add_argument("--n-eval", type=int, default=4, help="--lm-head-init: held-out conversations")
    p.add_argument("--variants", nargs="+", default=None, choices=list(LM_HEAD_VARIANTS),
                   help="lm_head inits to run (default: all)")
    p.add_argument("--child", nargs=2, metavar=("IMPL", "LENGTH"), help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help=argparse.SUPPRESS)
    p.add_argument("--check-child", type=int, metavar="LENGTH", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.warmup is None:
        args.warmup = 1 if args.device == "cuda" else 0
    if args.mem_limit_gib is None:
        args.mem_limit_gib = default_mem_limit_gib()
    if args.check_child:
        _limit_memory(args.device, args.mem_limit_gib)
        print(json.dumps(harness_check(args.reference, args.check_child, args.device, shape=args.shape)))
        return
    if args.child:
        print(json.dumps(run_one(args.child[0], int(args.child[1]), args.iters, args.warmup, args.device,
                                 args.mem_limit_gib, args.dtype, args.reference, args.shape, args.profile)))
        return
    if args.lm_head_init:
        bench_lm_head_init(args.steps, args.out or RESULTS / "lm_head_init.json", args.n_train,
                           args.n_eval, args.max_length, args.ttt_steps, args.draft_vocab_size, args.variants)
        return
    if any(i in SPECFORGE_BACKENDS for i in args.impls):
        if not args.reference:
            p.error("--impls specforge needs --reference DIR (a SpecForge checkout) or $SPECFORGE_DIR")
        if not (Path(args.reference) / "specforge/algorithms/eagle3/model.py").is_file():
            p.error(f"--reference {args.reference} is not a SpecForge checkout "
                    "(no specforge/algorithms/eagle3/model.py)")
    bench_speed(args, args.out or RESULTS / "ttt.json")


if __name__ == "__main__":
    main()
