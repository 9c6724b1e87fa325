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
again when the weight changes in place (its version counter moves; an inference tensor has none). Sibling linears
(an attention's q/k/v, a gated MLP's gate/up: `SIBLINGS`) share one pack and one product. RMSNorms of Llama's
formula run on vLLM's fused kernel (`rms_norm_forward`), Llama-style decoder layers (Llama, Mistral, Qwen2/3) as one
function on these kernels (`eagle_core.llama_layer`). Outside the context the modules are untouched:
transformers' own forward and `generate`, the reference decoding is held against, never run on a pack. The packed
kernels have no autograd: under grad mode with an input or weight that requires grad, the plain linear runs.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import inspect
import logging
import threading
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
# Per kind of pack ("vllm", "torch"): linear (or a stacked group's key) -> (its weights and biases that have a version,
# their versions when packed, (the pack, the bias))
_PACKS: "dict[str, weakref.WeakKeyDictionary[object, tuple[list, list, tuple]]]" = {
    "vllm": weakref.WeakKeyDictionary(), "torch": weakref.WeakKeyDictionary()}
_ACTIVE: dict[int, int] = {}  # id(model) -> nesting depth of its packed_linears contexts
_LOCK = threading.Lock()


@functools.cache
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
        try:
            _DROPPED.append(self.pointer)
        except (AttributeError, NameError, TypeError):  # interpreter shutdown: module globals gone; the process ends
            pass


_DROPPED: list[int] = []  # handles whose pack was dropped, released outside the garbage collector


def release_dropped_handles() -> None:
    while _DROPPED:
        torch.ops._C.release_dnnl_matmul_handler(_DROPPED.pop())


# Whether packs use vLLM's oneDNN kernels where they are installed (`vllm_kernels`); False: torch's own packs.
USE_VLLM_KERNELS = True
# Whether `SIBLINGS` share one pack and one product, and whether Llama-style decoder layers run as one function
# (`eagle_core.llama_layer`); both read at a model's first packed context.
FUSE_SIBLINGS = True
FUSED_LAYERS = True


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


def _packed(key, linears: list[torch.nn.Linear]) -> tuple[object, torch.Tensor | None]:
    """(the pack, the bias) of `linears`' weights stacked along the output features (one linear, or a group of
    `SIBLINGS`), made again when a weight or bias changed in place. `key`: what the pack is kept under."""
    packs = _PACKS["vllm" if USE_VLLM_KERNELS and vllm_kernels() else "torch"]
    got = packs.get(key)
    if got is not None and [p._version for p in got[0]] == got[1]:  # (called ~120 times a step: kept cheap)
        return got[2]
    params = [p for m in linears for p in (m.weight, m.bias) if p is not None]
    versioned = [p for p in params if not p.is_inference()]  # an inference tensor has no version: it cannot change
    with torch.no_grad():
        w = torch.cat([m.weight.detach() for m in linears]) if len(linears) > 1 else linears[0].weight.detach()
        bias = linears[0].bias
        if bias is not None and len(linears) > 1:
            bias = torch.cat([m.bias.detach() for m in linears])
        pack = OneDNNHandle(w) if packs is _PACKS["vllm"] else torch.ops.mkldnn._reorder_linear_weight(w, 1)
    packs[key] = (versioned, [p._version for p in versioned], (pack, bias))
    return pack, bias


def _plain_only(module: torch.nn.Module, x: torch.Tensor) -> bool:
    """Where a packed or fused kernel cannot serve `module(x)` (a linear, a norm): autograd through the input or the
    module's weight, or mixed dtypes."""
    weight = module.weight
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad) or x.dtype != weight.dtype


def _run(pack, bias, x: torch.Tensor) -> torch.Tensor:
    if isinstance(pack, OneDNNHandle):
        return pack(x, bias)
    return torch.ops.mkldnn._linear_pointwise(x, pack, bias, "none", [], "")


def packed_forward(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)` on its packed weight (the plain linear where a pack cannot serve: see the module docstring)."""
    if _plain_only(linear, x):
        return F.linear(x, linear.weight, linear.bias)
    return _run(*_packed(linear, [linear]), x)


# Sibling linears: children of one module, by name, that a forward calls one after the other on the same input (an
# attention's query, key and value projections; a gated MLP's gate and up projections). Packed as one matrix, the
# first call computes every sibling's output in one product and the others take theirs (`_Siblings`): on this CPU a
# SmolLM2 step makes 4 products per layer instead of 7, each with its thread start-up and its pass over the input.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Siblings:
    """One group of `SIBLINGS`: the first member called on an input x computes all the members' outputs (views of one
    product); a member later called on that same x (the same tensor object, unchanged in place) takes its own,
    each once; a member called on another input computes the group's product on it instead. Per thread."""

    def __init__(self, linears: list[torch.nn.Linear]):
        self.linears = linears
        self.sizes = [m.out_features for m in linears]
        self.state = threading.local()  # .pending: (x, its version, the outputs, the members yet to take theirs)

    def forward(self, i: int, x: torch.Tensor) -> torch.Tensor:
        linear = self.linears[i]
        if _plain_only(linear, x):
            return F.linear(x, linear.weight, linear.bias)
        pending = getattr(self.state, "pending", None)
        if pending is not None and pending[0] is x and pending[1] == _version(x) and i in pending[3]:
            pending[3].discard(i)
            if not pending[3]:
                self.state.pending = None
            return pending[2][i]
        outputs = _run(*_packed(self, self.linears), x).split(self.sizes, dim=-1)
        self.state.pending = (x, _version(x), outputs, set(range(len(self.linears))) - {i})
        return outputs[i]

    def clear(self) -> None:
        self.state.pending = None


def _sibling_groups(model) -> dict[torch.nn.Linear, tuple[_Siblings, int]]:
    """linear -> (its group, its place in it), for every `SIBLINGS` group of exactly `nn.Linear`s with one input
    size, one dtype and device, and biases on all or none."""
    groups = {}
    for module in model.modules():
        for names in SIBLINGS:
            members = [module._modules.get(n) for n in names]
            if not all(type(m) is torch.nn.Linear for m in members):
                continue
            if len({(m.in_features, m.weight.dtype, m.weight.device, m.bias is None) for m in members}) == 1:
                group = _Siblings(members)
                groups.update({m: (group, i) for i, m in enumerate(members)})
    return groups


# model -> [(module, its forward, the weight that says whether it can run packed)] of every nn.Linear in it, RMSNorm of
# Llama's formula and Llama-style decoder layer (`eagle_core.llama_layer`), found once per model: walking a 30-layer
# model's modules on every step's entry and exit cost 3.6 ms of a 35 ms bf16 SmolLM2 step (profiled, this CPU).
# Kept per value of (FUSE_SIBLINGS, FUSED_LAYERS): switching them (the benchmark's variants) finds the other set.
_MODEL_LINEARS: "dict[tuple, weakref.WeakKeyDictionary[torch.nn.Module, list]]" = {}


def _linears(model) -> list[tuple[torch.nn.Module, object, torch.Tensor]]:
    """Every `nn.Linear` of `model` (exactly that class: a subclass may have its own forward, as Llama 4's MoE router
    has) with its packed forward (its `_Siblings` group's where it has one), every RMSNorm of Llama's formula with
    `rms_norm_forward` and every decoder layer `layer_forward` reproduces, found at the model's first packed context
    (modules added later run as they are)."""
    known = _MODEL_LINEARS.setdefault((FUSE_SIBLINGS, FUSED_LAYERS), weakref.WeakKeyDictionary())
    found = known.get(model)
    if found is None:
        groups = _sibling_groups(model) if FUSE_SIBLINGS else {}
        found = known[model] = [
            (m, functools.partial(groups[m][0].forward, groups[m][1]) if m in groups
             else functools.partial(packed_forward, m), m.weight)
            for m in model.modules() if type(m) is torch.nn.Linear]
        found += [(m, functools.partial(rms_norm_forward, m), m.weight) for m in model.modules()
                  if _llama_rms_norm(type(m))]
        if FUSED_LAYERS:
            from eagle_core import llama_layer

            plans = [(m, llama_layer.LayerPlan.of(m, groups)) for m in model.modules() if hasattr(m, "self_attn")]
            found += [(m, functools.partial(llama_layer.layer_forward, m, plan), plan.o.weight)
                      for m, plan in plans if plan is not None]
    return found


# Whether RMSNorms of Llama's formula run on vLLM's fused kernel where it is loaded (`rms_norm_forward`).
FUSED_NORMS = True


def source_hash(fn) -> str | None:
    """The first 16 hex digits of the sha256 of `fn`'s source text (None where it has none): how a fast path names
    the transformers code it reproduces."""
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return None


# The hash of the RMSNorm forward `rms_norm_forward` reproduces (`source_hash`): transformers 5.19's Llama
# one. A release that changes it drops the fused kernel (the norms run their own forward) until it is checked again.
LLAMA_RMS_NORM = "790fa612e4fa57ac"


@functools.cache
def _llama_rms_norm(cls: type) -> bool:
    """Whether `cls`'s forward is the Llama RMSNorm `rms_norm_forward` reproduces, word for word (Mistral's, Qwen2/3's,
    Phi-3's, Granite's are; Gemma's (1 + weight), OLMo-2's (weight before the cast) and others are not)."""
    if not issubclass(cls, torch.nn.Module) or not cls.__name__.endswith("RMSNorm"):
        return False
    return source_hash(cls.forward) == LLAMA_RMS_NORM


def rms_norm_forward(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` for an RMSNorm of Llama's formula (float32 statistics, the normalised input cast back, times the
    weight) in one kernel, vLLM's `rms_norm`, instead of transformers' eight ops (two dtype casts among them); its
    own forward under autograd, with mixed dtypes, or without vLLM's kernels."""
    if not (FUSED_NORMS and USE_VLLM_KERNELS and vllm_kernels()) or _plain_only(norm, x):
        return type(norm).forward(norm, x)
    x = x.contiguous()
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, norm.weight, norm.variance_epsilon)
    return out


def _packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and not weight.is_meta and available(weight.dtype)


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
            for module, forward, weight in _linears(model):
                if _packable(weight):
                    module.__dict__["forward"] = forward  # an instance attribute: nn.Module.__call__ calls it
        _ACTIVE[key] = depth + 1
    try:
        yield
    finally:
        with _LOCK:
            _ACTIVE[key] -= 1
            if _ACTIVE[key] == 0:
                del _ACTIVE[key]
                for module, forward, _ in _linears(model):
                    module.__dict__.pop("forward", None)
                    group = getattr(forward.func, "__self__", None)
                    if group is not None:  # a `_Siblings` group: no input or outputs kept past the context
                        group.clear()
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
