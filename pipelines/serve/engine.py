"""Continuous batching around the speculative generator's steps (`eagle_core.generate`).

`eagle_core.generate.generate` decodes a fixed batch to the end. A server must let requests join and
leave while others decode, so this engine owns the loop instead and reuses the generator's steps as they
are: `prefill` + `draft_prefill` for newly admitted requests, `speculative_decode` (tree or chain) or a
plain step for the running batch, and the ragged caches of `eagle_core.kv`, whose rows are independent:
admitting a request is a row concatenation (`merge_target_kv_`), finishing one is `select_rows_`.

One thread runs the loop and owns every tensor. Requests with the same sampling settings share a `Lane`
(one batch, one forward per round); different settings decode in separate lanes, one round each in turn,
because acceptance takes one `SamplingConfig` per batch.

Load fallback: a wide tree costs B * (total_tokens+1) tokens of target compute per round, which stops
being free once the batch alone fills the hardware (the known "speculation slows down at high load"
failure). Per round, a lane of B rows therefore picks tree, chain (`depth` tokens) or plain decoding:
by default from measurement (`ModeChooser`: the best measured tokens/s at this batch size), or with the
static thresholds (tree while B <= tree_max_batch, chain while B <= chain_max_batch). The plain step of a speculative lane still captures
the target's features and extends the draft's cache, so the lane can go back to trees when load drops.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from eagle_core.generate import RequestStats, _Request, decode_one_token, draft_extend, draft_prefill, prefill, speculative_decode
from eagle_core.kv import DraftKV, TargetKV, target_forward
from eagle_core.tree import TreeConfig
from eagle_core.verify import SamplingConfig, sample_next

MODES = ("tree", "chain", "plain")
log = logging.getLogger(__name__)


class Overloaded(RuntimeError):
    """The engine holds as many requests as it may; the caller answers 503."""


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    on_event: Callable[["Event"], None]  # called from the engine thread
    seed: int | None = None
    stop: tuple[str, ...] = ()
    cancelled: bool = False  # set by the caller (client gone); the row leaves at the next round


@dataclass
class Event:
    kind: str  # "delta" (new text), "done" (finished; carries stats), "error"
    text: str = ""
    finish_reason: str | None = None
    stats: RequestStats | None = None
    token_ids: list[int] = field(default_factory=list)
    modes: dict[str, int] = field(default_factory=dict)  # rounds per decoding mode


@dataclass
class EngineConfig:
    tree: TreeConfig
    max_batch_size: int = 16
    max_waiting: int = 16
    tree_max_batch: int = 2
    chain_max_batch: int = 4
    mode_policy: str = "auto"  # "auto": ModeChooser measures; "static": the two thresholds above
    explore_every: int = 16


def choose_mode(batch_rows: int, config: EngineConfig, has_draft: bool) -> str:
    """The static policy: full trees up to tree_max_batch rows, chains up to chain_max_batch, plain above."""
    if not has_draft or batch_rows > config.chain_max_batch:
        return "plain"
    return "tree" if batch_rows <= config.tree_max_batch else "chain"


class ModeChooser:
    """The auto policy: pick, per batch size, the mode with the best measured throughput.

    Whether a tree pays depends on tau (the draft, the workload) and on how much a B x (total_tokens+1)
    verification costs over a B-token step (the hardware): tree wins iff tau_tree / t_tree(B) >
    1 / t_plain(B). Both sides are measured here, per batch-size bucket (powers of two), as an
    exponential moving average of committed tokens per second of each round. Every mode is tried
    first; afterwards the best one runs, and one round in `explore_every` re-measures another mode,
    so a change of load or workload is noticed. Switching costs nothing: every mode is lossless and
    keeps the caches in the same state.
    """

    def __init__(self, modes=MODES, explore_every: int = 16, alpha: float = 0.25):
        self.modes, self.explore_every, self.alpha = tuple(modes), explore_every, alpha
        self.rate: dict[tuple[int, str], float] = {}
        self.rounds: dict[int, int] = {}

    @staticmethod
    def bucket(batch_rows: int) -> int:
        return 1 << (batch_rows - 1).bit_length()

    def choose(self, batch_rows: int) -> str:
        b = self.bucket(batch_rows)
        n = self.rounds.get(b, 0)
        untried = [m for m in self.modes if (b, m) not in self.rate]
        if untried:
            return untried[0]
        best = max(self.modes, key=lambda m: self.rate[(b, m)])
        if self.explore_every and n % self.explore_every == self.explore_every - 1:
            others = [m for m in self.modes if m != best]
            return others[(n // self.explore_every) % len(others)] if others else best
        return best

    def record(self, batch_rows: int, mode: str, tokens: int, seconds: float) -> None:
        b = self.bucket(batch_rows)
        self.rounds[b] = self.rounds.get(b, 0) + 1
        rate = tokens / max(seconds, 1e-9)
        old = self.rate.get((b, mode))
        self.rate[(b, mode)] = rate if old is None else (1 - self.alpha) * old + self.alpha * rate


# ---- text: incremental detokenisation and stop strings -----------------------------------------------------

class TextStream:
    """Turns committed tokens into text deltas; ends the request at the first stop string.

    The text is re-decoded from all tokens (a BPE token may change how its neighbours decode), a trailing
    U+FFFD (a half-finished UTF-8 character) is held back, and so are the last `max(len(stop)) - 1`
    characters, which could be the start of a stop string that the next tokens complete.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.tokens: list[int] = []
        self.sent = 0  # characters of the text already emitted
        self.holdback = max((len(s) for s in self.stop), default=1) - 1

    def text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def push(self, tokens: list[int]) -> tuple[str, bool]:
        """Add tokens; return (new text safe to emit, whether a stop string ended the request)."""
        self.tokens.extend(tokens)
        text = self.text()
        cut = min((i for i in (text.find(s, max(self.sent - self.holdback, 0)) for s in self.stop) if i >= 0),
                  default=-1)
        if cut >= 0:
            return self._take(text[:cut]), True
        end = len(text) - self.holdback
        if text.endswith("\ufffd"):
            end = min(end, len(text) - 1)
        return self._take(text[:max(end, self.sent)]), False

    def finish(self) -> str:
        """The held-back tail once the request ends without a stop string."""
        return self._take(self.text())

    def _take(self, text: str) -> str:
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta


# ---- rows and lanes -----------------------------------------------------------------------------------------

class _Row:
    """One decoding request: the generator's bookkeeping (`_Request`) plus text and mode counts."""

    def __init__(self, request: GenerationRequest, eos: set[int], tokenizer, depth: int):
        self.request = request
        self.state = _Request(len(request.prompt_ids), request.max_tokens, eos, (), None, depth)
        self.text = TextStream(tokenizer, request.stop)
        self.modes = {m: 0 for m in MODES}
        self.started = time.perf_counter()
        self.done = False

    @property
    def stats(self) -> RequestStats:
        return self.state.stats

    def emit(self, tokens: list[int]) -> None:
        """Committed tokens -> text delta event; finish on eos, length or a stop string."""
        before = len(self.state.tokens)
        self.done = self.state.emit(tokens)
        delta, stopped = self.text.push(self.state.tokens[before:])
        if stopped:
            self.done, self.stats.finish_reason = True, "stop"
        elif self.done:
            delta += self.text.finish()
        if delta:
            self.request.on_event(Event("delta", text=delta))
        if self.done:
            self.finish()

    def finish(self) -> None:
        s = self.stats
        s.new_tokens = len(self.state.tokens)
        s.total_s = time.perf_counter() - self.started
        reason = "stop" if s.finish_reason in ("eos", "stop") else s.finish_reason
        self.request.on_event(Event("done", finish_reason=reason, stats=s, token_ids=list(self.state.tokens),
                                    modes=dict(self.modes)))


class Lane:
    """Rows that share one SamplingConfig: one ragged batch with its caches, decoded together."""

    def __init__(self, sampling: SamplingConfig):
        self.sampling = sampling
        self.rows: list[_Row] = []
        self.kv: TargetKV | None = None
        self.dkv: DraftKV | None = None
        self.root: torch.Tensor | None = None  # [B] last committed token, not yet in the target's cache
        self.draft_hidden: torch.Tensor | None = None  # [B, 1, H]
        self.generators: list | None = None
        # Plain steps of a speculative lane defer the draft's cache update: their target features and
        # tokens wait here ([B, 1, 3H] and [B, 1] per step) until a tree/chain round needs the draft.
        self.pending_aux: list[torch.Tensor] = []
        self.pending_tokens: list[torch.Tensor] = []

    def catch_up_draft_(self, draft) -> None:
        """Extend the draft's cache with every deferred step in one forward (same entries as one by one)."""
        if not self.pending_aux:
            return
        aux, tokens = torch.cat(self.pending_aux, dim=1), torch.cat(self.pending_tokens, dim=1)  # [B, k, ...]
        n_new = torch.full((aux.shape[0],), aux.shape[1], dtype=torch.long, device=aux.device)
        self.draft_hidden = draft_extend(draft, self.dkv, aux, tokens, n_new)
        self.pending_aux, self.pending_tokens = [], []

    def merge_(self, other: "Lane", draft) -> None:
        """Append `other`'s rows (just prefilled, nothing deferred) to this batch."""
        if not self.rows:
            self.__dict__.update(other.__dict__)
            return
        if draft is not None:
            self.catch_up_draft_(draft)  # deferred steps are per-row equal only among the old rows
        self.rows += other.rows
        merge_target_kv_(self.kv, other.kv)
        if self.dkv is not None:
            merge_draft_kv_(self.dkv, other.dkv)
            self.draft_hidden = torch.cat([self.draft_hidden, other.draft_hidden])
        self.root = torch.cat([self.root, other.root])
        if self.generators is not None:
            self.generators += other.generators

    def drop_finished_(self) -> None:
        keep = [i for i, row in enumerate(self.rows) if not (row.done or row.request.cancelled)]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.kv = self.dkv = self.root = self.draft_hidden = self.generators = None
            return
        idx = torch.tensor(keep, device=self.root.device)
        self.kv.select_rows_(idx)
        self.root = self.root[idx]
        self.pending_aux = [t[idx] for t in self.pending_aux]
        self.pending_tokens = [t[idx] for t in self.pending_tokens]
        if self.dkv is not None:
            self.dkv.select_rows_(idx)
            self.draft_hidden = self.draft_hidden[idx]
        if self.generators is not None:
            self.generators = [self.generators[i] for i in keep]


def _pad_cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Concatenate two caches [B, heads, W, d] along the batch, right-padding the narrower one.

    The padding slots lie beyond every row's length, where the ragged layout never attends.
    """
    width = max(a.shape[2], b.shape[2])
    pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[2]))  # noqa: E731
    return torch.cat([pad(a), pad(b)], dim=0)


def merge_target_kv_(into: TargetKV, new: TargetKV) -> None:
    for mine, theirs in zip(into.cache.layers, new.cache.layers):
        mine.keys, mine.values = _pad_cat(mine.keys, theirs.keys), _pad_cat(mine.values, theirs.values)
    into.lengths = torch.cat([into.lengths, new.lengths])


def merge_draft_kv_(into: DraftKV, new: DraftKV) -> None:
    into.k, into.v = _pad_cat(into.k, new.k), _pad_cat(into.v, new.v)
    into.lengths = torch.cat([into.lengths, new.lengths])


# ---- the steps ------------------------------------------------------------------------------------------

def _clock(device) -> float:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def prefill_lane(target, draft, requests: list[GenerationRequest], sampling: SamplingConfig, aux_layer_ids,
                 device) -> Lane:
    """Prompts through the target (and their features into the draft): a new lane with each first token.

    Same order of operations as `eagle_core.generate.generate`'s start, on a fresh batch.
    """
    lane = Lane(sampling)
    prompts = [r.prompt_ids for r in requests]
    if not sampling.greedy:
        seeds = [r.seed if r.seed is not None else random.SystemRandom().randrange(2 ** 63) for r in requests]
        lane.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
    lane.kv = TargetKV(len(prompts), device)
    logits, aux, ids, lengths = prefill(target, lane.kv, prompts, aux_layer_ids)
    lane.root = sample_next(logits, sampling, lane.generators)  # [B]
    if draft is not None:
        lane.dkv = DraftKV(len(prompts), device)
        lane.draft_hidden = draft_prefill(draft, lane.dkv, aux, ids, lengths, lane.root)
    return lane


def plain_step_with_draft(target, lane: Lane, aux_layer_ids) -> tuple[torch.Tensor, float]:
    """A plain decoding step that keeps what the draft will need (so trees can resume later).

    The step's target features and its new token are queued on the lane; `Lane.catch_up_draft_` feeds
    them to the draft in one forward before the next tree/chain round, so a run of plain steps costs
    one draft forward, not one per step. Returns (next tokens [B], target seconds).
    """
    device = lane.root.device
    b = lane.root.shape[0]
    t0 = _clock(device)
    past_width = lane.kv.width
    ones = torch.ones(b, 1, 1, dtype=torch.bool, device=device)
    hidden, aux = target_forward(target, lane.kv, lane.root[:, None], lane.kv.lengths[:, None], ones, aux_layer_ids)
    n_new = torch.ones(b, dtype=torch.long, device=device)
    lane.kv.keep_new_(past_width, torch.zeros(b, 1, dtype=torch.long, device=device), n_new)
    nxt = sample_next(target.get_output_embeddings()(hidden[:, 0]), lane.sampling, lane.generators)
    # Feature of the root's position pairs with the token after it (EAGLE's pairing, as in prefill).
    lane.pending_aux.append(aux)
    lane.pending_tokens.append(nxt[:, None])
    return nxt, _clock(device) - t0


# ---- the engine -------------------------------------------------------------------------------------------

class Engine:
    """Admits requests, decodes every lane round by round on one thread, reports per-request events."""

    def __init__(self, target, tokenizer, draft, config: EngineConfig, metrics=None):
        self.target, self.tokenizer, self.draft, self.config = target, tokenizer, draft, config
        self.metrics = metrics
        self.device = target.get_input_embeddings().weight.device
        self.aux_layer_ids = list(draft.config.aux_layer_ids) if draft is not None else None
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos = {eos} if eos is not None else set()
        self.lanes: dict[tuple, Lane] = {}
        self.chooser = ModeChooser(MODES if draft is not None else ("plain",), config.explore_every) \
            if config.mode_policy == "auto" else None
        self.waiting: deque[GenerationRequest] = deque()
        self.admitting = 0  # taken from `waiting`, being prefilled: still counts against the capacity
        self.cond = threading.Condition()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="spec-decode-engine", daemon=True)
        self.thread.start()

    # -- called from other threads --
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
        """Queue a request, or raise Overloaded at once when the engine is full."""
        with self.cond:
            active = self._active()
            if self.stopped or active + len(self.waiting) >= self.capacity:
                raise Overloaded(f"{active} requests decoding and {len(self.waiting)} waiting")
            self.waiting.append(request)
            self.cond.notify()

    def close(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()
        self.thread.join(timeout=10)

    # -- the engine thread --
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                admitted = self._wait_and_take()
                if admitted is None:
                    return
                self._admit(admitted)
                for key, lane in list(self.lanes.items()):
                    self._guarded(lane.rows, lambda: self._round(lane))
                    lane.drop_finished_()
                    if not lane.rows:
                        with self.cond:
                            del self.lanes[key]

    def _wait_and_take(self) -> list[GenerationRequest] | None:
        with self.cond:
            while not self.stopped and not self.waiting and not self.lanes:
                self.cond.wait()
            if self.stopped:
                return None
            room = self.config.max_batch_size - self._active()
            taken = []
            while self.waiting and len(taken) < room:
                req = self.waiting.popleft()
                if not req.cancelled:
                    taken.append(req)
            self.admitting = len(taken)
            return taken

    def _guarded(self, rows: list[_Row], step: Callable[[], None]) -> None:
        """Run a step; if it fails, fail its rows (the server stays up for everyone else)."""
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - reported to the rows' clients, logged by Serve
            for row in rows:
                if not row.done:
                    row.done = True
                    row.request.on_event(Event("error", text=f"{type(exc).__name__}: {exc}"))
            log.exception("decoding step failed; %d request(s) get an error", len(rows))

    def _admit(self, requests: list[GenerationRequest]) -> None:
        groups: dict[tuple, list[GenerationRequest]] = {}
        for req in requests:
            groups.setdefault(_lane_key(req.sampling), []).append(req)
        for key, group in groups.items():
            rows = [_Row(r, self.eos, self.tokenizer, self.config.tree.depth if self.draft else 0) for r in group]
            self._guarded(rows, lambda: self._prefill_group(key, group, rows))
            with self.cond:
                self.admitting -= len(group)

    def _prefill_group(self, key, group: list[GenerationRequest], rows: list[_Row]) -> None:
        t0 = _clock(self.device)
        lane = prefill_lane(self.target, self.draft, group, group[0].sampling, self.aux_layer_ids, self.device)
        lane.rows = rows
        dt = _clock(self.device) - t0
        for row, token in zip(rows, lane.root.tolist()):
            row.stats.prefill_s = dt
            row.emit([token])
        if self.metrics is not None:
            self.metrics.on_prefill(len(rows), sum(len(r.prompt_ids) for r in group), dt)
        lane.drop_finished_()
        if lane.rows:
            with self.cond:
                running = self.lanes.setdefault(key, Lane(lane.sampling))
            running.merge_(lane, self.draft)

    def _round(self, lane: Lane) -> None:
        lane.drop_finished_()  # cancelled rows leave before we spend compute on them
        if not lane.rows:
            return
        b = len(lane.rows)
        if self.chooser is not None:
            mode = self.chooser.choose(b)
        else:
            mode = choose_mode(b, self.config, self.draft is not None)
        if mode == "plain":
            committed, accept_lengths, draft_s, verify_s = self._plain_round(lane)
        else:
            tree = self.config.tree if mode == "tree" else TreeConfig.chain(self.config.tree.depth)
            t0 = _clock(self.device)
            lane.catch_up_draft_(self.draft)
            catch_up_s = _clock(self.device) - t0
            out = speculative_decode(self.target, self.draft, lane.kv, lane.dkv, lane.root, lane.draft_hidden, tree,
                                     lane.sampling, lane.generators, self.aux_layer_ids)
            lane.root, lane.draft_hidden = out.root, out.draft_hidden
            accept_lengths = out.accept_length.tolist()
            committed = [toks[: n + 1] for toks, n in zip(out.tokens.tolist(), accept_lengths)]
            draft_s, verify_s = out.draft_s + catch_up_s, out.verify_s
        if self.chooser is not None:
            self.chooser.record(b, mode, sum(len(t) for t in committed), draft_s + verify_s)
        for row, tokens, n in zip(lane.rows, committed, accept_lengths or [None] * b):
            row.stats.rounds += 1
            row.stats.draft_s += draft_s
            row.stats.verify_s += verify_s
            row.modes[mode] += 1
            if n is not None:
                row.stats.accept_lengths.append(n)
            row.emit(tokens)
        if self.metrics is not None:
            self.metrics.on_round(mode, b, draft_s, verify_s, accept_lengths or [])

    def _plain_round(self, lane: Lane):
        if self.draft is None:
            t0 = _clock(self.device)
            lane.root = decode_one_token(self.target, lane.kv, lane.root, lane.sampling, lane.generators)
            verify_s, draft_s = _clock(self.device) - t0, 0.0
        else:
            lane.root, verify_s = plain_step_with_draft(self.target, lane, self.aux_layer_ids)
            draft_s = 0.0
        # No draft tokens were proposed: the round has no accept_length (tau counts speculative rounds).
        return [[t] for t in lane.root.tolist()], None, draft_s, verify_s


def _lane_key(sampling: SamplingConfig) -> tuple:
    if sampling.greedy:
        return ("greedy",)
    return (sampling.temperature, sampling.top_p, sampling.top_k)
