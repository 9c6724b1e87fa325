"""Continuous batching over `eagle_core.decoding.DecodingState`: the engine only schedules.

`eagle_core.generate.generate` decodes a fixed batch to the end. A server must let requests join and
leave while others decode, so this engine owns the loop: it admits requests (a prefilled
`DecodingState` per group, merged into a running one: its rows are independent), chooses each round's
mode, calls `DecodingState.step(mode)`, drops finished rows (`select_rows_`) and turns the committed
tokens into per-request events. Every tensor and every decoding step lives in `eagle_core.decoding`;
per-request bookkeeping is `eagle_core.generate.Request`.

One thread runs the loop and owns every tensor. Requests with the same sampling settings and the same draft
share a `Lane` (one batch, one forward per round); different settings decode in separate lanes, one round each
in turn, because acceptance takes one `SamplingConfig` per batch.

Draft swaps (a new `@champion`, `set_draft`): a request is pinned to the engine's current draft when it is
submitted and decodes with that draft to its end (its draft's cache was filled from its own context; moving it
to another draft would mean prefilling that draft over the whole context again). New requests take the new
draft at once; the old one is dropped when its last lane ends. Both are lossless: the target decides every
token, the draft only changes how many are accepted per round.

Load fallback: a wide tree costs B * (total_tokens+1) tokens of target compute per round, which stops
being free once the batch alone fills the hardware (the known "speculation slows down at high load"
failure). Per round, a lane of B rows therefore picks tree, chain (`depth` tokens) or plain decoding:
by default from measurement (`ModeChooser`: the best measured tokens/s at this batch size), or with the
static thresholds (tree while B <= tree_max_batch, chain while B <= chain_max_batch). The plain step of a
speculative lane still captures the target's features for the draft, so the lane can go back to trees
when load drops.

Traffic sink (`pipelines.traffic.TrafficSink`, off by default: `Engine(sink=None)`): with a sink, lanes prefill with
feature capture (when the sink keeps features) and a row that finishes normally hands the sink its prompt, its
answer's token ids and the features of its committed tokens (`DecodingState.take_features([row])`) before it
leaves the batch. `TrafficSink.record` never raises or waits; the engine still wraps the hand-over, so a sink or
capture failure costs that record (counted in `sink_errors`), never the request. With no sink nothing of this runs.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from eagle_core.decoding import CONTEXT, DecodingState, available_modes
from eagle_core.policy import ModeChooser
from eagle_core.static_rows import StaticConfig
from eagle_core.tree import TreeConfig
from eagle_core.verify import SamplingConfig
from pipelines.registry import TAU_TAG
from pipelines.serve.rows import DraftRef, Event, GenerationRequest, Lane, Overloaded, Row, describe_load

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    """The engine's settings and their defaults (`ServeConfig` takes its batching fields' defaults from here)."""

    tree: TreeConfig = field(default_factory=TreeConfig)
    max_batch_size: int = 16  # requests decoded together
    max_waiting: int = 16  # admitted but not decoding yet; a request beyond that gets 503 at once
    # Which decoding mode a round uses at batch size B (a wide tree over many rows costs more target compute than
    # it saves). "auto": the mode with the best measured tokens/s at this batch size (ModeChooser; re-measured every
    # `explore_every` rounds). "static": full trees while B <= tree_max_batch, chains of `depth` tokens while
    # B <= chain_max_batch, plain above.
    tree_max_batch: int = 2
    chain_max_batch: int = 4
    mode_policy: str = "auto"
    explore_every: int = 16
    # Decode on the static caches (`eagle_core.static_kv`, opt-in; `rows` >= max_batch_size lets joining rows in
    # without falling back to eager); None: the growing caches.
    static: StaticConfig | None = None

    def __post_init__(self):
        if self.mode_policy not in ("auto", "static"):
            raise ValueError(f"mode_policy must be 'auto' or 'static', got {self.mode_policy!r}")
        if self.max_batch_size < 1 or self.max_waiting < 0:
            raise ValueError("max_batch_size must be >= 1 and max_waiting >= 0")


def choose_mode(batch_rows: int, config: EngineConfig, has_draft: bool) -> str:
    """The static policy: full trees (with their context chain, if any) up to tree_max_batch rows, chains up to
    chain_max_batch, plain above."""
    if not has_draft or batch_rows > config.chain_max_batch:
        return "plain"
    if batch_rows > config.tree_max_batch:
        return "chain"
    return CONTEXT if config.tree.context_chain else "tree"


# ---- the engine -------------------------------------------------------------------------------------------

class Engine:
    """Admits requests, decodes every lane round by round on one thread, reports per-request events."""

    reference_tag = TAU_TAG  # a registered version's tree tau: the drift rule's reference

    def __init__(self, target, tokenizer, draft, config: EngineConfig, metrics=None, draft_version: str | None = None,
                 sink=None):
        self.target, self.tokenizer, self.config = target, tokenizer, config
        self.metrics = metrics
        # the traffic sink (module docstring); None: no capture, no records. Capture only when it keeps features.
        self.sink = sink
        self.capture = sink is not None and bool(sink.config.features)
        if self.capture and config.static is not None:
            raise ValueError("the traffic sink's features need the eager caches: feature capture does not run on "
                             "the static caches (set static=None, or traffic features off)")
        self._sink_errors_logged: set[str] = set()
        self.sink_errors = 0  # records lost between the engine and the sink (a capture or hand-over failure)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos = {eos} if eos is not None else set()
        self.lanes: dict[tuple, Lane] = {}
        self.current = self._draft_ref(draft, draft_version)  # what new requests decode with (`set_draft`)
        self.waiting: deque[GenerationRequest] = deque()
        self.admitting = 0  # taken from `waiting`, being prefilled: still counts against the capacity
        self.cond = threading.Condition()
        self.stopped = False
        self.draining = False  # close() called: no new requests; running rows finish until the drain deadline
        self.drain_deadline = float("inf")
        # monotonic time the loop last made progress (began an iteration, finished a prefill or a round); with
        # work pending and no progress for a while, the engine is stuck (`stalled`)
        self.progress_at = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="spec-decode-engine", daemon=True)
        self.thread.start()

    def _draft_ref(self, draft, version: str | None) -> DraftRef:
        # with a context chain in the tree, "context" rounds are one more mode to measure (`available_modes`)
        chooser = ModeChooser(available_modes(self.config.tree) if draft is not None else ("plain",),
                              self.config.explore_every) if self.config.mode_policy == "auto" else None
        return DraftRef(draft, version, chooser)

    @property
    def draft(self):
        """The draft new requests decode with (None: plain decoding)."""
        return self.current.model

    @property
    def draft_version(self) -> str | None:
        return self.current.version

    # -- called from other threads --
    def load_draft(self, source: str):
        """The draft at `source` (a folder, URL or registry URI), validated against the target, for `set_draft`."""
        from pipelines.serve.models import load_draft_for

        return load_draft_for(self.target, source)

    def set_draft(self, draft, version: str | None) -> None:
        """Decode requests submitted from now on with `draft` (already validated against the target, on its
        device). Requests already submitted keep the draft they were pinned to, to their end (module docstring)."""
        ref = self._draft_ref(draft, version)
        with self.cond:
            old, self.current = self.current, ref
        log.info("draft %s -> %s for new requests", old.version, version)

    @property
    def capacity(self) -> int:
        return self.config.max_batch_size + self.config.max_waiting

    def _active(self) -> int:
        return self.admitting + sum(len(lane.rows) for lane in self.lanes.values())

    def load(self) -> tuple[int, int]:
        """(decoding rows, waiting requests)."""
        with self.cond:
            return self._active(), len(self.waiting)

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request, or raise Overloaded at once when the engine is full or shutting down."""
        with self.cond:
            active = self._active()
            if self.stopped or self.draining:
                raise Overloaded("the server is shutting down")
            if active + len(self.waiting) >= self.capacity:
                raise Overloaded(describe_load(active, len(self.waiting)))
            if request.draft is None:
                request.draft = self.current
            self.waiting.append(request)
            self.cond.notify()

    def stalled(self, seconds: float) -> float | None:
        """Seconds since the loop last made progress, when requests are pending and that exceeds `seconds`
        (a hung step, a dead thread); else None."""
        with self.cond:
            pending = self._active() + len(self.waiting)
        idle = time.monotonic() - self.progress_at
        if pending and (idle > seconds or not self.thread.is_alive()):
            return idle
        return None

    def begin_drain(self, drain_s: float = 30.0) -> None:
        """Start a graceful stop without waiting for it (a signal handler's part): new requests get Overloaded,
        running and waiting ones decode for up to `drain_s`, then every request still open gets an error event
        and the engine thread ends. A second call keeps the first deadline."""
        with self.cond:
            if not self.draining:
                self.draining = True
                self.drain_deadline = time.monotonic() + drain_s
            self.cond.notify()

    def close(self, drain_s: float = 30.0) -> None:
        """Graceful stop (`begin_drain`), waiting for it. Every request submitted gets a final event ("done" or
        "error") unless the engine thread itself is stuck in a step."""
        self.begin_drain(drain_s)
        self.thread.join(timeout=max(self.drain_deadline - time.monotonic(), 0.0) + 10)
        with self.cond:
            self.stopped = True
            self.cond.notify()
        self.thread.join(timeout=10)
        if self.thread.is_alive():
            log.error("engine thread still busy after close(); its requests may get no final event")

    # -- the engine thread --
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                admitted = self._wait_and_take()
                if admitted is None:
                    self._fail_open("the server is shutting down")
                    return
                self._admit(admitted)
                for key, lane in list(self.lanes.items()):
                    self._guarded(lane.rows, lambda: self._round(lane))
                    self._count_cancelled(lane.drop_finished_())
                    self.progress_at = time.monotonic()
                    if not lane.rows:
                        with self.cond:
                            del self.lanes[key]
                if self.metrics is not None:
                    self.metrics.on_load(*self.load())

    def _count_cancelled(self, n: int) -> None:
        if n and self.metrics is not None:
            self.metrics.on_cancel(n)

    def _fail_open(self, message: str) -> None:
        """End every request the engine still holds (decoding or waiting) with an error event."""
        with self.cond:
            waiting, self.waiting = list(self.waiting), deque()
            lanes, self.lanes = list(self.lanes.values()), {}
        rows = [row for lane in lanes for row in lane.rows if not row.done]
        for row in rows:
            row.done = True
            row.request.on_event(Event("error", text=message))
        for req in waiting:
            req.on_event(Event("error", text=message))
        if rows or waiting:
            log.warning("%d request(s) ended with an error at shutdown", len(rows) + len(waiting))
        if self.metrics is not None:
            self.metrics.on_load(0, 0)

    def _wait_and_take(self) -> list[GenerationRequest] | None:
        """Requests to admit now; None when the engine must stop (closed, or drained / past the drain deadline)."""
        with self.cond:
            while not self.stopped and not self.waiting and not self.lanes:
                if self.draining:
                    return None  # nothing left to finish
                self.cond.wait()
            if self.stopped or (self.draining and time.monotonic() > self.drain_deadline):
                return None
            self.progress_at = time.monotonic()
            room = self.config.max_batch_size - self._active()
            taken = []
            while self.waiting and len(taken) < room:
                req = self.waiting.popleft()
                if not req.cancelled:
                    taken.append(req)
            self.admitting = len(taken)
            return taken

    def _guarded(self, rows: list[Row], step: Callable[[], None]) -> None:
        """Run a step; if it fails, fail its rows (the server stays up for everyone else). The exception is
        logged with an incident id; the clients get only that id (exception text can carry internals)."""
        try:
            step()
        except Exception:  # noqa: BLE001 - reported to the rows' clients by id, logged in full here
            incident = uuid.uuid4().hex[:12]
            for row in rows:
                if not row.done:
                    row.done = True
                    row.request.on_event(Event("error", text=f"internal error {incident} (see the server log)"))
            log.exception("decoding step failed (incident %s); %d request(s) get an error", incident, len(rows))

    def _admit(self, requests: list[GenerationRequest]) -> None:
        groups: dict[tuple, list[GenerationRequest]] = {}
        for req in requests:
            groups.setdefault((req.draft, *_lane_key(req.sampling)), []).append(req)
        for key, group in groups.items():
            depth = self.config.tree.depth if group[0].draft.model is not None else 0
            rows = [Row(r, self.eos, self.tokenizer, depth) for r in group]
            self._guarded(rows, lambda: self._prefill_group(key, group, rows))
            with self.cond:
                self.admitting -= len(group)

    def _prefill_group(self, key, group: list[GenerationRequest], rows: list[Row]) -> None:
        seeds = [r.seed if r.seed is not None else random.SystemRandom().randrange(2 ** 63) for r in group]
        draft = group[0].draft
        state, first = DecodingState.prefill(self.target, draft.model, [r.prompt_ids for r in group],
                                             group[0].sampling, self.config.tree, seeds, static=self.config.static,
                                             capture=True if self.capture else None)
        tap = self._sink_tap(state)
        for i, row in enumerate(rows):
            row.record(first, i, tap)
        if self.metrics is not None:
            self.metrics.on_prefill(len(rows), sum(len(r.prompt_ids) for r in group), first.seconds)
        lane = Lane(group[0].sampling, draft)
        lane.merge_(rows, state)
        self._count_cancelled(lane.drop_finished_())
        if lane.rows:
            with self.cond:
                running = self.lanes.setdefault(key, Lane(lane.sampling, draft))
            running.merge_(lane.rows, lane.state)

    def _round(self, lane: Lane) -> None:
        self._count_cancelled(lane.drop_finished_())  # cancelled rows leave before we spend compute on them
        if not lane.rows:
            return
        b, chooser = len(lane.rows), lane.draft.chooser
        if chooser is not None:
            mode = chooser.choose(b)
        else:
            mode = choose_mode(b, self.config, lane.draft.model is not None)
        step = lane.state.step(mode)
        if chooser is not None:
            chooser.record(b, mode, step.committed, step.round_seconds, step.also)
        tap = self._sink_tap(lane.state)
        for i, row in enumerate(lane.rows):
            row.record(step, i, tap)
        if self.metrics is not None:
            self.metrics.on_round(mode, b, step.draft_s, step.verify_s, step.accept_lengths or [])


    # -- the traffic sink (engine thread) --
    def _sink_tap(self, state: DecodingState):
        """What a finished row of `state` is handed to (`Row.record`'s tap); None without a sink."""
        if self.sink is None:
            return None
        return lambda row, index: self._to_sink(state, row, index)

    def _to_sink(self, state: DecodingState, row: Row, index: int) -> None:
        """Offer a finished row to the sink: prompt ids, answer ids, the features of its committed tokens (taken,
        so the state forgets them) and the request's `traffic` keywords. Nothing here may fail the request: any
        exception costs the record only, counted in `sink_errors` (and logged once per kind)."""
        try:
            features = state.take_features([index])[0] if self.capture else None
            req = row.request
            self.sink.record(req.prompt_ids, list(row.state.tokens), features=features, **(req.traffic or {}))
        except Exception as err:  # noqa: BLE001 -- a lost record, never a failed request
            self.sink_errors += 1
            kind = type(err).__name__
            if kind not in self._sink_errors_logged:
                self._sink_errors_logged.add(kind)
                log.warning("traffic sink: a record was lost (%s: %s); further %s are only counted", kind, err, kind)


def _lane_key(sampling: SamplingConfig) -> tuple:
    if sampling.greedy:
        return ("greedy",)
    return (sampling.temperature, sampling.top_p, sampling.top_k)
