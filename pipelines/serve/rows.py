"""The serving engine's requests and rows: what a caller submits (`GenerationRequest`) and hears back (`Event`), the
draft a request decodes with (`DraftRef`), the 503 (`Overloaded`), and the engine's own bookkeeping of a request
while it decodes (`Row`) and of a batch of rows sharing one decoding state (`Lane`). The engine's loop, admission
and mode policy are in `pipelines.serve.engine`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from eagle_core.decoding import DecodingState, Step
from eagle_core.generate import Request, RequestStats
from eagle_core.kv import TargetKV
from eagle_core.policy import ModeChooser
from eagle_core.verify import SamplingConfig
from pipelines.serve.text_stream import TextStream


class Overloaded(RuntimeError):
    """The engine holds as many requests as it may; the caller answers 503."""


def describe_load(decoding: int, waiting: int) -> str:
    """The 503's reason: "1 request decoding and 31 waiting" (the noun agrees with the first count)."""
    return f"{decoding} request{'' if decoding == 1 else 's'} decoding and {waiting} waiting"


@dataclass(eq=False)
class DraftRef:
    """One draft the engine decodes with: the model (None = plain decoding), the version that names it in
    responses, and its own mode chooser (which mode pays depends on the draft's acceptance, so a new draft is
    measured afresh). Compared by identity: lanes are keyed by it."""

    model: torch.nn.Module | None
    version: str | None
    chooser: ModeChooser | None = None


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    on_event: Callable[["Event"], None]  # called from the engine thread
    seed: int | None = None
    stop: tuple[str, ...] = ()
    cancelled: bool = False  # set by the caller (client gone); the row leaves at the next round
    draft: DraftRef | None = None  # set by Engine.submit: the draft this request decodes with, to its end
    # keyword arguments for the traffic sink's `record` (messages, meta such as the category label); None: the
    # caller set none (the sink still gets the prompt and answer ids). Unused when the engine has no sink.
    traffic: dict | None = None


@dataclass
class Event:
    kind: str  # "delta" (new text), "done" (finished; carries stats), "error"
    text: str = ""
    finish_reason: str | None = None
    stats: RequestStats | None = None
    token_ids: list[int] = field(default_factory=list)
    # "done": draft rounds by mode as (rounds, accepted tokens): the acceptance signal compares tree rounds alone
    # (pipelines/serve/acceptance.py), and RequestStats keeps accept lengths without their modes
    accept_by_mode: dict[str, tuple[int, int]] = field(default_factory=dict)


class Row:
    """One decoding request: its `Request` bookkeeping (tokens, stats, rounds per mode) plus its text."""

    def __init__(self, request: GenerationRequest, eos: set[int], tokenizer, depth: int):
        self.request = request
        self.state = Request(len(request.prompt_ids), request.max_tokens, eos, depth=depth)
        self.text = TextStream(tokenizer, request.stop)
        self.started = time.perf_counter()
        self.done = False
        self.accept_by_mode: dict[str, tuple[int, int]] = {}  # Event.accept_by_mode

    @property
    def stats(self) -> RequestStats:
        return self.state.stats

    def record(self, step: Step, row: int, tap: Callable[["Row", int], None] | None = None) -> None:
        """Batch row `row` of a step -> text delta event; finish on eos, length or a stop string. `tap` (the
        traffic sink's, or None) gets a row that finished, with its batch index, before its "done" event goes out:
        its features are still in the state, and the record is offered before the client hears the answer."""
        before = len(self.state.tokens)
        if step.accept_lengths is not None:
            rounds, accepted = self.accept_by_mode.get(step.mode, (0, 0))
            self.accept_by_mode[step.mode] = (rounds + 1, accepted + step.accept_lengths[row])
        self.done = self.state.record(step, row)
        delta, stopped = self.text.push(self.state.tokens[before:])
        if stopped:
            self.done, self.stats.finish_reason = True, "stop"
        elif self.done:
            delta += self.text.finish()
        if delta:
            self.request.on_event(Event("delta", text=delta))
        if self.done:
            if tap is not None:
                tap(self, row)
            self.finish()

    def finish(self) -> None:
        s = self.stats
        s.new_tokens = len(self.state.tokens)
        s.total_s = time.perf_counter() - self.started
        reason = "stop" if s.finish_reason in ("eos", "stop") else s.finish_reason
        self.request.on_event(Event("done", finish_reason=reason, stats=s, token_ids=list(self.state.tokens),
                                    accept_by_mode=dict(self.accept_by_mode)))


class Lane:
    """Rows that share one SamplingConfig and one draft: one `DecodingState` (row i = rows[i]), decoded together."""

    def __init__(self, sampling: SamplingConfig, draft: DraftRef):
        self.sampling, self.draft = sampling, draft
        self.rows: list[Row] = []
        self.state: DecodingState | None = None

    def merge_(self, rows: list[Row], state: DecodingState) -> None:
        """New rows (just prefilled) join after the running ones. A merge that raises leaves the running rows'
        state as it was (`restorable`), so only the joining rows fail."""
        if self.state is None:
            self.rows, self.state = list(rows), state
            return
        if self.state.dkv is not None:  # deferred draft steps first: they change the state, and stay valid
            self.state.catch_up_draft_()
        saved = restorable(self.state)
        try:
            self.state.merge_(state)
        except BaseException:
            for obj, attrs in saved:
                obj.__dict__.update(attrs)
            raise
        self.rows += rows

    def drop_finished_(self) -> int:
        """Drop finished and cancelled rows; returns how many were cancelled (their client went away)."""
        keep = [i for i, row in enumerate(self.rows) if not (row.done or row.request.cancelled)]
        cancelled = sum(1 for row in self.rows if row.request.cancelled and not row.done)
        if len(keep) < len(self.rows):
            self.rows = [self.rows[i] for i in keep]
            if keep:
                self.state.select_rows_(keep)
            else:
                self.state = None
        return cancelled


def restorable(state: DecodingState) -> list[tuple[object, dict]]:
    """Shallow copies of the attributes a merge reassigns: the state's, its caches' and every cache layer's.
    A merge builds new tensors (`torch.cat`, `kv.pad_cat`) and assigns them; it never writes into the old ones,
    so putting the old references back restores the state exactly."""
    # A static cache's tensors are never replaced (a merge writes its spare rows): its attributes are enough.
    objects = [state, state.kv, *(state.kv.cache.layers if isinstance(state.kv, TargetKV) else ())]
    if state.dkv is not None:
        objects.append(state.dkv)
    return [(obj, dict(obj.__dict__)) for obj in objects]
