"""Prepacked CPU matmuls for the target's linear layers while our decoder runs it.

Why (issue 55): at batch 1 a decode step is ~200 matrix-vector products, and on a CPU torch's linear hands each to
its BLAS with the weight in its plain layout (in bf16 oneDNN reorders it into its blocked layout on every call).
Packed once, the same products skip that work and stream the weights faster. Two packs, the first available:
- vLLM's CPU kernels (`onednn_mm`: a oneDNN matmul primitive over its own copy of the weight, what vLLM's CPU
  backend runs its linears on), where vLLM's CPU build is installed (`make setup` installs it): its library is
  loaded as a torch op library, without importing vLLM (`vllm_kernels`). On this CPU the 210 products of a
  SmolLM2 step ran in 21 ms against 39 ms for torch's linear (fp32; bf16 11 against 23), and our plain loop 1.14x
  (fp32) / 1.16x (bf16) faster than on torch's packs, the same tokens (`bench/results/cpu-speed/`);
- torch's own oneDNN pack (`mkldnn._reorder_linear_weight`, the kernel Inductor's freezing uses): 1.13x over the
  plain linear on the same step (MKL's fp32 packs, tried first, gained nothing).

`packed_linears(model)`: within it, every `nn.Linear` of `model` with a CPU weight in bf16 or fp32 runs on its
packed weight. A pack is made once per weight, kept beside the module (a second copy of the weights), and made
again when the weight changes in place (its version counter moves; an inference tensor has none). Outside the context the modules are untouched:
transformers' own forward and `generate`, the reference decoding is held against, never run on a pack. The packed
kernels have no autograd: under grad mode with an input or weight that requires grad, the plain linear runs.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import threading
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
# Per kind of pack ("vllm", "torch"): linear -> (the weight's version when packed, its pack)
_PACKS: "dict[str, weakref.WeakKeyDictionary[torch.nn.Linear, tuple[int, object]]]" = {
    "vllm": weakref.WeakKeyDictionary(), "torch": weakref.WeakKeyDictionary()}
_ACTIVE: dict[int, int] = {}  # id(model) -> nesting depth of its packed_linears contexts
_LOCK = threading.Lock()


def available(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32 and torch.backends.mkldnn.is_available()


class OneDNNHandle:
    """A weight packed by vLLM's CPU kernels (`onednn_mm`: a oneDNN matmul primitive over its own copy of the weight,
    its primitives cached per row count), released with this object."""

    def __init__(self, weight: torch.Tensor):
        self.n, self.k = weight.shape
        release_dropped_handles()
        self.pointer = torch.ops._C.create_onednn_mm_handler(weight.t(), 32)  # a Python int
        self.handle = torch.tensor(self.pointer, dtype=torch.int64)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty((*x.shape[:-1], self.n), dtype=x.dtype)
        torch.ops._C.onednn_mm(out, x.reshape(-1, self.k), bias, self.handle)
        return out

    def __del__(self):
        # No torch call here: the garbage collector runs this anywhere, e.g. inside a compile's fake-tensor mode, where
        # an op call fails (and leaves torch's dispatch state broken). The handle is released at the next pack or exit.
        _DROPPED.append(self.pointer)


_DROPPED: list[int] = []  # handles whose pack was dropped, released outside the garbage collector


def release_dropped_handles() -> None:
    while _DROPPED:
        torch.ops._C.release_dnnl_matmul_handler(_DROPPED.pop())


# Whether packs use vLLM's oneDNN kernels where they are installed (`vllm_kernels`); False: torch's own packs.
USE_VLLM_KERNELS = True


@functools.cache
def vllm_kernels() -> bool:
    """Loads vLLM's CPU kernel library (the build vLLM itself loads on this CPU: avx512_bf16, avx512 or AVX2) as a
    torch op library, without importing vLLM (8 ms, against ~7 s for `import vllm`), where vLLM's CPU build is
    installed; True where its `onednn_mm` is there to use."""
    if hasattr(torch.ops._C, "onednn_mm"):  # vLLM, or an earlier call, loaded it
        return True
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None or torch.cuda.is_available():
        return False
    if torch.cpu._is_avx512_supported():
        name = "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    else:
        name = "_C_AVX2"
    library = next(Path(spec.origin).parent.glob(f"{name}.*so"), None)
    if library is None:
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError as e:  # a CUDA build of vLLM, a library built for another torch: torch's packs serve
        log.info("vLLM's CPU kernels did not load (%s); torch's packed linear serves", e)
        return False
    return hasattr(torch.ops._C, "onednn_mm")


def _version(weight: torch.Tensor) -> int:
    """The weight's in-place version; an inference tensor (made under `torch.inference_mode`) keeps none: -1."""
    return -1 if weight.is_inference() else weight._version


def _packed(linear: torch.nn.Linear) -> torch.Tensor:
    weight = linear.weight
    packs = _PACKS["vllm" if USE_VLLM_KERNELS and vllm_kernels() else "torch"]
    got = packs.get(linear)
    if got is not None and got[0] == _version(weight):
        return got[1]
    with torch.no_grad():
        w = weight.detach()
        pack = OneDNNHandle(w) if packs is _PACKS["vllm"] else torch.ops.mkldnn._reorder_linear_weight(w, 1)
    packs[linear] = (_version(weight), pack)
    return pack


def packed_forward(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)` on its packed weight (the plain linear where a pack cannot serve: see the module docstring)."""
    weight, bias = linear.weight, linear.bias
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad) or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    pack = _packed(linear)
    if isinstance(pack, OneDNNHandle):
        return pack(x, bias)
    return torch.ops.mkldnn._linear_pointwise(x, pack, bias, "none", [], "")


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
            if _DROPPED and not torch.compiler.is_compiling():
                release_dropped_handles()


# The dtypes in which our decoder packs by default (`decode_kernels`): both, measured (bench/results/cpu-speed/).
DECODE_DTYPES: set[torch.dtype] = {torch.bfloat16, torch.float32}


def decode_kernels(model, eager: bool = True):
    """The context a decoding step runs `model` (target or draft; None: nothing) in: `packed_linears` on the eager
    caches (`eager`; a compiled static step traces the plain linear, which Inductor lowers itself) where the model's
    dtype is in `DECODE_DTYPES`; else nothing. The auto-tune times its cases in it too."""
    if model is None or not eager or next(model.parameters()).dtype not in DECODE_DTYPES:
        return contextlib.nullcontext()
    return packed_linears(model)
