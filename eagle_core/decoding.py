"""The decoding state of one batch and the steps that advance it: prefill, then plain, chain or tree rounds.

Read top to bottom (gpt-fast style, each step a small function of explicit tensors): `prefill`
(prompts through the target), `draft_extend` / `draft_prefill` (committed target features into the
draft's cache), `plain_step` (one token), `speculative_decode` (draft a tree -> verify it in one target
forward -> keep the accepted path in both caches). Then `DecodingState`, which owns everything a batch
carries between rounds -- target and draft caches, roots, the draft's hidden state, per-row samplers and
the draft inputs that plain steps deferred -- and offers `prefill`, `step(mode)`, `select_rows_` (finished
rows leave) and `merge_` (new rows join). Every call returns a `Step`: the tokens each row committed and
what it cost, timed by the device's `eagle_core.timing.Timer` (CUDA events on a GPU: no synchronisation inside
a round; the times are read once its tokens are on the host).

Two drivers: `eagle_core.generate.generate` (a fixed batch to the end, one mode) and the serving engine
(continuous batching, a mode chosen per round). Both only schedule; the tensors live here.

Batch > 1: rows advance together, each accepting its own number of tokens (see `eagle_core.kv` for the
ragged cache layout). Every mode is lossless and leaves the caches in the same state, so a batch may
switch between them from one round to the next.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_core.attention import causal_mask
from eagle_core.capture import CommittedFeatures, RowFeatures
from eagle_core.kv import DraftKV, TargetKV, lm_logits, target_forward
from eagle_core.lookup import ContextIndex, context_yield
from eagle_core.packed_linear import decode_kernels
from eagle_core.static_kv import StaticDraftKV, StaticKV
from eagle_core.static_rows import ROW_BUCKETS, WIDTH_BUCKETS, StaticConfig, verify_width
from eagle_core.target import resolve_aux_layer_ids
from eagle_core.tree import (NO_TOKEN, Tree, TreeConfig, chain_accept_length, draft_accept_length, draft_tree,
                             graft_chain)
from eagle_core.timing import Timer, timer_for
from eagle_core.verify import SamplingConfig, accept, accept_on_path, sample_next, seed_tensor, verify_hidden

MODES = ("tree", "chain", "plain")
CONTEXT = "context"  # the tree with its context chain (`TreeConfig.context_chain` > 0)


def available_modes(tree: TreeConfig | None) -> tuple[str, ...]:
    """The modes a batch decoded with `tree` can run: MODES, and "context" where the tree has a context chain."""
    return MODES + (CONTEXT,) if tree is not None and tree.context_chain > 0 else MODES


def context_tensor(proposals: list[list[int]], device) -> torch.Tensor | None:
    """[B, L] of the rows' proposals, NO_TOKEN-padded to the longest; None when no row has one (nothing to
    graft: the round verifies the tree alone and costs what a tree round costs)."""
    width = max(map(len, proposals))
    if not width:
        return None
    return torch.tensor([p + [NO_TOKEN] * (width - len(p)) for p in proposals], device=device)


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
    return lm_logits(target, last), aux, ids, lengths


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
    past_width = dkv.width
    mask = dkv.attention_mask(past_width, causal_mask(steps < n_new[:, None]))
    out, _ = draft(hidden, next_tokens, position_ids, attention_mask=mask, past_kv=dkv)
    dkv.keep_new_(past_width, steps.expand(b, s), n_new)
    return out.gather(1, (n_new - 1)[:, None, None].expand(b, 1, out.shape[-1]))


def draft_prefill(draft, dkv: DraftKV, aux: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor,
                  root: torch.Tensor) -> torch.Tensor:
    """The prompt's target features into the draft's cache; returns the hidden state the first tree grows from.

    Feature at position p pairs with token p+1; the last prompt position pairs with the root (first new token).
    """
    next_tokens = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)  # [B, S]
    next_tokens.scatter_(1, (lengths - 1)[:, None], root[:, None])
    return draft_extend(draft, dkv, aux, next_tokens, lengths)


def plain_step(target, kv: TargetKV, token: torch.Tensor, sampling: SamplingConfig, seeds=None,
               aux_layer_ids: list[int] | None = None):
    """Plain decoding step: token [B] (not yet in the cache) -> (next token [B], its aux [B, 1, 3H] or None).

    The token sits at position kv.lengths; the next one, drawn here, at kv.lengths + 1.
    """
    if isinstance(kv, StaticKV):  # its own step: fixed shapes, compiled where `StaticConfig.compile` says
        return kv.plain_step(token, sampling, seeds, aux_layer_ids)
    b = token.shape[0]
    past_width = kv.width
    positions = kv.lengths + 1
    ones = torch.ones(b, 1, 1, dtype=torch.bool, device=token.device)
    hidden, aux = target_forward(target, kv, token[:, None], kv.lengths[:, None], ones, aux_layer_ids)
    kv.keep_new_(past_width, torch.zeros(b, 1, dtype=torch.long, device=token.device), torch.ones_like(token))
    return sample_next(lm_logits(target, hidden[:, 0]), sampling, seeds, positions), aux


@dataclass
class RoundOutput:
    tokens: torch.Tensor  # [B, W] committed tokens, row b's first accept_length[b] + 1 are valid
    accept_length: torch.Tensor  # [B]
    root: torch.Tensor  # [B] the bonus token: the next round's root
    draft_hidden: torch.Tensor  # [B, 1, H]
    timer: Timer
    marks: tuple  # the timer's marks: start, tree drafted, verified and kept, draft extended
    tree: Tree | None = None  # what was verified, and the accepted path in it (autotune reads both)
    path: torch.Tensor | None = None  # [B, W]

    # Read once the round's tokens are on the host (`eagle_core.timing`).
    @property
    def draft_s(self) -> float:
        t0, t1, t2, t3 = self.marks
        return self.timer.seconds(t0, t1) + self.timer.seconds(t2, t3)

    @property
    def verify_s(self) -> float:
        return self.timer.seconds(self.marks[1], self.marks[2])


def path_width(tree_config: TreeConfig, chain: int = 0) -> int:
    """The width of a round's accepted path (root first) at most: the draft's levels or a grafted chain's, + 1."""
    return max(tree_config.depth, chain) + 1


def speculative_decode(target, draft, kv: TargetKV, dkv: DraftKV, root: torch.Tensor, draft_hidden: torch.Tensor,
                       tree_config: TreeConfig, sampling: SamplingConfig, seeds, aux_layer_ids,
                       context: torch.Tensor | None = None, timer: Timer | None = None) -> RoundOutput:
    """One round: draft a tree from the root (with the context chain `context` [B, L] grafted under it, if
    given: `graft_chain`), verify it in one target forward, keep the accepted path."""
    device = root.device
    timer = timer or timer_for(device)
    t0 = timer.mark()
    if isinstance(dkv, StaticDraftKV):  # the whole loop in one step of fixed shapes
        tree = dkv.draft_tree(draft, draft_hidden, root, tree_config)
    else:
        tree = draft_tree(draft, dkv, draft_hidden, root, tree_config)
    if context is not None:
        tree = graft_chain(tree, context)
    t1 = timer.mark()
    if isinstance(kv, StaticKV):  # forward, acceptance and keep in one step of fixed shapes (the path's width
        # from the config: draft levels, or the grafted chain's; `path_logits` is an eager CPU saving, not taken)
        levels = path_width(tree_config, 0 if context is None else context.shape[1])
        acc, aux = kv.verify(tree, sampling, seeds, aux_layer_ids, min(levels, tree.size))
    else:
        past_width, root_positions = kv.width, kv.lengths
        hidden, aux = verify_hidden(target, kv, tree, aux_layer_ids)  # [B, N, H], [B, N, 3H]
        if tree_config.path_logits:
            acc = accept_on_path(target, tree, hidden, sampling, seeds, root_positions)
        else:
            acc = accept(tree, lm_logits(target, hidden), sampling, seeds, root_positions)
        kv.keep_new_(past_width, acc.path, acc.accept_length + 1)
    t2 = timer.mark()
    # The path's features go to the draft, each paired with the token that follows it on the path
    # (the bonus after the last accepted node): exactly the tokens this round commits.
    path_tokens = tree.tokens.gather(1, acc.path)  # [B, W] root first
    steps = torch.arange(acc.path.shape[1], device=device)[None, :]
    following = torch.cat([path_tokens[:, 1:], acc.bonus[:, None]], dim=1)
    committed = torch.where(steps == acc.accept_length[:, None], acc.bonus[:, None], following)
    aux_path = aux.gather(1, acc.path[:, :, None].expand(-1, -1, aux.shape[-1]))
    draft_hidden = draft_extend(draft, dkv, aux_path, committed, acc.accept_length + 1)
    t3 = timer.mark()
    return RoundOutput(committed, acc.accept_length, acc.bonus, draft_hidden, timer, (t0, t1, t2, t3), tree, acc.path)


# ---- the state ---------------------------------------------------------------------------------------------

@dataclass
class Step:
    """What one call committed per row (prefill: the first token; plain: one; tree/chain: accepted + bonus)."""

    mode: str  # "prefill" or one of MODES
    tokens: list[list[int]]  # per row, in batch order
    accept_lengths: list[int] | None  # draft tokens accepted per row; None when no draft was proposed
    draft_s: float  # draft tree, draft cache extension (and catch-up of deferred plain steps)
    verify_s: float  # target forward(s) with acceptance and cache update; for a prefill the whole prefill
    round: RoundOutput | None = None  # the tensors of a tree/chain round (instrumentation)
    catch_up_s: float = 0.0  # of draft_s: feeding the draft what earlier plain steps deferred
    # Tokens the other modes would have committed on the same rows in this round: plain one per row; a chain
    # of the tree's depth what `chain_accept_length` reads off a tree round. The auto policy compares modes on
    # the same text with them (`ModeChooser.record`).
    also: dict[str, int] | None = None

    @property
    def committed(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def round_seconds(self) -> float:
        """What this round's own mode cost: the catch-up is work the earlier plain steps deferred."""
        return self.draft_s + self.verify_s - self.catch_up_s

    @property
    def seconds(self) -> float:
        return self.draft_s + self.verify_s


class DecodingState:
    """One ragged batch between rounds: caches, roots, draft hidden state, samplers, deferred draft inputs.

    Built by `prefill`; advanced by `step(mode)`; `select_rows_` and `merge_` change which rows it holds.
    Row i of every tensor (and of every returned `Step`) is the same sequence.
    """

    def __init__(self, target, draft, sampling: SamplingConfig, tree: TreeConfig | None, kv: TargetKV,
                 dkv: DraftKV | None, root: torch.Tensor, draft_hidden: torch.Tensor | None,
                 seeds: torch.Tensor | None):
        self.target, self.draft, self.sampling, self.tree = target, draft, sampling, tree
        self.aux_layer_ids = list(draft.config.aux_layer_ids) if draft is not None else None
        self.kv, self.dkv = kv, dkv
        self.root = root  # [B] last committed token, not yet in the target's cache
        self.draft_hidden = draft_hidden  # [B, 1, H] the draft's output paired with the root
        self.seeds = seeds  # [B] int64, the sampling seed of every row; None when greedy
        self.timer = timer_for(root.device)  # marks the rounds' phases (`eagle_core.timing`)
        # Every row's text (prompt + committed tokens) indexed for prompt lookup, where the tree has a context chain.
        self.context: list[ContextIndex] | None = None
        # Plain steps defer the draft's cache update: their target features and tokens wait here
        # ([B, 1, 3H] and [B, 1] per step) until a tree/chain round needs the draft.
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    @classmethod
    def prefill(cls, target, draft, prompts: list[list[int]], sampling: SamplingConfig,
                tree: TreeConfig | None = None, seeds=None,
                static: StaticConfig | None = None,
                capture: bool | list[int] | None = None) -> tuple["DecodingState", Step]:
        """Prompts through the target (and their features into the draft); the Step holds each first token.

        seeds: one per row (ints, or an int64 tensor), for sampling (ignored when greedy). A row's tokens are a
        function of its prompt, the sampling settings and its seed alone: the token at absolute position t uses
        the noise of (seed, t) (`verify.sample_tokens`), whichever mode, draft or batch decodes it.

        static: decode on a `StaticKV` (preallocated buffers written by index, `eagle_core.static_kv`) instead of
        the growing `TargetKV`; the same tokens. Opt-in: raises `UnsupportedTarget` for a family it lacks.

        capture: keep the features of every committed token (`take_features`): True for an extraction's default aux
        layers, or a list of aux layer ids. Off by default (nothing kept, nothing computed); eager cache only.
        """
        device = target.get_input_embeddings().weight.device
        timer = timer_for(device)
        t0 = timer.mark()
        seeds = None if sampling.greedy else seed_tensor(seeds, device)
        features = None
        if capture is not None and capture is not False:
            if static is not None:
                raise ValueError("feature capture runs on the eager cache only (static=None)")
            ids = resolve_aux_layer_ids(None if capture is True else capture, target.config.num_hidden_layers)
            features = CommittedFeatures(ids, len(prompts))
        kv = TargetKV(len(prompts), device, features) if static is None else StaticKV(target, len(prompts), static)
        aux_layer_ids = list(draft.config.aux_layer_ids) if draft is not None else None
        with decode_kernels(target, static is None), decode_kernels(draft, static is None):  # as `step` runs them
            logits, aux, ids, lengths = prefill(target, kv, prompts, aux_layer_ids)
            root = sample_next(logits, sampling, seeds, lengths)  # [B], at positions len(prompt)
            dkv, draft_hidden = None, None
            if draft is not None:
                dkv = DraftKV(len(prompts), device) if static is None else StaticDraftKV(draft, len(prompts), static)
                draft_hidden = draft_prefill(draft, dkv, aux, ids, lengths, root)
        state = cls(target, draft, sampling, tree, kv, dkv, root, draft_hidden, seeds)
        first = root.tolist()
        if draft is not None and tree is not None and tree.context_chain > 0:
            state.context = [ContextIndex(p + [t]) for p, t in zip(prompts, first)]
        return state, Step("prefill", [[t] for t in first], None, 0.0, timer.seconds(t0, timer.mark()))

    @property
    def device(self):
        return self.root.device

    def take_features(self, rows: list[int] | None = None) -> list[RowFeatures | None]:
        """Per row (default: every row; batch order), the features of the committed tokens that went through a
        target forward since the row's last take, in position order: the prompt's after prefill, then each round's
        root and accepted tokens (a bonus token's come with the next round). Needs `prefill(..., capture=...)`."""
        features = getattr(self.kv, "features", None)
        if features is None:
            raise ValueError("this decoding state does not capture features: prefill(..., capture=True)")
        return features.take(rows)

    @property
    def batch_size(self) -> int:
        return self.root.shape[0]

    def step(self, mode: str) -> Step:
        """One round: "plain" (one target token), "tree" (`self.tree`'s draft tree), "context" (that tree with its
        context chain grafted) or "chain" (a chain of its depth). On the eager caches, the target's and the draft's
        linear layers run on packed CPU weights (`eagle_core.packed_linear`) where that is on for their dtype."""
        eager = isinstance(self.kv, TargetKV)
        with decode_kernels(self.target, eager), decode_kernels(self.draft, eager):
            return self._step(mode)

    def _step(self, mode: str) -> Step:
        if mode == "plain":
            return self._record_context(self._plain_step())
        if mode == CONTEXT and self.context is None:
            raise ValueError("mode 'context' needs a tree with context_chain > 0 (TreeConfig.context_chain)")
        tree = self.tree if mode in ("tree", CONTEXT) else TreeConfig.chain(self.tree.depth, self.tree.path_logits)
        chain = self.tree.context_chain if mode == CONTEXT else 0  # the longest chain a context round grafts
        self._room_for(verify_width(tree.size + 1 + chain), len(self.pending) + (tree.depth - 1) * tree.top_k
                       + path_width(tree, chain))
        timer = self.timer
        start = timer.mark()
        caught_up = self.catch_up_draft_()
        caught_up_at = timer.mark()
        # The rows' lookups (host only, charged to the round's draft time up to the round's own first mark):
        # grafted in a context round, and what a tree round's rows would have committed with them (`Step.also`).
        proposals = None
        if self.context is not None and mode in ("tree", CONTEXT):
            proposals = [index.propose(self.tree.context_chain) for index in self.context]
        grafted = context_tensor(proposals, self.device) if mode == CONTEXT else None
        out = speculative_decode(self.target, self.draft, self.kv, self.dkv, self.root, self.draft_hidden, tree,
                                 self.sampling, self.seeds, self.aux_layer_ids, grafted, timer)
        self.root, self.draft_hidden = out.root, out.draft_hidden
        also = {"plain": self.batch_size}
        if mode == "chain":
            accept_lengths = out.accept_length.tolist()
        else:  # the counterfactuals are fetched with the accept lengths: one device transfer per round
            rows = [out.accept_length, chain_accept_length(out.tree, out.path, out.accept_length)]
            if grafted is not None:
                rows.append(draft_accept_length(out.tree, out.path, out.accept_length))
            accept_lengths, chain_lengths, *tree_lengths = torch.stack(rows).tolist()
            also["chain"] = self.batch_size + sum(chain_lengths)
            if mode == CONTEXT:
                also["tree"] = self.batch_size + sum(tree_lengths[0] if tree_lengths else accept_lengths)
        tokens = [t[: n + 1] for t, n in zip(out.tokens.tolist(), accept_lengths)]
        if mode == "tree" and proposals is not None:
            also[CONTEXT] = sum(context_yield(p, t) for p, t in zip(proposals, tokens))
        # the tokens are on the host: every mark of the round has been reached, reading the times waits for nothing
        catch_up_s = timer.seconds(start, caught_up_at) if caught_up else 0.0
        draft_s = timer.seconds(start, out.marks[0]) + out.draft_s  # catch-up and lookup, then the round's own
        step = Step(mode, tokens, accept_lengths, draft_s, out.verify_s, out, catch_up_s, also)
        return self._record_context(step)

    def _record_context(self, step: Step) -> Step:
        """The committed tokens join every row's lookup text."""
        if self.context is not None:
            for index, tokens in zip(self.context, step.tokens):
                index.extend(tokens)
        return step

    def _plain_step(self) -> Step:
        """With a draft, the step's features are kept (deferred) so that trees can resume later."""
        t0 = self.timer.mark()
        self._room_for(1)
        nxt, aux = plain_step(self.target, self.kv, self.root, self.sampling, self.seeds, self.aux_layer_ids)
        if self.draft is not None:
            # Feature of the root's position pairs with the token after it (EAGLE's pairing, as in prefill).
            self.pending.append((aux, nxt[:, None]))
        self.root = nxt
        # No draft tokens were proposed: the step has no accept_length (tau counts speculative rounds).
        tokens = [[t] for t in nxt.tolist()]
        return Step("plain", tokens, None, 0.0, self.timer.seconds(t0, self.timer.mark()))

    def _room_for(self, tokens: int, draft_tokens: int = 0, rows: int | None = None) -> None:
        """Static caches without room for a round's new entries past the committed ones (`tokens` in the target's,
        `draft_tokens` in the draft's), or whose steps would run past the largest bucket (a verify wider than
        `WIDTH_BUCKETS`' widest, more `rows` than `ROW_BUCKETS`' largest: each new shape would compile and capture
        anew), hand their rows to eager ones (`to_eager`, one log line), where decoding goes on with the same tokens."""
        if not isinstance(self.kv, StaticKV):
            return
        rows = self.batch_size if rows is None else rows
        if tokens > WIDTH_BUCKETS[-1]:
            return self._to_eager(f"a verify of {tokens} tokens is wider than the widest compiled step "
                                  f"({WIDTH_BUCKETS[-1]}: static_rows.WIDTH_BUCKETS)")
        if rows > ROW_BUCKETS[-1]:
            return self._to_eager(f"{rows} rows are more than the largest compiled batch ({ROW_BUCKETS[-1]}: "
                                  "static_rows.ROW_BUCKETS)")
        for name, kv, n in (("target", self.kv, tokens), ("draft", self.dkv, draft_tokens)):
            why = None if kv is None else kv.no_room(n)
            if why:
                return self._to_eager(f"the {name}'s cache: {why}")

    def _to_eager(self, reason: str | None) -> None:
        self.kv = self.kv.to_eager(reason)
        if isinstance(self.dkv, StaticDraftKV):
            self.dkv = self.dkv.to_eager()

    def catch_up_draft_(self) -> bool:
        """Extend the draft's cache with every deferred plain step in one forward (same entries as one by one)."""
        if not self.pending:
            return False
        aux = torch.cat([a for a, _ in self.pending], dim=1)  # [B, k, 3H]
        tokens = torch.cat([t for _, t in self.pending], dim=1)  # [B, k]
        n_new = torch.full((aux.shape[0],), aux.shape[1], dtype=torch.long, device=aux.device)
        self.draft_hidden = draft_extend(self.draft, self.dkv, aux, tokens, n_new)
        self.pending = []
        return True

    def select_rows_(self, keep: list[int]) -> None:
        """Keep only batch rows `keep` (non-empty, in order): finished sequences leave the batch."""
        if len(keep) == self.batch_size:
            return
        idx = torch.tensor(keep, device=self.device)
        self.kv.select_rows_(idx)
        self.root = self.root[idx]
        self.pending = [(a[idx], t[idx]) for a, t in self.pending]
        if self.dkv is not None:
            self.dkv.select_rows_(idx)
            self.draft_hidden = self.draft_hidden[idx]
        if self.seeds is not None:
            self.seeds = self.seeds[idx]
        if self.context is not None:
            self.context = [self.context[i] for i in keep]

    def merge_(self, other: "DecodingState") -> None:
        """Append `other`'s rows (same models and sampling, just prefilled) after this batch's rows."""
        if (getattr(self.kv, "features", None) is None) != (getattr(other.kv, "features", None) is None):
            raise ValueError("cannot merge a state that captures features with one that does not")
        self._room_for(0, len(self.pending), self.batch_size + other.batch_size)
        if isinstance(self.kv, StaticKV) and not (self.kv.can_merge(other.kv) and (
                self.dkv is None or self.dkv.can_merge(other.dkv))):
            self._to_eager(f"{other.batch_size} rows joining {self.batch_size} do not fit (StaticConfig.rows, "
                           "capacity)")
        if not isinstance(self.kv, StaticKV) and isinstance(other.kv, StaticKV):
            other._to_eager(None)
        if self.dkv is not None:
            self.catch_up_draft_()  # deferred steps are per-row equal only among the old rows
            other.catch_up_draft_()
            self.dkv.merge_(other.dkv)
            self.draft_hidden = torch.cat([self.draft_hidden, other.draft_hidden])
        self.kv.merge_(other.kv)
        self.root = torch.cat([self.root, other.root])
        if self.seeds is not None:
            self.seeds = torch.cat([self.seeds, other.seeds])
        # both built from the same tree config (one lane's); a batch lacking its rows' texts cannot look up
        self.context = self.context + other.context if self.context is not None and other.context is not None \
            else None
