"""Speculative generation with an EAGLE-3 draft and EAGLE-2 dynamic trees, plus the plain decoding loop.

Read top to bottom: `prefill` (prompt through the target, first token), `draft_extend` (accepted target
features into the draft's cache), `decode_one_token` (plain loop step), `speculative_decode` (one round:
draft tree -> tree verification -> accepted path into both caches), `generate` (the loop, batch > 1,
stopping, stats). Both loops share the same caches and target forward, so the plain loop is the honest
baseline and the reference of the lossless tests.

Batch > 1: rows advance together, each accepting its own number of tokens (see `eagle_core.kv` for the
ragged cache layout); finished rows leave the batch. Chain drafting is `TreeConfig.chain(n)`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from eagle_core.kv import DraftKV, TargetKV, attention_allowed, causal_mask, target_forward
from eagle_core.tree import Tree, TreeConfig, draft_tree
from eagle_core.verify import SamplingConfig, accept, sample_next, verify_tree


@dataclass
class RequestStats:
    """Per-request decoding metrics.

    rounds: target forwards after the prefill (verification rounds; decode steps for the plain loop).
    accept_lengths: per round, draft tokens the target accepted (0..depth), before any truncation by
        max_new_tokens / eos. The bonus token is not included.
    tau (mean accept length): tokens committed per target forward, bonus counted = mean(accept_length) + 1.
        The plain loop has tau = 1 by definition.
    acceptance_rate: accepted draft tokens / (rounds * depth): the fraction of the longest possible path.
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


def _clock(device) -> float:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# ---- the steps ---------------------------------------------------------------------------------------------

def prefill(target, kv: TargetKV, prompts: list[list[int]], aux_layer_ids: list[int] | None):
    """All prompts through the target in one right-padded forward.

    Returns (last logits [B, V], aux [B, L, 3H] or None, padded ids [B, L], lengths [B]).
    """
    device = kv.lengths.device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    width = int(lengths.max())
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for row, p in enumerate(prompts):
        ids[row, : len(p)] = torch.tensor(p, device=device)
    valid = torch.arange(width, device=device)[None, :] < lengths[:, None]  # [B, L]
    position_ids = torch.arange(width, device=device).expand_as(ids)
    hidden, aux = target_forward(target, kv, ids, position_ids, causal_mask(valid), aux_layer_ids)
    kv.keep_new_(0, torch.arange(width, device=device).expand_as(ids), lengths)
    last = hidden.gather(1, (lengths - 1)[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]  # [B, H]
    return target.get_output_embeddings()(last), aux, ids, lengths


def draft_extend(draft, dkv: DraftKV, aux: torch.Tensor, next_tokens: torch.Tensor, n_new: torch.Tensor):
    """Append committed target features to the draft's cache (EAGLE's first draft step, through `fc`).

    aux: [B, S, 3H] target features of the newly committed positions; next_tokens: [B, S] the token after
    each of them; row b uses its first n_new[b]. Returns the draft's output hidden state at each row's
    last new position, [B, 1, H]: it predicts the token after the root and seeds the next tree.
    """
    b, s, _ = aux.shape
    steps = torch.arange(s, device=aux.device)[None, :]
    hidden = draft.fuse(aux)  # [B, S, H]
    position_ids = dkv.lengths[:, None] + steps
    mask = attention_allowed(dkv.lengths, dkv.width, causal_mask(steps < n_new[:, None]))
    out, new_kv = draft(hidden, next_tokens, position_ids, attention_mask=mask, past_kv=dkv.past())
    dkv.append_and_keep_(new_kv, steps.expand(b, s), n_new)
    return out.gather(1, (n_new - 1)[:, None, None].expand(b, 1, out.shape[-1]))


def draft_prefill(draft, dkv: DraftKV, aux: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor,
                  root: torch.Tensor) -> torch.Tensor:
    """The prompt's target features into the draft's cache; returns the hidden state the first tree grows from.

    Feature at position p pairs with token p+1; the last prompt position pairs with the root (first new token).
    """
    next_tokens = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)  # [B, S]
    next_tokens.scatter_(1, (lengths - 1)[:, None], root[:, None])
    return draft_extend(draft, dkv, aux, next_tokens, lengths)


def decode_one_token(target, kv: TargetKV, token: torch.Tensor, sampling: SamplingConfig, generators):
    """Plain decoding step: token [B] (not yet in the cache) -> next token [B]."""
    b = token.shape[0]
    past_width = kv.width
    ones = torch.ones(b, 1, 1, dtype=torch.bool, device=token.device)
    hidden, _ = target_forward(target, kv, token[:, None], kv.lengths[:, None], ones)
    kv.keep_new_(past_width, torch.zeros(b, 1, dtype=torch.long, device=token.device), torch.ones_like(token))
    return sample_next(target.get_output_embeddings()(hidden[:, 0]), sampling, generators)


@dataclass
class RoundOutput:
    tokens: torch.Tensor  # [B, W] committed tokens, row b's first accept_length[b] + 1 are valid
    accept_length: torch.Tensor  # [B]
    root: torch.Tensor  # [B] the bonus token: the next round's root
    draft_hidden: torch.Tensor  # [B, 1, H]
    draft_s: float
    verify_s: float
    tree: Tree | None = None  # what was verified, and the accepted path in it (autotune reads both)
    path: torch.Tensor | None = None  # [B, W]


def speculative_decode(target, draft, kv: TargetKV, dkv: DraftKV, root: torch.Tensor, draft_hidden: torch.Tensor,
                       tree_config: TreeConfig, sampling: SamplingConfig, generators, aux_layer_ids) -> RoundOutput:
    """One round: draft a tree from the root, verify it in one target forward, keep the accepted path."""
    device = root.device
    t0 = _clock(device)
    tree = draft_tree(draft, dkv, draft_hidden, root, tree_config)
    t1 = _clock(device)
    past_width = kv.width
    logits, aux = verify_tree(target, kv, tree, aux_layer_ids)  # [B, N, V], [B, N, 3H]
    acc = accept(tree, logits, sampling, generators)
    kv.keep_new_(past_width, acc.path, acc.accept_length + 1)
    t2 = _clock(device)
    # The path's features go to the draft, each paired with the token that follows it on the path
    # (the bonus after the last accepted node): exactly the tokens this round commits.
    path_tokens = tree.tokens.gather(1, acc.path)  # [B, W] root first
    steps = torch.arange(acc.path.shape[1], device=device)[None, :]
    following = torch.cat([path_tokens[:, 1:], acc.bonus[:, None]], dim=1)
    committed = torch.where(steps == acc.accept_length[:, None], acc.bonus[:, None], following)
    aux_path = aux.gather(1, acc.path[:, :, None].expand(-1, -1, aux.shape[-1]))
    draft_hidden = draft_extend(draft, dkv, aux_path, committed, acc.accept_length + 1)
    t3 = _clock(device)
    return RoundOutput(committed, acc.accept_length, acc.bonus, draft_hidden, (t1 - t0) + (t3 - t2), t2 - t1,
                       tree, acc.path)


# ---- the loop ----------------------------------------------------------------------------------------------

class _Request:
    """Python-side bookkeeping of one request: its tokens, stop conditions and stats."""

    def __init__(self, prompt_len: int, max_new_tokens: int, eos: set[int], stop: tuple[str, ...], tokenizer,
                 depth: int):
        self.tokens: list[int] = []
        self.max_new_tokens, self.eos, self.stop, self.tokenizer = max_new_tokens, eos, stop, tokenizer
        self.stats = RequestStats(prompt_tokens=prompt_len, depth=depth)

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
             on_round=None) -> GenerationResult:
    """Generate for a batch of prompts (token id lists of any lengths).

    draft=None runs the plain decoding loop; otherwise speculative decoding with `tree` (default
    TreeConfig()). temperature 0 is greedy; otherwise every request samples with its own generator seeded
    `seed + i`, so a request's sample does not depend on what it is batched with. eos_token_id: an id or
    a list of ids that end a request (included in its tokens); stop: strings that end it (needs tokenizer).
    on_round(round_output, request_indices): called after every speculative round (instrumentation).
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    device = target.get_input_embeddings().weight.device
    sampling = SamplingConfig(temperature, top_p, top_k)
    tree = tree or TreeConfig()
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    b = len(input_ids)
    requests = [_Request(len(p), max_new_tokens, eos, tuple(stop), tokenizer, tree.depth if draft else 0)
                for p in input_ids]
    generators = None
    if not sampling.greedy:
        generators = [torch.Generator(device=device).manual_seed(seed + i) for i in range(b)]
    aux_layer_ids = list(draft.config.aux_layer_ids) if draft is not None else None

    t_start = _clock(device)
    kv = TargetKV(b, device)
    logits, aux, ids, lengths = prefill(target, kv, input_ids, aux_layer_ids)
    root = sample_next(logits, sampling, generators)  # [B]
    dkv, draft_hidden = None, None
    if draft is not None:
        dkv = DraftKV(b, device)
        draft_hidden = draft_prefill(draft, dkv, aux, ids, lengths, root)
    t_prefill = _clock(device) - t_start
    for r in requests:
        r.stats.prefill_s = t_prefill

    active = list(range(b))  # batch row -> request index
    finished = [requests[i].emit([t]) for i, t in zip(active, root.tolist())]
    while True:
        keep = [row for row, done in enumerate(finished) if not done]
        if len(keep) < len(active):
            if not keep:
                break
            rows = torch.tensor(keep, device=device)
            kv.select_rows_(rows)
            root = root[rows]
            if dkv is not None:
                dkv.select_rows_(rows)
                draft_hidden = draft_hidden[rows]
            if generators is not None:
                generators = [generators[row] for row in keep]
            active = [active[row] for row in keep]
        if draft is None:
            t0 = _clock(device)
            root = decode_one_token(target, kv, root, sampling, generators)
            dt = _clock(device) - t0
            new_tokens = root.tolist()
            finished = []
            for i, t in zip(active, new_tokens):
                req = requests[i]
                req.stats.rounds += 1
                req.stats.verify_s += dt
                finished.append(req.emit([t]))
        else:
            out = speculative_decode(target, draft, kv, dkv, root, draft_hidden, tree, sampling, generators,
                                     aux_layer_ids)
            root, draft_hidden = out.root, out.draft_hidden
            if on_round is not None:
                on_round(out, list(active))
            finished = []
            for i, toks, n in zip(active, out.tokens.tolist(), out.accept_length.tolist()):
                req = requests[i]
                req.stats.rounds += 1
                req.stats.accept_lengths.append(n)
                req.stats.draft_s += out.draft_s
                req.stats.verify_s += out.verify_s
                finished.append(req.emit(toks[: n + 1]))
        for i, done in zip(active, finished):
            if done:
                requests[i].stats.total_s = _clock(device) - t_start
    for r in requests:
        r.stats.new_tokens = len(r.tokens)
    texts = [tokenizer.decode(r.tokens) for r in requests] if tokenizer is not None else None
    return GenerationResult(tokens=[r.tokens for r in requests], stats=[r.stats for r in requests], texts=texts)


class Generator:
    """Target (+ optional draft) bundled with a tokenizer: prompts may be text or chat messages."""

    def __init__(self, target, tokenizer=None, draft=None, tree: TreeConfig | None = None):
        self.target, self.tokenizer, self.draft = target, tokenizer, draft
        self.tree = tree or TreeConfig()

    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if prompt and isinstance(prompt[0], dict):
            from eagle_core.chat import prompt_ids
            return prompt_ids(self.tokenizer, prompt)
        return list(prompt)

    def generate(self, prompts=None, input_ids=None, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int = 0, stop: tuple[str, ...] = (),
                 eos_token_id=None, use_draft: bool = True) -> GenerationResult:
        if input_ids is None:
            input_ids = [self.encode(p) for p in prompts]
        if eos_token_id is None and self.tokenizer is not None:
            eos_token_id = self.tokenizer.eos_token_id
        return generate(self.target, input_ids, draft=self.draft if use_draft else None, tree=self.tree,
                        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                        seed=seed, eos_token_id=eos_token_id, stop=stop, tokenizer=self.tokenizer)
