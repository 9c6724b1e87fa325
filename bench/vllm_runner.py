"""vLLM's rows of `bench.decode`: vLLM plain and vLLM with our draft as its EAGLE-3 speculator (k draft tokens per
step), on the same prompts, target weights, dtype and thread count as our methods, interleaved with them.

Each engine is vLLM's offline `LLM` with its engine core in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: no
child process to spin beside the other methods or to outlive the run), eager (no torch.compile, as our rows),
greedy, `generation_config="vllm"` (only the tokenizer's EOS ends an answer, as in our rows). vLLM's CPU worker
runs OMP_NUM_THREADS threads: set to this process's torch thread count before the first engine starts. Per request,
vLLM's own speculative metrics (`per_request_spec_decode_metrics="detailed"`: accepted draft tokens per step) give
the rounds and accept lengths our rows report; vLLM does not split a step into draft and verify time.
"""

from __future__ import annotations

import os
import time

import torch

VLLM_PLAIN = "vllm_plain"
VLLM_EAGLE3 = "vllm_eagle3_k"  # + k: "vllm_eagle3_k3"


def vllm_methods(ks: list[int]) -> list[str]:
    return [VLLM_PLAIN] + [f"{VLLM_EAGLE3}{k}" for k in ks]


def is_vllm(method: str) -> bool:
    return method.startswith("vllm_")


class VllmRunner:
    """The vLLM engines of one dtype, one per method (plain, then one per k), closed by `close()`."""

    def __init__(self, target_folder: str, draft_folder: str, dtype: torch.dtype, methods: list[str],
                 max_model_len: int = 2048):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
        from vllm import LLM

        from pipelines.engines.vllm import CPU_KV_CACHE_GIB, install_shutdown, modules_vllm_can_scan
        from pipelines.engines.vllm_spec import speculative_config

        install_shutdown()
        threads = torch.get_num_threads()
        base = dict(model=target_folder, tokenizer=target_folder, dtype=str(dtype).removeprefix("torch."), seed=0,
                    enforce_eager=True, generation_config="vllm", max_model_len=max_model_len)
        if not torch.cuda.is_available():
            base["kv_cache_memory_bytes"] = int(CPU_KV_CACHE_GIB * (1 << 30))
        self.engines = {}
        try:
            for method in methods:
                kwargs = dict(base)
                if method != VLLM_PLAIN:  # (vLLM refuses per-request metrics without a speculator)
                    kwargs["speculative_config"] = speculative_config(draft_folder, int(method[len(VLLM_EAGLE3):]))
                    kwargs["per_request_spec_decode_metrics"] = "detailed"
                with modules_vllm_can_scan():
                    self.engines[method] = LLM(**kwargs)
        except BaseException:
            self.close()
            raise
        torch.set_num_threads(threads)  # vLLM's worker sets its own; our rows keep theirs

    def run(self, method: str, ids: list[int], max_new_tokens: int, eos: list[int]) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        threads = torch.get_num_threads()
        t0 = time.perf_counter()
        out = self.engines[method].generate([TokensPrompt(prompt_token_ids=list(ids))],
                                            SamplingParams(max_tokens=max_new_tokens, temperature=0.0,
                                                           stop_token_ids=list(eos)), use_tqdm=False)[0].outputs[0]
        seconds = time.perf_counter() - t0
        torch.set_num_threads(threads)
        tokens = list(out.token_ids)
        spec = getattr(out, "spec_decode_metrics", None)
        steps = list(getattr(spec, "per_step_accepted", []) or []) if method != VLLM_PLAIN else []
        rounds = len(steps) if method != VLLM_PLAIN else max(len(tokens) - 1, 0)
        return dict(tokens=tokens, seconds=seconds, rounds=rounds, accepted=sum(steps), draft_rounds=len(steps),
                    accept_lengths=steps, prefill_s=None, draft_s=None, verify_s=None,
                    modes={"vllm": len(steps)} if steps else {"plain": rounds}, engine="vllm")

    def close(self) -> None:
        from pipelines.engines.vllm import give_torch_its_threads_back

        for llm in self.engines.values():
            llm.llm_engine.engine_core.shutdown()
        self.engines = {}
        give_torch_its_threads_back()
