"""Prepacked CPU matmuls for the target's linear layers while our decoder runs it.

Why (issue 55): at batch 1 a decode step is ~200 matrix-vector products, and on a CPU torch's linear hands each to
its BLAS with the weight in its plain layout (in bf16 oneDNN reorders it into its blocked layout on every call). Packed once into
oneDNN's blocked layout (the kernel Inductor's freezing uses; vLLM's CPU backend does the same with its own oneDNN
handle), the same products skip that work and stream the weights faster: on this CPU a plain step of SmolLM2 runs
1.18x faster in bf16 and 1.14x in fp32, the same tokens (`bench/results/cpu-speed/`; MKL's fp32 packs, tried
first, gained nothing).

`packed_linears(model)`: within it, every `nn.Linear` of `model` with a CPU weight in bf16 or fp32 runs on its
packed weight. A pack is made once per weight, kept beside the module (a second copy of the weights), and made
again when the weight changes in place (its version counter moves; an inference tensor has none). Outside the context the modules are untouched:
transformers' own forward and `generate`, the reference decoding is held against, never run on a pack. The packed
kernels have no autograd: under grad mode with an input or weight that requires grad, the plain linear runs.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch
import torch.nn.functional as F

_PACKS: "weakref.WeakKeyDictionary[torch.nn.Linear, tuple[int, torch.Tensor]]" = weakref.WeakKeyDictionary()
_ACTIVE: dict[int, int] = {}  # id(model) -> nesting depth of its packed_linears contexts
_LOCK = threading.Lock()


def available(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32 and torch.backends.mkldnn.is_available()


def _version(weight: torch.Tensor) -> int:
    """The weight's in-place version; an inference tensor (made under `torch.inference_mode`) keeps none: -1."""
    return -1 if weight.is_inference() else weight._version


def _packed(linear: torch.nn.Linear) -> torch.Tensor:
    weight = linear.weight
    got = _PACKS.get(linear)
    if got is not None and got[0] == _version(weight):
        return got[1]
    with torch.no_grad():
        w = weight.detach()
        pack = torch.ops.mkldnn._reorder_linear_weight(w, 1)
    _PACKS[linear] = (_version(weight), pack)
    return pack


def packed_forward(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)` on its packed weight (the plain linear where a pack cannot serve: see the module docstring)."""
    weight, bias = linear.weight, linear.bias
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad) or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, _packed(linear), bias, "none", [], "")


def _linears(model) -> list[torch.nn.Linear]:
    # exactly nn.Linear: a subclass may have its own forward (Llama 4's MoE router returns scores and logits)
    return [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.device.type == "cpu"
            and not m.weight.is_meta and available(m.weight.dtype)]


@contextlib.contextmanager
def packed_linears(model):
    """Within it, `model`'s CPU linear layers run on packed weights (module docstring); nested and concurrent
    contexts on one model share its packs; the last to exit gives the modules their own forward back."""
    if model is None or torch.compiler.is_compiling():
        yield
        return
    key = id(model)
    with _LOCK:
        depth = _ACTIVE.get(key, 0)
        if depth == 0:
            for linear in _linears(model):
                linear.forward = lambda x, linear=linear: packed_forward(linear, x)
        _ACTIVE[key] = depth + 1
    try:
        yield
    finally:
        with _LOCK:
            _ACTIVE[key] -= 1
            if _ACTIVE[key] == 0:
                del _ACTIVE[key]
                for linear in _linears(model):
                    linear.__dict__.pop("forward", None)


# The dtypes in which our decoder packs by default (`decode_kernels`): both, measured (bench/results/cpu-speed/).
DECODE_DTYPES: set[torch.dtype] = {torch.bfloat16, torch.float32}


def decode_kernels(model, eager: bool = True):
    """The context a decoding step runs `model` (target or draft; None: nothing) in: `packed_linears` on the eager
    caches (`eager`; a compiled static step traces the plain linear, which Inductor lowers itself) where the model's
    dtype is in `DECODE_DTYPES`; else nothing. The auto-tune times its cases in it too."""
    if model is None or not eager or next(model.parameters()).dtype not in DECODE_DTYPES:
        return contextlib.nullcontext()
    return packed_linears(model)
