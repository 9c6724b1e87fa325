"""EAGLE-2 dynamic draft trees.

From the accepted prefix the draft grows a tree of continuations of the root token (the last token the
target produced, not yet in the target's cache):

1. the draft's output at the last accepted position gives the root's children: its `top_k` best tokens;
2. for `depth - 1` further steps the `top_k` frontier nodes with the best cumulative draft log-prob are
   fed to the draft together (one forward, tree mask: each sees the accepted prefix and its own
   ancestors), and each proposes its `top_k` best children, scored by cumulative log-prob;
3. all candidates are reranked by score and the best `total_tokens` are kept.

A child's score is its parent's plus a log-prob <= 0, so it never exceeds its parent's; ordering by score
with a stable sort (parents are created before their children) therefore never keeps a child without its
parent: the kept set is a connected tree. Chain drafting is `top_k=1` (then `total_tokens <= depth`).

Draft positions: the draft's entry at position p pairs the target feature of token p with token p+1, and
predicts token p+2. A node at depth d sits at target position `root + d`; its draft entry is fed the
draft's output hidden state of its parent's entry (EAGLE's own-feature recursion) at position
`root + d - 1`. The tree entries are never added to the draft's cache: they are discarded after the round.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from eagle_core.kv import DraftKV


@dataclass
class TreeConfig:
    # `help` metadata: the command lines built from this dataclass (pipelines.cli.add_dataclass_arguments)
    top_k: int = field(default=8, metadata={"help": "draft tree: candidates kept per node"})
    depth: int = field(default=6, metadata={"help": "draft tree: levels drafted per round"})
    # draft nodes kept (the verified tree has total_tokens + 1 tokens with the root)
    total_tokens: int = field(default=32, metadata={"help": "draft tree: nodes verified per round (plus the root)"})
    # The target's lm_head only along the path being accepted (one row per sequence and level) instead of on
    # every node: cheaper where a multi-row head costs more than tau one-row ones (fp32 on CPUs); the
    # auto-tuner measures both. Same tokens either way.
    path_logits: bool = field(default=False, metadata={
        "help": "target lm_head only along the accepted path (cheaper where multi-row heads cost more)"})
    # The context chain (`eagle_core.lookup`): up to this many tokens of prompt lookup grafted under the root
    # beside the draft's tree in the rounds of mode "context" (`graft_chain`); 0 = off. The auto-tune measures
    # whether it pays and how long it should be; the auto policy then runs it only while it does.
    context_chain: int = field(default=0, metadata={
        "help": "context chain: prompt-lookup tokens verified beside the tree (mode 'context'); 0 = off"})

    def __post_init__(self):
        if self.top_k < 1 or self.depth < 1 or self.total_tokens < 1 or self.context_chain < 0:
            raise ValueError(f"TreeConfig needs positive top_k, depth, total_tokens and context_chain >= 0: {self}")

    @property
    def num_candidates(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k ** 2

    @property
    def size(self) -> int:
        """Draft nodes actually kept: `total_tokens`, capped by the number of candidates."""
        return min(self.total_tokens, self.num_candidates)

    @classmethod
    def chain(cls, length: int, path_logits: bool = False) -> "TreeConfig":
        return cls(top_k=1, depth=length, total_tokens=length, path_logits=path_logits)


@dataclass
class Tree:
    """A batch of trees of equal size N = nodes + 1; index 0 is the root, parents precede children."""

    tokens: torch.Tensor  # [B, N] target-vocab ids
    parents: torch.Tensor  # [B, N] index of the parent (the root is its own parent)
    depth: torch.Tensor  # [B, N] root 0
    ancestors: torch.Tensor  # [B, N, N] bool: ancestors[b, i, j] = j is i or an ancestor of i
    rank: torch.Tensor  # [B, N] 0 for the root, 1.. = place in the draft's score order
    score: torch.Tensor | None = None  # [B, N] cumulative draft log-prob (root 0)
    # A grafted context chain (`graft_chain`): nodes [draft_size, N) are its slots, [0, draft_size) the draft's
    # tree; `context` [B, L] the proposed chain tokens (NO_TOKEN-padded). None / no context: draft nodes only.
    draft_size: int | None = None
    context: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    @property
    def is_draft(self) -> torch.Tensor | None:
        """[N] bool, True for the draft tree's nodes (the root included); None when every node is one."""
        if self.draft_size is None or self.draft_size == self.size:
            return None
        return torch.arange(self.size, device=self.tokens.device) < self.draft_size

    def forward_tokens(self) -> torch.Tensor:
        """The ids the target is fed: a NO_TOKEN slot carries id 0 (its logits are never read)."""
        return self.tokens if self.draft_size is None else self.tokens.clamp(min=0)


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] parent indices -> [B, N, N] ancestor-or-self mask, by pointer doubling.

    Invariant after step t: anc[i] = i and its ancestors at distance < 2^t; up[i] = its 2^t-th ancestor
    (the root once there are fewer). log2(N) + 1 steps cover any depth.
    """
    b, n = parents.shape
    anc = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n).clone()
    up = parents
    for _ in range(max(n - 1, 1).bit_length()):
        anc = anc | anc.gather(1, up[:, :, None].expand(b, n, n))
        up = up.gather(1, up)
    return anc


def chain_accept_length(tree: Tree, path: torch.Tensor, accept_length: torch.Tensor) -> torch.Tensor:
    """[B] draft tokens a chain of the same depth would have accepted in this round.

    A chain is the draft's best child at every level; in the tree that is the child with the lowest rank among
    its siblings (siblings share the parent's score, so rank orders them by their own log-prob). Every mode
    accepts a node iff its token is the target's token at that position (greedy or with the position's
    noise, `verify.accept`), so the accepted path decides: the chain would have accepted the path's leading
    nodes that are each their parent's best child (a lower bound where the chain's next node fell outside the
    tree: the rerank dropped it, or its parent was not on a level's frontier). path: [B, W] accepted nodes,
    root first."""
    b, n = tree.parents.shape
    draft_nodes = tree.is_draft
    best = torch.full((b, n), torch.iinfo(tree.rank.dtype).max, dtype=tree.rank.dtype, device=tree.rank.device)
    best = best.scatter_reduce(1, tree.parents[:, 1:], tree.rank[:, 1:], "amin")  # parent -> its best child's rank
    is_best = tree.rank == best.gather(1, tree.parents)  # [B, N]; the root (rank 0 vs >= 1) is not
    if draft_nodes is not None:  # a chain drafts none of a context chain's slots
        is_best &= draft_nodes
    steps = torch.arange(path.shape[1] - 1, device=path.device)[None, :]
    along = is_best.gather(1, path[:, 1:]) & (steps < accept_length[:, None])
    return along.long().cumprod(dim=1).sum(dim=1)


def draft_accept_length(tree: Tree, path: torch.Tensor, accept_length: torch.Tensor) -> torch.Tensor:
    """[B] draft tokens the draft's tree alone (no context chain) would have accepted in this round: the accepted
    path's leading draft nodes. Exact: where the path leaves the draft's nodes for a chain slot under node u, the
    slot carries the target's token at u, which none of u's draft children carries (`graft_chain` merges those),
    so the tree alone stops at u."""
    draft_nodes = tree.is_draft
    if draft_nodes is None:
        return accept_length
    steps = torch.arange(path.shape[1] - 1, device=path.device)[None, :]
    along = draft_nodes[path[:, 1:]] & (steps < accept_length[:, None])
    return along.long().cumprod(dim=1).sum(dim=1)


def tree_from_parents(tokens: torch.Tensor, parents: torch.Tensor, rank: torch.Tensor | None = None,
                      score: torch.Tensor | None = None) -> Tree:
    """Build a `Tree` from tokens [B, N] and parents [B, N] (parents[:, i] < i for i > 0, parents[:, 0] = 0)."""
    anc = ancestor_matrix(parents)
    depth = anc.sum(-1) - 1
    if rank is None:
        rank = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    return Tree(tokens=tokens, parents=parents, depth=depth, ancestors=anc, rank=rank, score=score)


NO_TOKEN = -1  # a context chain slot left unused: never equal to a target token, so never accepted


def graft_chain(tree: Tree, chain: torch.Tensor) -> Tree:
    """The tree with a context chain grafted under every row's root: L more nodes, the draft's N first.

    chain: [B, L] proposed continuation of the root, NO_TOKEN after a row's proposal ends (all of a row without
    one). The chain is walked down the tree from the root: while the tree already holds the chain's next token
    as a child of the node standing for the chain so far, that node stands for it and the slot stays unused
    (NO_TOKEN, under the root); from the first token the tree lacks on, slot j is a new node carrying chain
    token j under the node standing for token j - 1. So the chain's tokens form one root path at depths 1..L
    (positions root + 1.., as decoding them one by one would give them: the verify forward, sliding windows
    and the sampling noise of each depth hold for them unchanged), siblings still carry distinct tokens, and
    acceptance -- a node is accepted iff its token is the target's (noisy) choice at its parent -- is exactly
    today's: grafting only adds candidates, never changes which token is committed.
    """
    b, n = tree.tokens.shape
    length = chain.shape[1]
    device = tree.tokens.device
    chain = chain.to(device)
    index = torch.arange(n, device=device)[None, :]
    below_root = index > 0  # the root is its own parent: never a child
    cur = torch.zeros(b, dtype=torch.long, device=device)  # the node standing for the chain's tokens so far
    parents, tokens = [], []
    for j in range(length):
        token = chain[:, j]
        child = (tree.parents == cur[:, None]) & (tree.tokens == token[:, None]) & below_root  # [B, N], <= 1 each
        found = child.any(dim=-1)
        grafted = (token != NO_TOKEN) & ~found
        parents.append(torch.where(grafted, cur, 0))
        tokens.append(torch.where(grafted, token, NO_TOKEN))
        cur = torch.where(found, child.long().argmax(dim=-1), torch.where(grafted, n + j, cur))
    rank = tree.rank.max(dim=1, keepdim=True).values + 1 + torch.arange(length, device=device)[None, :]
    score = None if tree.score is None else torch.cat(
        [tree.score, torch.full((b, length), float("-inf"), dtype=tree.score.dtype, device=device)], dim=1)
    grafted = tree_from_parents(torch.cat([tree.tokens, torch.stack(tokens, dim=1)], dim=1),
                                torch.cat([tree.parents, torch.stack(parents, dim=1)], dim=1),  # [B, N+L]
                                torch.cat([tree.rank, rank], dim=1), score)
    return replace(grafted, draft_size=n, context=chain)


def _topk_logprobs(draft, out_hidden: torch.Tensor, k: int):
    # out_hidden: [B, F, H] -> (log-probs [B, F, k] float32, target-vocab ids [B, F, k])
    logp = torch.log_softmax(draft.compute_logits(out_hidden).float(), dim=-1)
    scores, ids = logp.topk(k, dim=-1)
    return scores, draft.draft_to_target(ids)


@torch.no_grad()  # not inference_mode: a cache buffer grown here must stay writable outside it
def draft_tree(draft, dkv: DraftKV, root_hidden: torch.Tensor, root: torch.Tensor, config: TreeConfig) -> Tree:
    """Grow the EAGLE-2 tree for every row.

    root_hidden: [B, 1, H] the draft's output at the last accepted position (paired with the root token);
    root: [B] the root tokens. The draft cache `dkv` holds the accepted prefix; the levels append their entries
    after it and they are dropped at the end, so its committed entries come back unchanged.
    """
    past_width = dkv.width
    try:
        return _grow(draft, dkv, root_hidden, root, config, past_width)
    finally:
        dkv.truncate_(past_width)


def _grow(draft, dkv: DraftKV, root_hidden: torch.Tensor, root: torch.Tensor, config: TreeConfig,
          past_width: int) -> Tree:
    k = config.top_k
    b = root.shape[0]
    device = root.device
    if draft.config.parallel_drafting:  # P-EAGLE: every depth's choices from one forward, whatever the parent
        depth_scores, depth_tokens = _topk_logprobs(draft, parallel_depths(draft, dkv, root_hidden, config.depth,
                                                                           past_width), k)  # [B, depth, k]
        scores, tokens = depth_scores[:, :1], depth_tokens[:, :1]
    else:
        scores, tokens = _topk_logprobs(draft, root_hidden, k)  # [B, 1, k]
    # Candidates, in creation order (a parent always precedes its children). Parent id 0 = root,
    # candidate c has id c + 1.
    cand_scores, cand_tokens = [scores[:, 0]], [tokens[:, 0]]
    cand_parents = [torch.zeros(b, k, dtype=torch.long, device=device)]
    n_cand = k

    front_scores, front_tokens = scores[:, 0], tokens[:, 0]  # [B, k]
    front_ids = torch.arange(1, k + 1, device=device).expand(b, k)  # candidate ids of the frontier
    front_hidden = root_hidden.expand(b, k, root_hidden.shape[-1])  # what each frontier entry is fed
    front_anc = torch.zeros(b, k, 0, dtype=torch.bool, device=device)  # ancestors among tree entries
    eye = torch.eye(k, dtype=torch.bool, device=device).expand(b, k, k)
    for level in range(1, config.depth):
        # front_*: [B, k]; this level's entries sit at draft position root - 1 + level, in cache slots after
        # the committed ones and the earlier levels' entries.
        if draft.config.parallel_drafting:
            child_scores, child_tokens = (x[:, level:level + 1].expand(b, k, k) for x in (depth_scores, depth_tokens))
        else:
            position_ids = (dkv.lengths[:, None] + (level - 1)).expand(b, k)
            new_mask = torch.cat([front_anc, eye], dim=-1)  # [B, k, E+k] over tree entries so far + new
            mask = dkv.attention_mask(past_width, new_mask)  # [B, 1, k, P+E+k] (or the static cache's slots)
            out, _ = draft(front_hidden, front_tokens, position_ids, attention_mask=mask, past_kv=dkv)
            child_scores, child_tokens = _topk_logprobs(draft, out, k)  # [B, k, k]
        child_scores = (front_scores[:, :, None] + child_scores).reshape(b, k * k)
        child_tokens = child_tokens.reshape(b, k * k)
        cand_scores.append(child_scores)
        cand_tokens.append(child_tokens)
        cand_parents.append(front_ids[:, :, None].expand(b, k, k).reshape(b, k * k))
        child_ids = n_cand + 1 + torch.arange(k * k, device=device).expand(b, k * k)
        n_cand += k * k
        if level == config.depth - 1:
            break
        # The next frontier: the k best children; each is fed its parent entry's output hidden state.
        front_scores, pick = child_scores.topk(k, dim=-1)  # [B, k]
        slot = pick // k  # which entry of this level is the parent
        front_tokens = child_tokens.gather(1, pick)
        front_ids = child_ids.gather(1, pick)
        if draft.config.parallel_drafting:
            continue  # no entry of this level is fed to the draft
        front_hidden = out.gather(1, slot[:, :, None].expand(b, k, out.shape[-1]))
        parent_anc = front_anc.gather(1, slot[:, :, None].expand(b, k, front_anc.shape[-1]))
        front_anc = torch.cat([parent_anc, torch.nn.functional.one_hot(slot, k).bool()], dim=-1)

    return _rerank(root, torch.cat(cand_scores, 1), torch.cat(cand_tokens, 1), torch.cat(cand_parents, 1),
                   config.size)


def parallel_depths(draft, dkv: DraftKV, root_hidden: torch.Tensor, depth: int, past_width: int) -> torch.Tensor:
    """P-EAGLE: the hidden states [B, depth, H] whose heads give depths 1..depth of a round: the root's, then those
    of depth - 1 mask slots (`Eagle3Draft.mask_inputs`) at the next positions, drafted in one forward that attends
    to the committed prefix and causally among themselves (TTT's step k at column t, `eagle_core.ttt`)."""
    if depth == 1:
        return root_hidden
    b, n = root_hidden.shape[0], depth - 1
    hidden, ids = draft.mask_inputs(b, n)
    position_ids = dkv.lengths[:, None] + torch.arange(n, device=root_hidden.device)
    causal = torch.ones(n, n, dtype=torch.bool, device=root_hidden.device).tril().expand(b, n, n)
    out, _ = draft(hidden.to(root_hidden.dtype), ids, position_ids, attention_mask=dkv.attention_mask(past_width, causal),
                   past_kv=dkv)
    return torch.cat([root_hidden, out], dim=1)


def _rerank(root, scores, tokens, parents, size: int) -> Tree:
    """Keep the `size` best candidates (stable order: ties keep parents first) and flatten them.

    scores, tokens, parents: [B, M] over candidates in creation order (parents: candidate id, 0 = root).
    """
    b, m = scores.shape
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices  # [B, M]
    kept = order[:, :size].sort(dim=-1).values  # creation order = parents first; [B, T]
    # rank of each candidate in score order (1-based) and its index in the flattened tree (0 = root).
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(1, m + 1, device=order.device).expand(b, m))
    tree_index = torch.zeros(b, m + 1, dtype=torch.long, device=order.device)
    tree_index.scatter_(1, kept + 1, torch.arange(1, size + 1, device=order.device).expand(b, size))
    node_parents = tree_index.gather(1, parents.gather(1, kept))  # [B, T]
    zeros = torch.zeros(b, 1, dtype=torch.long, device=order.device)
    return tree_from_parents(
        tokens=torch.cat([root[:, None], tokens.gather(1, kept)], dim=1),
        parents=torch.cat([zeros, node_parents], dim=1),
        rank=torch.cat([zeros, rank.gather(1, kept)], dim=1),
        score=torch.cat([torch.zeros_like(scores[:, :1]), scores.gather(1, kept)], dim=1),
    )
