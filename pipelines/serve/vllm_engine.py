"""Serving on vLLM: `VllmServeEngine` decodes with vLLM's `AsyncLLM` (the engine GPU fleets run: continuous batching,
paged attention, CUDA graphs on GPUs) with the champion draft as its EAGLE-3 speculator, behind the same `Service`.

It has the serve `Engine`'s interface (`submit`, `load`, `stalled`, `begin_drain`, `close`, `load_draft`,
`set_draft`, `draft_version`, `thread`, `sink_errors`), so everything `Service` does on top — the OpenAI routes,
bearer auth, body and token limits, 4xx on bad input, cancellation when a client leaves, draining, the request
metrics, acceptance per category label and the drift rule, following `@champion` — is the same code for both.

- Requests: token ids (the chat template is applied by `Service`, as for our decoder) -> `AsyncLLM.generate` with
  `RequestOutputKind.DELTA`; new token ids become text through our `TextStream` (same detokenisation and stop
  strings as our decoder). A client that leaves aborts the vLLM request at its next output.
- Acceptance: vLLM's per-request speculative metrics (`per_request_spec_decode_metrics="detailed"`: the accepted
  draft tokens of every verification step) become the request's `accept_lengths`, in mode `VLLM_MODE`; vLLM's
  engine-wide counters (drafts, drafted, accepted, accepted per position: `SpecDecodingStats`) are summed by a stat
  logger into `spec_counts` for /metrics.
- A new champion: vLLM cannot change a running engine's speculator, so `load_draft` starts a second `AsyncLLM` with
  the new draft (while the first serves on); new requests go to it, and the old engine is shut down when its last
  request ends. Requests in flight finish on their draft, as with our decoder.
- Processes: vLLM's `AsyncLLM` runs its engine core in a child process. `close()` shuts every engine down; so do an
  atexit hook (a Ray worker turns SIGTERM into SystemExit, which runs it) and `pipelines.engines.vllm`'s SIGTERM
  handler where this runs on a main thread.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import logging
import threading
import time
import uuid
import weakref
from dataclasses import dataclass

from eagle_core.generate import RequestStats
from pipelines.engines.vllm_spec import ACCEPTANCE_TAG, SpecCounts, speculative_config
from pipelines.serve.rows import DraftRef, Event, GenerationRequest, Overloaded, describe_load
from pipelines.serve.text_stream import TextStream

log = logging.getLogger(__name__)

VLLM_MODE = "vllm"  # the mode of a vLLM verification step in RequestStats.modes and acceptance records


@dataclass(eq=False)
class VllmDraftRef(DraftRef):
    """A draft version and the vLLM engine that decodes with it (`model` is the draft's folder, None = plain)."""

    llm: object = None
    requests: int = 0  # requests pinned to it and not finished
    retired: bool = False  # no longer current: shut down when its last request ends


def default_speculative_tokens(draft_folder: str) -> int:
    """k for a draft that does not say otherwise: the recurrence depth it was trained for (TTT steps), as the
    speculators export writes it."""
    import json
    from pathlib import Path

    config = json.loads((Path(draft_folder) / "config.json").read_text())
    return int((config.get("eagle3_pipeline") or {}).get("ttt_steps") or 3)


def _checked_draft_folder(source: str, target_config) -> str:
    """The draft's local folder (a registry URI downloaded, a URL fetched once per node), refused with the same
    message as our decoder gives when it does not fit the target."""
    from eagle_core.checkpoint import read_config, validate_against_target
    from eagle_core.target import local_folder
    from pipelines.storage import resolve_source

    folder = local_folder(resolve_source(source))
    validate_against_target(read_config(folder)[1], target_config, source)
    return str(folder)


class _SpecLogger:
    """A vLLM stat logger (per engine) that adds each step's spec-decode stats and load to its engine's totals."""

    def __init__(self, owner: "VllmServeEngine"):
        self.owner = owner

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if scheduler_stats is None:
            return
        with self.owner.lock:
            if scheduler_stats.spec_decoding_stats is not None:
                self.owner.spec_counts.add(scheduler_stats.spec_decoding_stats)
            self.owner.progress_at = time.monotonic()

    def log_engine_initialized(self):
        pass

    def log(self):
        pass

    def record_sleep_state(self, is_awake: int, level: int):
        pass


def _run_in_thread(fn) -> None:
    """fn() on a new thread, waited for; its exception re-raised here."""
    errors: list = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 -- handed to the caller
            errors.append(exc)

    thread = threading.Thread(target=run, name="vllm-engine-start")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


async def _cancelled(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(BaseException):
        await task


_live: "weakref.WeakSet[VllmServeEngine]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for engine in list(_live):
        engine.shutdown_engines()


class VllmServeEngine:
    """vLLM behind the serve `Engine` interface (module docstring)."""

    reference_tag = ACCEPTANCE_TAG  # the drift rule compares with the version's acceptance length in vLLM

    def __init__(self, target_folder: str, tokenizer, draft_source: str | None, config, *, target_config,
                 dtype: str, max_model_len: int, num_speculative_tokens: int | None = None, metrics=None,
                 draft_version: str | None = None, seed: int = 0):
        from pipelines.engines.vllm import install_shutdown

        self.target_folder, self.tokenizer, self.config = str(target_folder), tokenizer, config
        self.target_config = target_config
        self.dtype, self.max_model_len, self.seed = dtype, max_model_len, seed
        self.k = num_speculative_tokens
        self.metrics = metrics
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos = {eos} if eos is not None else set()
        self.lock = threading.Lock()
        self.spec_counts = SpecCounts()
        self.sink_errors = 0  # no traffic sink on this engine (Service refuses one)
        self.active = 0  # requests submitted and not finished
        self.draining = self.stopped = False
        self.drain_deadline = float("inf")
        self.progress_at = time.monotonic()
        self.refs: list[VllmDraftRef] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-serve-engine", daemon=True)
        self.thread.start()
        install_shutdown()
        _live.add(self)
        try:
            self.current = self.load_draft(draft_source)
            self.current.version = draft_version if draft_source is not None else None
        except BaseException:
            self.close(0)
            raise

    # ---- engines, one per draft version -----------------------------------------------------------------------
    def _engine_args(self, draft_folder: str | None):
        import os

        import torch
        from vllm.engine.arg_utils import AsyncEngineArgs

        from pipelines.engines.vllm import CPU_KV_CACHE_GIB

        cpu = not torch.cuda.is_available()
        kwargs = dict(model=self.target_folder, tokenizer=self.target_folder, dtype=self.dtype, seed=self.seed,
                      max_model_len=self.max_model_len, generation_config="vllm", enforce_eager=cpu,
                      max_num_seqs=self.config.max_batch_size, disable_log_stats=True)
        if draft_folder is not None:  # (vLLM refuses per-request metrics without a speculator)
            k = self.k or default_speculative_tokens(draft_folder)
            kwargs["speculative_config"] = speculative_config(draft_folder, k)
            kwargs["per_request_spec_decode_metrics"] = "detailed"
        if cpu:
            gib = float(os.environ.get("EAGLE3_VLLM_KV_CACHE_GIB", CPU_KV_CACHE_GIB))
            kwargs["kv_cache_memory_bytes"] = int(gib * (1 << 30))
        return AsyncEngineArgs(**kwargs)

    def load_draft(self, source: str | None) -> VllmDraftRef:
        """Start a vLLM engine on the target with the draft at `source` (a folder, URL or registry URI, checked
        against the target first) as its speculator, None: plain decoding; the caller hands the result to
        `set_draft`. Blocks while vLLM loads (the current engine serves meanwhile)."""
        import os

        from vllm.v1.engine.async_llm import AsyncLLM

        from pipelines.engines.vllm import modules_vllm_can_scan

        folder = None if source is None else _checked_draft_folder(source, self.target_config)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # AsyncLLM's engine core runs in a child process
        ref = VllmDraftRef(folder, None)
        # no local name holds the engine: something in vLLM's start keeps this frame alive, and `_shutdown` drops
        # the engine through `ref` alone
        def start() -> None:
            with modules_vllm_can_scan():
                ref.llm = AsyncLLM.from_engine_args(self._engine_args(folder),
                                                    stat_loggers=[lambda vllm_config, engine_index: _SpecLogger(self)])

        # Built on a thread with no event loop: AsyncLLM starts its output task on the loop running where it is
        # built (a Serve replica's own, in __init__), and its requests would then wait on another loop's events.
        # Without one, the task starts on this engine's loop at the first request.
        _run_in_thread(start)
        with self.lock:
            self.refs.append(ref)
        return ref

    @property
    def draft(self):
        return self.current.model

    @property
    def draft_version(self) -> str | None:
        return self.current.version

    def set_draft(self, ref: VllmDraftRef, version: str | None) -> None:
        """New requests decode on `ref`'s engine (`load_draft`'s); the previous one ends with its last request."""
        ref.version = version if ref.model is not None else None
        with self.lock:
            old, self.current = self.current, ref
            old.retired = True
            idle = old.requests == 0
        log.info("draft %s -> %s for new requests (vLLM)", old.version, ref.version)
        if idle:
            self._shutdown(old)

    def _shutdown(self, ref: VllmDraftRef) -> None:
        with self.lock:
            llm, ref.llm = ref.llm, None
            if ref in self.refs:
                self.refs.remove(ref)
        if llm is None:
            return
        handler = getattr(llm, "output_handler", None)
        if handler is not None and self.loop.is_running() and threading.current_thread() is not self.thread:
            # its output task ends first (else it reports the engine core's exit as an error), on its own loop
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_cancelled(handler), self.loop).result(5)
        try:
            llm.shutdown(timeout=10)
        except Exception:  # noqa: BLE001 -- shutting down regardless
            log.exception("vLLM engine shutdown failed")
        del llm
        # AsyncLLM's reference cycles, collected now: its __del__ shuts down again, which fails at interpreter exit
        gc.collect()

    # ---- the Engine interface -----------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.config.max_batch_size + self.config.max_waiting

    def load(self) -> tuple[int, int]:
        """(decoding, waiting): vLLM decodes up to max_batch_size (its max_num_seqs) at once and queues the rest."""
        with self.lock:
            decoding = min(self.active, self.config.max_batch_size)
            return decoding, self.active - decoding

    def submit(self, request: GenerationRequest) -> None:
        with self.lock:
            if self.stopped or self.draining:
                raise Overloaded("the server is shutting down")
            if self.active >= self.capacity:
                decoding = min(self.active, self.config.max_batch_size)
                raise Overloaded(describe_load(decoding, self.active - decoding))
            self.active += 1
            if request.draft is None:
                request.draft = self.current
            request.draft.requests += 1
        asyncio.run_coroutine_threadsafe(self._decode(request), self.loop)

    def stalled(self, seconds: float) -> float | None:
        idle = time.monotonic() - self.progress_at
        with self.lock:
            pending = self.active
            errored = any(getattr(ref.llm, "errored", False) for ref in self.refs if ref.llm is not None)
        if errored or (pending and (idle > seconds or not self.thread.is_alive())):
            return idle
        return None

    def begin_drain(self, drain_s: float = 30.0) -> None:
        with self.lock:
            if not self.draining:
                self.draining = True
                self.drain_deadline = time.monotonic() + drain_s

    def close(self, drain_s: float = 30.0) -> None:
        """Drain (requests may finish for `drain_s`; then the rest get an error event), then shut every engine
        down and stop the loop."""
        self.begin_drain(drain_s)
        while time.monotonic() < self.drain_deadline:
            with self.lock:
                if not self.active:
                    break
            time.sleep(0.05)
        with self.lock:
            self.stopped = True
        self.shutdown_engines()
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        _live.discard(self)

    def shutdown_engines(self) -> None:
        with self.lock:
            refs = list(self.refs)
        for ref in refs:
            self._shutdown(ref)

    # ---- one request (on the loop) ------------------------------------------------------------------------------
    def _sampling_params(self, request: GenerationRequest):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = request.sampling
        return SamplingParams(max_tokens=request.max_tokens, temperature=max(s.temperature, 0.0), top_p=s.top_p,
                              top_k=s.top_k if s.top_k > 0 else 0, seed=request.seed, detokenize=False,
                              output_kind=RequestOutputKind.DELTA)

    async def _decode(self, request: GenerationRequest) -> None:
        ref: VllmDraftRef = request.draft
        rid = uuid.uuid4().hex
        started = time.perf_counter()
        try:
            tokens, finished, reason = await self._stream(request, ref, rid)
            if reason is None:  # the client left, or the drain ran out
                await ref.llm.abort(rid)
                if not request.cancelled:
                    request.on_event(Event("error", text="the server is shutting down"))
                elif self.metrics is not None:
                    self.metrics.on_cancel(1)
                return
            if finished is None:  # a stop string ended it: vLLM's request goes
                await ref.llm.abort(rid)
            request.on_event(self._done(request, tokens, finished, reason, started))
        except Exception:  # noqa: BLE001 -- the client gets an incident id; the log gets the traceback
            incident = uuid.uuid4().hex[:12]
            log.exception("vLLM request failed (incident %s)", incident)
            request.on_event(Event("error", text=f"internal error {incident} (see the server log)"))
        finally:
            with self.lock:
                self.active -= 1
                ref.requests -= 1
                idle = ref.retired and ref.requests == 0
            if idle:
                await asyncio.to_thread(self._shutdown, ref)
            if self.metrics is not None:
                self.metrics.on_load(*self.load())

    async def _stream(self, request: GenerationRequest, ref: VllmDraftRef, rid: str):
        """vLLM's outputs for one request as delta events -> (token ids, vLLM's final output or None, finish
        reason or None when it did not finish: cancelled or drained)."""
        from vllm.inputs import TokensPrompt

        text = TextStream(self.tokenizer, request.stop)
        tokens: list[int] = []
        outputs = ref.llm.generate(TokensPrompt(prompt_token_ids=list(request.prompt_ids)),
                                   self._sampling_params(request), rid)
        async with contextlib.aclosing(outputs):  # closed on an early return: it holds the engine
            async for out in outputs:
                self.progress_at = time.monotonic()
                completion = out.outputs[0]
                tokens += completion.token_ids
                delta, stopped = text.push(list(completion.token_ids))
                if out.finished and not stopped:
                    delta += text.finish()
                if delta:
                    request.on_event(Event("delta", text=delta))
                if stopped:
                    return tokens, None, "stop"
                if out.finished:
                    return tokens, completion, "stop" if completion.finish_reason == "stop" else completion.finish_reason
                if request.cancelled or (self.draining and time.monotonic() > self.drain_deadline):
                    return tokens, None, None
        return tokens, None, None

    def _done(self, request, tokens, completion, reason, started) -> Event:
        """The final event: RequestStats with one round per vLLM verification step (its accepted draft tokens)."""
        spec = getattr(completion, "spec_decode_metrics", None) if completion is not None else None
        accepted = list(getattr(spec, "per_step_accepted", []) or [])
        stats = RequestStats(prompt_tokens=len(request.prompt_ids), new_tokens=len(tokens), rounds=len(accepted),
                             accept_lengths=accepted, depth=getattr(spec, "num_spec_tokens", 0) if spec else 0,
                             total_s=time.perf_counter() - started, finish_reason=reason,
                             modes={VLLM_MODE: len(accepted)} if accepted else {})
        by_mode = {VLLM_MODE: (len(accepted), sum(accepted))} if accepted else {}
        if self.metrics is not None:
            self.metrics.rounds.record(len(accepted), mode=VLLM_MODE)
            self.metrics.on_draft_rounds(accepted)
        return Event("done", finish_reason=reason, stats=stats, token_ids=tokens, accept_by_mode=by_mode)
