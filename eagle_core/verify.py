"""Tree verification: one target forward over the whole draft tree, then the accepted path.

The flattened tree goes through the target on top of its KV cache with an ancestor-only mask and
depth-based positions (`root + depth`), so every node is scored exactly as if its root-to-node path had
been decoded alone. From the target's next-token distributions at every node we pick a path and one extra
token (the bonus: the target's own next token after the last accepted node).

Greedy acceptance: follow the children whose token equals the target's argmax at their parent for as long
as one exists; the bonus is the argmax at the last accepted node. Output = plain greedy decoding.

Sampling acceptance: see `accept_sampling` for the rule and the proof that it is lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_core.kv import TargetKV, target_forward
from eagle_core.tree import Tree


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def target_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The distribution plain sampling draws from: temperature, then top-k, then top-p (as transformers).

    logits: [..., V] -> probs [..., V] float32. Speculative and plain decoding both go through here, so
    "lossless" means: the same distribution as this function's.
    """
    logits = logits.float() / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= 1.0 - sampling.top_p  # the low tail whose mass stays under 1 - top_p
        drop_sorted[..., -1] = False  # always keep the most likely token
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logits.softmax(dim=-1)


def sample_next(logits: torch.Tensor, sampling: SamplingConfig, generators=None) -> torch.Tensor:
    """One token per row from logits [B, V] (argmax when greedy; one torch.Generator per row otherwise)."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    probs = target_probs(logits, sampling)
    return torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(generators)])


@torch.inference_mode()
def verify_tree(target, kv: TargetKV, tree: Tree, aux_layer_ids: list[int] | None):
    """Target forward over the flattened tree. Returns (logits [B, N, V], aux [B, N, 3H] or None).

    The N entries are appended to `kv` at slots [P, P+N); `kv.keep_new_` must follow with the path.
    """
    position_ids = kv.lengths[:, None] + tree.depth  # [B, N]
    hidden, aux = target_forward(target, kv, tree.tokens, position_ids, tree.ancestors, aux_layer_ids)
    return target.get_output_embeddings()(hidden), aux


@dataclass
class Acceptance:
    path: torch.Tensor  # [B, D+1] tree indices root-first; entries beyond accept_length repeat the last
    accept_length: torch.Tensor  # [B] draft tokens accepted (the path minus the root)
    bonus: torch.Tensor  # [B] the target's token after the path (the next round's root)


def accept_greedy(tree: Tree, logits: torch.Tensor) -> Acceptance:
    """Longest path whose every token is the target's argmax at its parent, plus the argmax after it."""
    best = logits.argmax(dim=-1)  # [B, N]
    match = tree.tokens == best.gather(1, tree.parents)  # [B, N]: node agrees with the target at its parent
    match[:, 0] = True
    on_path = ~(tree.ancestors & ~match[:, None, :]).any(dim=-1)  # node and all its ancestors agree
    # Siblings carry distinct tokens, so the agreeing nodes form one chain from the root: take its end.
    last = torch.where(on_path, tree.depth, -1).argmax(dim=-1)  # [B]
    return _acceptance(tree, last, best.gather(1, last[:, None])[:, 0])


def residual_distribution(probs: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """p with the rejected siblings' tokens removed, renormalised: what is left to sample from."""
    residual = probs.clone()
    residual[rejected] = 0.0
    total = residual.sum()
    return residual / total if total > 0 else probs


def accept_sampling(tree: Tree, logits: torch.Tensor, sampling: SamplingConfig, generators) -> Acceptance:
    """Recursive rejection sampling over siblings, lossless for a deterministic draft tree.

    Rule, at the current node u (start: the root) with target distribution p = p(. | prefix, path to u)
    and children tokens t_1..t_m (distinct; chosen by the draft's top-k, i.e. a function of the context):
    try the children in turn; child t_i is accepted with probability

        a_i = p(t_i) / (1 - p(t_1) - ... - p(t_{i-1}))        (the residual mass still unclaimed)

    which is min(1, r_i(t_i) / q_i(t_i)) of recursive rejection with point-mass proposals q_i = delta(t_i)
    and residuals r_i = norm(max(r_{i-1} - q_{i-1}, 0)), i.e. p with t_1..t_{i-1} removed. On acceptance
    move to that child and repeat; if all m are rejected, emit a token drawn from p with t_1..t_m removed
    (the residual) and stop; at a leaf the same residual is p itself (the bonus token).

    Proof that the emitted token x at u is distributed as p: P(x = t_i) = prod_{j<i}(1 - a_j) * a_i.
    Since 1 - a_j = (1 - s_j) / (1 - s_{j-1}) with s_j = p(t_1) + ... + p(t_j), the product telescopes to
    (1 - s_{i-1}), so P(x = t_i) = p(t_i). For x outside the children, P(x) = (1 - s_m) * p(x) / (1 - s_m)
    = p(x). The children and the draft's whole tree depend only on the context (never on the target's
    random draws), so conditioning on the path so far, the next token is again distributed exactly as the
    target's p(. | context); by induction over the path every emitted sequence has the target's law.

    The reference implementation's shortcut (q = 1 for a top-k child, disputed in its issue tracker,
    e.g. #329) is exactly this point-mass proposal, and it is lossless *provided* the children are a
    function of the context and every rejected sibling is removed before the next try and before the
    correction draw. Plugging the draft's probabilities in as q would not be lossless: min(1, p/q) assumes
    the candidate was *sampled* from q, which top-k selection is not. The acceptance here is also the
    best any lossless rule can do for a fixed tree: it emits a child exactly when a p-distributed token
    falls among the children, P = s_m.
    """
    probs = target_probs(logits, sampling)  # [B, N, V]
    b, n = tree.tokens.shape
    # p(t_i) for every node i under its parent's distribution: [B, N]
    vocab = probs.shape[-1]
    p_node = probs.reshape(b, n * vocab).gather(1, tree.parents * vocab + tree.tokens).cpu().tolist()
    parents = tree.parents.cpu().tolist()
    last = torch.empty(b, dtype=torch.long)
    bonus = torch.empty(b, dtype=torch.long)
    for row in range(b):
        children = [[] for _ in range(n)]
        for i in range(1, n):
            children[parents[row][i]].append(i)
        u = torch.rand(n, generator=generators[row], device=generators[row].device).tolist()
        node, draw = 0, 0
        while True:
            accepted, unclaimed = None, 1.0
            for child in children[node]:
                p = p_node[row][child]
                # a_i = p(t_i) / unclaimed, clipped against rounding when the children hold all the mass.
                if u[draw] * unclaimed < p or unclaimed <= 0.0:
                    accepted = child
                    draw += 1
                    break
                draw += 1
                unclaimed -= p
            if accepted is None:
                break
            node = accepted
        rejected = tree.tokens[row, children[node]] if children[node] else tree.tokens[row, :0]
        residual = residual_distribution(probs[row, node], rejected)
        last[row] = node
        bonus[row] = torch.multinomial(residual, 1, generator=generators[row])[0]
    device = tree.tokens.device
    return _acceptance(tree, last.to(device), bonus.to(device))


def accept(tree: Tree, logits: torch.Tensor, sampling: SamplingConfig, generators=None) -> Acceptance:
    if sampling.greedy:
        return accept_greedy(tree, logits)
    return accept_sampling(tree, logits, sampling, generators)


def _acceptance(tree: Tree, last: torch.Tensor, bonus: torch.Tensor) -> Acceptance:
    # last: [B] the deepest accepted node; its ancestors, ordered by depth, are the path.
    b, n = tree.tokens.shape
    on_path = tree.ancestors[torch.arange(b, device=last.device), last]  # [B, N]
    key = torch.where(on_path, tree.depth, n + tree.depth)  # path nodes first, by depth
    accept_length = tree.depth.gather(1, last[:, None])[:, 0]
    width = int(tree.depth.max()) + 1
    path = key.argsort(dim=-1)[:, :width]
    # Pad each row's path by repeating its last node (never read beyond accept_length + 1).
    steps = torch.arange(width, device=last.device)[None, :]
    path = torch.where(steps <= accept_length[:, None], path, last[:, None])
    return Acceptance(path=path, accept_length=accept_length, bonus=bonus)
