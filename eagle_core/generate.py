"""Generation for a fixed batch of prompts: speculative (EAGLE-3 draft, EAGLE-2 trees) or the plain loop.

The request side of decoding: `RequestStats` (per-request metrics), `Request` (a request's tokens, stop
conditions and stats, updated from each `eagle_core.decoding.Step`), and `generate`, which drives one
`DecodingState` to the end: prefill, then rounds (one mode, or the auto policy), finished rows leaving.
The serving engine drives the same state and the same `Request` bookkeeping with continuous batching.

Speculative and plain decoding share the same caches and target forward, so the plain loop is the honest
baseline and the reference of the lossless tests. Chain drafting is `TreeConfig.chain(n)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eagle_core.decoding import DecodingState, Step, available_modes
from eagle_core.policy import ModeChooser
from eagle_core.static_rows import StaticConfig
from eagle_core.timing import timer_for
from eagle_core.tree import TreeConfig
from eagle_core.verify import SamplingConfig


@dataclass
class RequestStats:
    """Per-request decoding metrics.

    rounds: target forwards after the prefill (verification rounds; decode steps for the plain loop).
    accept_lengths: per round, draft tokens the target accepted (0..depth), before any truncation by
        max_new_tokens / eos. The bonus token is not included.
    tau (mean accept length): tokens committed per target forward, bonus counted = mean(accept_length) + 1.
        The plain loop has tau = 1 by definition.
    acceptance_rate: accepted draft tokens / (rounds * depth): the fraction of the longest possible path.
    modes: rounds per decoding mode ("tree", "context", "chain", "plain").
    draft_s / verify_s: wall time in the draft (tree + cache extension) and in the target's tree forward
        with acceptance and cache update; prefill_s: the prompt forward (target and draft).
    """

    prompt_tokens: int
    new_tokens: int = 0
    rounds: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    depth: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = ""
    modes: dict[str, int] = field(default_factory=dict)  # rounds per decoding mode (tree / chain / plain)

    @property
    def tau(self) -> float:
        if not self.accept_lengths:
            return 1.0
        return 1.0 + sum(self.accept_lengths) / len(self.accept_lengths)

    @property
    def acceptance_rate(self) -> float:
        if not self.accept_lengths or not self.depth:
            return 0.0
        return sum(self.accept_lengths) / (len(self.accept_lengths) * self.depth)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(tau=self.tau, acceptance_rate=self.acceptance_rate, tokens_per_s=self.tokens_per_s)
        return d


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per request (eos included when it ended the request)
    stats: list[RequestStats]
    texts: list[str] | None = None


class Request:
    """Python-side bookkeeping of one request: its tokens, stop conditions and stats."""

    def __init__(self, prompt_len: int, max_new_tokens: int, eos: set[int], stop: tuple[str, ...] = (),
                 tokenizer=None, depth: int = 0):
        self.tokens: list[int] = []
        self.max_new_tokens, self.eos, self.stop, self.tokenizer = max_new_tokens, eos, stop, tokenizer
        self.stats = RequestStats(prompt_tokens=prompt_len, depth=depth)

    def record(self, step: Step, row: int) -> bool:
        """Account for batch row `row` of a step and emit its tokens; return True when the request is finished."""
        if step.mode == "prefill":
            self.stats.prefill_s = step.seconds
        else:
            self.stats.rounds += 1
            self.stats.modes[step.mode] = self.stats.modes.get(step.mode, 0) + 1
            self.stats.draft_s += step.draft_s
            self.stats.verify_s += step.verify_s
            if step.accept_lengths is not None:
                self.stats.accept_lengths.append(step.accept_lengths[row])
        return self.emit(step.tokens[row])

    def emit(self, tokens: list[int]) -> bool:
        """Append committed tokens until a stop condition; return True when the request is finished."""
        for t in tokens:
            self.tokens.append(t)
            if t in self.eos:
                self.stats.finish_reason = "eos"
                return True
            if len(self.tokens) >= self.max_new_tokens:
                self.stats.finish_reason = "length"
                return True
        if self.stop and self.tokenizer is not None:
            tail = self.tokenizer.decode(self.tokens[-(len(tokens) + 16):])
            if any(s in tail for s in self.stop):
                self.stats.finish_reason = "stop"
                return True
        return False


@torch.inference_mode()
def generate(target, input_ids: list[list[int]], *, draft=None, tree: TreeConfig | None = None,
             max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             seed: int = 0, eos_token_id=None, stop: tuple[str, ...] = (), tokenizer=None,
             mode: str = "auto", chooser: ModeChooser | None = None, on_round=None,
             static: StaticConfig | None = None) -> GenerationResult:
    """Generate for a batch of prompts (token id lists of any lengths).

    draft=None runs the plain decoding loop; otherwise speculative decoding with `tree` (default
    TreeConfig()) in `mode`: "tree", "context" (the tree with a context chain of `tree.context_chain` prompt-lookup
    tokens grafted beside it, `eagle_core.lookup`), "chain" (a chain of the tree's depth), "plain", or "auto" (the
    default): each round the mode with the best measured tokens/s at the current batch size
    (`eagle_core.policy.ModeChooser`, plain included, "context" where the tree has a context chain), so a draft
    or a context chain that does not pay falls back;
    pass the same `chooser` to successive calls so that what one call measured serves the next.
    temperature 0 is greedy; otherwise request i samples with seed `seed + i`, and its tokens are a
    function of (prompt, sampling settings, seed) alone: the same with or without a draft, in any mode,
    with any tree, and whatever it is batched with. eos_token_id: an id or a list of ids that end a
    request (included in its tokens); stop: strings that end it (needs tokenizer).
    on_round(round_output, request_indices): called after every speculative round (instrumentation).
    static: decode on the static cache (`eagle_core.static_kv`; opt-in, the same tokens), eagerly past its room.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    device = target.get_input_embeddings().weight.device
    tree = tree or TreeConfig()
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    requests = [Request(len(p), max_new_tokens, eos, tuple(stop), tokenizer, tree.depth if draft else 0)
                for p in input_ids]
    modes = available_modes(tree)
    if mode not in ("auto", *modes):
        raise ValueError(f"mode must be 'auto' or one of {modes} (with {tree}), got {mode!r}")
    if draft is None:
        mode = "plain"
    chooser = (chooser or ModeChooser(modes)) if mode == "auto" else None

    timer = timer_for(device)  # CUDA events on a GPU: the loop never waits for the device to time itself
    t_start = timer.mark()
    state, step = DecodingState.prefill(target, draft, input_ids, SamplingConfig(temperature, top_p, top_k),
                                        tree, seeds=[seed + i for i in range(len(input_ids))], static=static)
    active = list(range(len(input_ids)))  # batch row -> request index
    while True:
        if on_round is not None and step.round is not None:
            on_round(step.round, list(active))
        finished = [requests[i].record(step, row) for row, i in enumerate(active)]
        for i, done in zip(active, finished):
            if done:
                requests[i].stats.total_s = timer.seconds(t_start, timer.mark())  # after the round's tokens came back
        keep = [row for row, done in enumerate(finished) if not done]
        if not keep:
            break
        state.select_rows_(keep)
        active = [active[row] for row in keep]
        if chooser is None:
            step = state.step(mode)
        else:
            rows = state.batch_size
            step = state.step(chooser.choose(rows))
            chooser.record(rows, step.mode, step.committed, step.round_seconds, step.also)
    for r in requests:
        r.stats.new_tokens = len(r.tokens)
    texts = [tokenizer.decode(r.tokens) for r in requests] if tokenizer is not None else None
    return GenerationResult(tokens=[r.tokens for r in requests], stats=[r.stats for r in requests], texts=texts)
