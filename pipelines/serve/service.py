"""What one replica does, independent of Ray: load the models, run the engine, answer the OpenAI routes.

`pipelines.serve.app` wraps this in a Ray Serve deployment; everything here also runs in a plain process.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from eagle_core.chat import encode_prompt
from eagle_core.verify import SamplingConfig
from pipelines.feature_files import DTYPE_NAMES
from pipelines.serve import protocol as P
from pipelines.serve import responses as R
from pipelines.serve.acceptance import DEFAULT_LABEL, AcceptanceRecord, AcceptanceTracker
from pipelines.serve.acceptance_report import AcceptanceReporter, reference_tau, registry_version, resolve_hook
from pipelines.serve.config import ServeConfig, resolve_api_key
from pipelines.serve.engines import SERVE_ENGINES
from pipelines.serve.metrics import ServeMetrics
from pipelines.serve.champion import DraftFollower, RegistryTimeout, bounded
from pipelines.serve.models import LOCAL_DRAFT, NO_DRAFT, watches_alias
from pipelines.serve.rows import Event, GenerationRequest, Overloaded
from pipelines.traffic import resolve_hook as resolve_redaction

log = logging.getLogger(__name__)
class Service:
    def __init__(self, config: ServeConfig, use_ray_metrics: bool = False):
        import torch

        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        else:
            from pipelines.cluster import use_assigned_cpus

            use_assigned_cpus()  # a Serve replica: the CPUs its deployment asked for
        self.config = config
        # a drift hook that does not resolve stops the replica now, before any model is loaded
        drift_hook = resolve_hook(config.drift_hook, config.drift_hook_timeout_s) if config.acceptance else None
        # ... and so does a traffic redaction hook that does not import (the sink's values were checked by ServeConfig)
        redact = resolve_redaction(config.traffic_redact) if config.traffic_url is not None else None
        # the registry's draft, or the last one recorded when the registry does not answer (champion.py)
        self.champion = DraftFollower(config.draft, config.draft_record, config.registry_timeout_s,
                                      config.draft_stale_polls)
        draft_source, version = self.champion.resolve_at_start()
        self.api_key = resolve_api_key(config)
        self.metrics = ServeMetrics(config.depth, use_ray=use_ray_metrics)
        self.metrics.add_source(lambda: self.metrics.on_draft(self.champion))
        self.traffic = None  # the sink, when on (`_start_traffic`, called by the engine's start with the models)
        started = SERVE_ENGINES[config.engine_name](config, draft_source, version, self.metrics,
                                                    lambda models: self._start_traffic(models, redact))
        self.engine, self.tokenizer, self.speculative = started.engine, started.tokenizer, started.speculative
        self.dtype, self.vocab_size = started.dtype, started.vocab_size
        self.context = min(config.max_context, started.context_length)
        if getattr(self.engine, "spec_counts", None) is not None:  # vLLM's engine-wide counters
            self.metrics.enable_vllm_spec(self.engine.spec_counts)
        self.champion.serving(version)
        if not self.champion.from_record:
            self.champion.remember(draft_source, version)
        self.created = R.now()
        self.replica: str | None = None  # a Serve replica's id (set by the deployment; a response header)
        self._start_acceptance(version, drift_hook)
        # Chat templating and tokenisation of a body of up to max_body_bytes (~1 s for 1 MiB on a CPU core) run
        # here, off the event loop, which meanwhile keeps handing every other stream its events (the fast
        # tokenizers release the GIL while they encode; `text_ids` converts only the ids back to Python).
        self.tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="eagle3-tokenize")
        self.closed = threading.Event()
        self.watcher = None
        if watches_alias(config.draft) and config.draft_poll_s > 0:
            self.watcher = threading.Thread(target=self._watch_draft, name="eagle3-draft-watch", daemon=True)
            self.watcher.start()
        log.info("serving %s (draft: %s, version %s) with %s", config.served_name, config.draft, version,
                 config.tree)

    # ---- one champion everywhere: follow the draft's registry alias ---------------------------------------
    def refresh_draft(self) -> bool:
        """Look the draft's alias up again; when it names another version, load that draft (validated against the
        target) and decode new requests with it (`Engine.set_draft`). True when the draft changed."""
        pinned, version = self.champion.lookup()
        if self.champion.from_record:  # started from the record: the registry answers again, caught up now
            self.champion.from_record = False
            if version == self.engine.draft_version:
                self.set_acceptance_reference(version, self._reference_tau(version))
        if version == self.engine.draft_version:
            return False
        t0 = time.perf_counter()
        try:
            draft = self.engine.load_draft(pinned)
        except Exception as exc:
            self.champion.failed(exc)
            raise
        reference = self._reference_tau(version)  # the registry read happens here, off the event loop
        self.engine.set_draft(draft, version)
        self.champion.serving(version)
        self.set_acceptance_reference(version, reference)
        self.champion.remember(pinned, version)
        log.info("draft %s now serves new requests (loaded in %.1f s)", pinned, time.perf_counter() - t0)
        return True

    def _watch_draft(self) -> None:
        """Every draft_poll_s: `refresh_draft`. A registry that does not answer, an alias that is gone or a draft
        that does not load (or does not fit the target) leaves the current draft serving; each distinct failure
        is logged once."""
        last_error = None
        while not self.closed.wait(self.config.draft_poll_s):
            try:
                self.refresh_draft()
                last_error = None
            except Exception as exc:  # noqa: BLE001 - logged; the replica keeps serving its current draft
                if repr(exc) != last_error:
                    log.warning("cannot follow %s; still serving draft version %s", self.config.draft,
                                self.engine.draft_version, exc_info=exc)
                last_error = repr(exc)

    # ---- the traffic sink (pipelines/traffic.py), off unless traffic_url is set ---------------------------------
    def _start_traffic(self, models, redact):
        """The sink for served conversations, or None (off: no sink object, no capture, nothing recorded). Its
        fingerprint is the extraction's for this target (weights and tokenizer hashes, the features' dtype and aux
        layers), so training takes the shards as an extraction's. A store that is unreachable now does not stop
        the replica: the sink drops and counts what it cannot write."""
        config = self.config
        if config.traffic_url is None:
            return None
        from eagle_core.target import materialize_hf_folder
        from pipelines.storage import resolve_source
        from pipelines.traffic import TrafficSink
        from pipelines.traffic_config import traffic_fingerprint

        traffic = config.traffic
        dtype = models.target.get_input_embeddings().weight.dtype
        folder = materialize_hf_folder(resolve_source(config.target))
        fingerprint = traffic_fingerprint(traffic, folder, models.target.config, dtype)
        sink = self.traffic = TrafficSink(traffic, tokenizer=models.tokenizer, dtype=dtype, redact=redact,
                                          target_config=models.target.config, fingerprint=fingerprint)
        self.metrics.enable_traffic()
        self.metrics.add_source(self._traffic_metrics)
        log.info("traffic sink on: %s (sample rate %g, features %s)", config.traffic_url, config.traffic_sample_rate,
                 config.traffic_features)
        return sink

    def _traffic_metrics(self) -> None:
        """The sink's counters into /metrics (and Ray's export); records the engine lost before the sink count as
        dropped, reason "engine_error"."""
        stats = self.traffic.stats()
        stats["dropped"] = {**stats["dropped"], "engine_error": self.engine.sink_errors}
        self.metrics.on_traffic(stats)

    def traffic_fields(self, req) -> dict | None:
        """The sink's `record` keywords for a request: its chat messages (the template's loss mask over earlier
        assistant turns) and its category label; None when the sink is off."""
        if self.traffic is None:
            return None
        messages = req.message_dicts if isinstance(req, P.ChatCompletionRequest) else None
        return {"messages": messages, "meta": {"category": getattr(req, "category", None) or DEFAULT_LABEL}}

    # ---- acceptance as a live signal (pipelines/serve/acceptance.py) ------------------------------------------
    def _start_acceptance(self, version: str | None, hook) -> None:
        """Per-label windows and the drift rule for the served version; the reporter (MLflow, the drift hook)."""
        config = self.config
        self.acceptance: AcceptanceTracker | None = None
        self.reporter: AcceptanceReporter | None = None
        # the tracker is fed on the event loop and re-referenced by the draft watch: one lock for both
        self.acceptance_lock = threading.Lock()
        if not config.acceptance or not self.speculative:
            return  # plain decoding has tau 1 by definition: nothing to watch
        reference = self._reference_tau(version)
        self.acceptance = AcceptanceTracker(config.acceptance_window, config.drift_margin, reference, version,
                                            config.acceptance_max_labels,
                                            alert_interval_s=config.drift_alert_interval_s)
        self.metrics.on_reference(reference)
        ref = registry_version(config.draft, version)
        if hook is None and not (config.acceptance_experiment and ref):
            return  # nothing to report beyond /metrics
        self.reporter = AcceptanceReporter(
            config.acceptance_experiment, ref[0] if ref else None, hook, config.drift_hook_cooldown_s,
            on_drop=self.metrics.on_report_dropped,
            tags=lambda: {"eagle3.replica": self.replica or "", "eagle3.served_model": config.served_name},
            params={"acceptance_window": config.acceptance_window, "drift_margin": config.drift_margin,
                    "tree": str(config.tree)})
        log.info("acceptance: window %d requests, drift reference tau %s, margin %g", config.acceptance_window,
                 reference, config.drift_margin)

    def _reference_tau(self, version: str | None) -> float | None:
        """The drift rule's reference for `version`; None (no rule until the registry answers again) when the
        replica started from its draft record, or when the registry does not answer within registry_timeout_s."""
        if not self.config.acceptance or self.champion.from_record:
            return None
        served_dtype = DTYPE_NAMES[self.dtype]  # named as the evaluation names it (TAU_DTYPE_TAG)
        try:
            tag = self.engine.reference_tag  # what the evaluation measured for this engine (a version's tag)
            return bounded(lambda: reference_tau(self.config, version, served_dtype, tag), self.config.registry_timeout_s)
        except RegistryTimeout as exc:
            log.warning("no drift reference for draft version %s: %s", version, exc)
            return None

    def set_acceptance_reference(self, version: str | None, reference: float | None) -> None:
        """A new served version (or reference tau): windows and alerts start afresh."""
        if self.acceptance is None:
            return
        with self.acceptance_lock:
            labels = list(self.acceptance.labels)
            self.acceptance.set_reference(version, reference)
        self.metrics.clear_drift(labels)
        self.metrics.on_reference(reference)

    def record_acceptance(self, req, gen: GenerationRequest, event: Event) -> None:
        """A finished request's acceptance: /metrics by label, the drift window, and what the reporter sends on."""
        if self.acceptance is None:
            return
        stats = event.stats
        with self.acceptance_lock:
            category = self.acceptance.cap.fold(getattr(req, "category", None) or DEFAULT_LABEL)
            # the version the request was pinned to (pin_draft's label, as the tracker's): after a swap, requests
            # finishing on the previous draft are told apart from the new one's
            record = AcceptanceRecord(category, gen.draft.version if gen.draft is not None else None,
                                      tuple(stats.accept_lengths), dict(event.accept_by_mode), dict(stats.modes))
            summaries, events = self.acceptance.observe(record)
            window_tau = self.acceptance.window_tau(category)
        self.metrics.on_acceptance(record, window_tau)
        for drift in events:
            self.metrics.on_drift(drift)
            log.warning("acceptance drift %s for %r: window tau %.3f vs reference %.3f - margin %g%s", drift.kind,
                        drift.category, drift.window_tau, drift.reference_tau, drift.margin,
                        " (the label alerted less than drift_alert_interval_s ago)" if drift.kind == "suppressed"
                        else "")
        if self.reporter is not None:  # a suppressed alert is counted, neither logged to MLflow nor hooked
            for item in (*summaries, *(e for e in events if e.kind != "suppressed")):
                self.reporter.submit(item)

    # ---- checks ------------------------------------------------------------------------------------------
    def authorize(self, headers) -> None:
        if self.api_key is None:
            return
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise P.ApiError(401, "missing or invalid bearer token", type="authentication_error",
                             code="invalid_api_key")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_name:
            raise P.ApiError(404, f"model {model!r} does not exist; this server serves {self.config.served_name!r}",
                             param="model", code="model_not_found")

    def prompt_ids(self, req) -> list[int]:
        if isinstance(req, P.ChatCompletionRequest):
            ids = encode_prompt(self.tokenizer, req.message_dicts)
        else:
            prompt = req.prompt_input
            if isinstance(prompt, list) and any(not 0 <= t < self.vocab_size for t in prompt):
                raise P.ApiError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
            ids = encode_prompt(self.tokenizer, prompt)
        if not ids:
            raise P.ApiError(400, "the prompt encodes to no tokens", param="prompt")
        return ids

    def max_tokens(self, req, prompt_len: int) -> int:
        if prompt_len >= self.context:
            raise P.ApiError(400, f"prompt has {prompt_len} tokens; this model's context is {self.context}",
                             param="prompt" if isinstance(req, P.CompletionRequest) else "messages",
                             code="context_length_exceeded")
        asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
        if asked is None:
            return min(self.config.default_max_tokens, self.context - prompt_len)
        if asked > self.config.max_tokens_limit:
            raise P.ApiError(400, f"max_tokens {asked} exceeds the limit {self.config.max_tokens_limit}",
                             param="max_tokens")
        if prompt_len + asked > self.context:
            raise P.ApiError(400, f"prompt ({prompt_len} tokens) + max_tokens ({asked}) exceeds the context "
                             f"({self.context})", param="max_tokens", code="context_length_exceeded")
        return asked

    # ---- routes -------------------------------------------------------------------------------------------
    def models_body(self) -> dict:
        return {"object": "list", "data": [{"id": self.config.served_name, "object": "model",
                                             "created": self.created, "owned_by": "eagle3-pipeline",
                                             "draft_version": self.engine.draft_version or NO_DRAFT}]}

    def health_body(self) -> dict:
        """status: "ok"; "dead" (engine thread gone); "stalled" (requests pending and no progress for
        stall_timeout_s: a hung step, answered 503 so that probes and Serve's health check replace the replica)."""
        running, waiting = self.engine.load()
        stalled = self.engine.stalled(self.config.stall_timeout_s)
        status = "dead" if not self.engine.thread.is_alive() else "stalled" if stalled is not None else "ok"
        body = {"status": status, "model": self.config.served_name, "speculative": self.speculative,
                "draft_version": self.engine.draft_version or NO_DRAFT, "running": running, "waiting": waiting}
        if stalled is not None:
            body["seconds_without_progress"] = round(stalled, 1)
        body["draft"] = self.champion.status()  # a failing registry leaves status "ok": the replica serves on
        return body

    async def submit(self, req) -> tuple[GenerationRequest, asyncio.Queue, int]:
        """Validate the request against the model and queue it in the engine (ApiError 4xx / 503)."""
        self.check_model(req.model)
        ids = await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, self.prompt_ids, req)
        max_tokens = self.max_tokens(req, len(ids))
        queue: asyncio.Queue[Event] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        gen = GenerationRequest(ids, max_tokens, SamplingConfig(req.temperature, req.top_p, req.top_k),
                                on_event=lambda e: loop.call_soon_threadsafe(queue.put_nowait, e),
                                seed=req.seed, stop=req.stop_sequences, traffic=self.traffic_fields(req))
        try:
            self.engine.submit(gen)
        except Overloaded as exc:
            raise P.ApiError(503, f"server overloaded, retry later ({exc})", type="server_overloaded",
                             code="overloaded") from None
        finally:
            self.metrics.on_load(*self.engine.load())
        return gen, queue, len(ids)

    async def events(self, gen: GenerationRequest, queue: asyncio.Queue):
        """The engine's events for one request until done; the request is cancelled if we stop early (the
        client went away, the request timed out). Past request_timeout_s: ApiError 504."""
        deadline = time.monotonic() + self.config.request_timeout_s
        try:
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), max(deadline - time.monotonic(), 0.0))
                except asyncio.TimeoutError:
                    self.metrics.on_timeout()
                    raise P.ApiError(504, f"the request did not finish within {self.config.request_timeout_s:g} s",
                                     type="timeout_error", code="request_timeout") from None
                yield event
                if event.kind != "delta":
                    return
        finally:
            gen.cancelled = True  # no-op once finished; frees the row when the client went away
            self.metrics.on_load(*self.engine.load())

    async def complete(self, req, chat: bool) -> dict:
        gen, queue, prompt_len = await self.submit(req)
        rid, created, parts = R.new_id("chatcmpl" if chat else "cmpl"), R.now(), []
        async for event in self.events(gen, queue):
            if event.kind == "error":  # the text names an incident id, never the exception's text
                raise P.ApiError(500, f"generation failed: {event.text}", type="server_error")
            if event.kind == "delta":
                parts.append(event.text)
                continue
            self.metrics.on_finish(event.stats)
            self.record_acceptance(req, gen, event)
            if self.traffic is not None:  # Ray's metric export sees the sink's counters without a scrape
                self._traffic_metrics()
            build = R.chat_body if chat else R.completion_body
            return build(rid, created, self.config.served_name, "".join(parts), event.finish_reason,
                         R.usage(prompt_len, event.stats.new_tokens), speculative_info(gen, event.stats))
        raise P.ApiError(500, "generation ended without a result", type="server_error")

    async def stream(self, req, chat: bool, on_end=None) -> "EventStream":
        """Server-sent events in OpenAI's chunk format; the final chunk adds usage and speculative stats."""
        gen, queue, prompt_len = await self.submit(req)
        return EventStream(gen, self._stream_events(req, chat, gen, queue, prompt_len, on_end))

    async def _stream_events(self, req, chat, gen, queue, prompt_len, on_end):
        rid, created, model = R.new_id("chatcmpl" if chat else "cmpl"), R.now(), self.config.served_name
        chunk = (lambda text, reason=None: R.chat_chunk(rid, created, model, {"content": text} if text else {},
                                                        reason)) if chat else \
            (lambda text, reason=None: R.completion_chunk(rid, created, model, text, reason))
        code = 200
        try:
            if chat:
                yield R.sse(R.chat_chunk(rid, created, model, {"role": "assistant", "content": ""}))
            events = self.events(gen, queue)
            try:
                async for event in events:
                    if event.kind == "delta":
                        yield R.sse(chunk(event.text))
                    elif event.kind == "error":
                        code = 500
                        yield R.sse(P.error_body(f"generation failed: {event.text}", "server_error"))
                    else:
                        self.metrics.on_finish(event.stats)
                        self.record_acceptance(req, gen, event)
                        if self.traffic is not None:  # Ray's metric export sees the sink's counters without a scrape
                            self._traffic_metrics()
                        last = chunk("", event.finish_reason)
                        last["usage"] = R.usage(prompt_len, event.stats.new_tokens)
                        last["speculative"] = speculative_info(gen, event.stats)
                        yield R.sse(last)
                        if req.stream_options is not None and req.stream_options.include_usage:
                            usage_chunk = chunk("")
                            usage_chunk["choices"], usage_chunk["usage"] = [], last["usage"]
                            yield R.sse(usage_chunk)
            except P.ApiError as err:  # a timeout after the 200 went out: reported in the stream
                code = err.status
                yield R.sse(err.body())
            finally:
                await events.aclose()
            yield R.SSE_DONE
        finally:
            if on_end is not None:
                on_end(code)

    def close(self) -> None:
        """Graceful drain (Engine.close): every request still open ends with a final event."""
        self.closed.set()  # the draft watch stops at its next wake-up
        self.engine.close(self.config.drain_s)
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        if self.reporter is not None:
            self.reporter.close()
        if self.traffic is not None:  # after the drain: every finished request has been offered
            try:
                # what is buffered is written: close() waits up to twice its timeout (the flush, then the thread)
                self.traffic.close(self.config.traffic_close_s / 2)
                self._traffic_metrics()
            except Exception:  # noqa: BLE001 -- shutting down regardless
                log.exception("traffic sink: close failed")


def draft_version(gen: GenerationRequest) -> str:
    """The version label of the draft a request decoded with ("none": plain decoding)."""
    ref = gen.draft
    return (ref.version or LOCAL_DRAFT) if ref is not None and ref.model is not None else NO_DRAFT


def speculative_info(gen: GenerationRequest, stats) -> dict:
    """The response's `speculative` field: the request's stats and the draft version that served it."""
    return {**R.speculative_info(stats), "draft_version": draft_version(gen)}


class EventStream:
    """One request's SSE chunks (an async iterator). `aclose()` cancels its engine row even when iteration never
    began: a client that leaves before the first chunk must free its row too (an async generator that never
    started runs no `finally`)."""

    def __init__(self, gen: GenerationRequest, chunks):
        self.gen, self.chunks = gen, chunks

    @property
    def draft_version(self) -> str:
        return draft_version(self.gen)

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.chunks.__anext__()

    async def aclose(self) -> None:
        self.gen.cancelled = True  # no-op once finished
        await self.chunks.aclose()


def elapsed_since(t0: float) -> float:
    return time.perf_counter() - t0
