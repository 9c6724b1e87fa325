"""Tree verification: one target forward over the whole draft tree, then the accepted path.

The flattened tree goes through the target on top of its KV cache with an ancestor-only mask and
depth-based positions (`root + depth`), so every node is scored exactly as if its root-to-node path had
been decoded alone. From the target's next-token distributions at every node we pick a path and one extra
token (the bonus: the target's own next token after the last accepted node).

Greedy acceptance: follow the children whose token equals the target's argmax at their parent for as long
as one exists; the bonus is the argmax at the last accepted node. Output = plain greedy decoding.

Sampling: every position's randomness is a function of (seed, absolute position) alone (Gumbel noise
from a counter-based hash, `gumbel_noise`), so a token is the target's *noisy* argmax at its parent and
sampling acceptance is greedy acceptance on noisy logits (`accept_sampling`, with the proof). A seeded
request therefore yields the same tokens whether it is decoded plain, with chains or with trees, whatever
the draft and whatever it is batched with.
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


def filtered_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p (as transformers): logits [..., V] -> float32, -inf where cut."""
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
    return logits


def target_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The distribution plain sampling draws from (temperature, top-k, top-p): logits [..., V] -> probs.

    Speculative and plain decoding both sample from it, so "lossless" means: the same distribution as
    this function's.
    """
    return filtered_logits(logits, sampling).softmax(dim=-1)


# ---- counter-based randomness: the noise of a position depends on (seed, position) only ----------------------

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), without int64 overflow (16-bit halves of c)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche (Wellons' lowbias32) on int64 tensors holding uint32."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_words(seeds: list[int], device) -> torch.Tensor:
    """Python seeds (any int) -> [B, 2] int64 words (low, high 32 bits of seed mod 2^64)."""
    words = [[(s % 2 ** 64) & _MASK32, (s % 2 ** 64) >> 32] for s in seeds]
    return torch.tensor(words, dtype=torch.long, device=device)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise [B, M, V] (float32), a pure function of (seed, position, token id).

    seeds: [B, 2] from `seed_words`; positions: [B, M] absolute positions of the tokens being drawn.
    Different (seed, position) pairs give independent-looking streams; the same pair always the same one,
    on any batch and for any decoding mode.
    """
    key = _mix32(seeds[:, 0] ^ _mix32(seeds[:, 1] ^ 0x2545F491))  # [B]
    key = _mix32(key[:, None] ^ _mix32((positions & _MASK32) ^ 0x68E31DA4))  # [B, M]
    token = _mul32(torch.arange(vocab, device=seeds.device), 0x9E3779B9)
    bits = _mix32(_mix32(key[:, :, None] ^ token))  # [B, M, V] uniform 32-bit
    u = (bits.double() + 0.5) / 2.0 ** 32  # (0, 1)
    return (-torch.log(-torch.log(u))).float()


def sample_tokens(logits: torch.Tensor, sampling: SamplingConfig, seeds: torch.Tensor | None = None,
                  positions: torch.Tensor | None = None) -> torch.Tensor:
    """The token at each position: logits [B, M, V] -> [B, M].

    Greedy: the argmax. Sampling: the argmax of the filtered logits plus `gumbel_noise(seeds, positions)`,
    which is distributed exactly as `target_probs` (the Gumbel-max trick).
    """
    if sampling.greedy:
        return logits.argmax(dim=-1)
    noisy = filtered_logits(logits, sampling) + gumbel_noise(seeds, positions, logits.shape[-1])
    return noisy.argmax(dim=-1)


def sample_next(logits: torch.Tensor, sampling: SamplingConfig, seeds: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row from logits [B, V] drawn at positions [B] (see `sample_tokens`)."""
    pos = positions[:, None] if positions is not None else None
    return sample_tokens(logits[:, None], sampling, seeds, pos)[:, 0]


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


def accept_tokens(tree: Tree, chosen: torch.Tensor) -> Acceptance:
    """Longest path whose every token is `chosen` at its parent, plus the chosen token after it.

    chosen: [B, N] the target's token after each node (its argmax, or its noisy argmax when sampling).
    """
    match = tree.tokens == chosen.gather(1, tree.parents)  # [B, N]: node agrees with the target at its parent
    match[:, 0] = True
    on_path = ~(tree.ancestors & ~match[:, None, :]).any(dim=-1)  # node and all its ancestors agree
    # Siblings carry distinct tokens, so the agreeing nodes form one chain from the root: take its end.
    last = torch.where(on_path, tree.depth, -1).argmax(dim=-1)  # [B]
    return _acceptance(tree, last, chosen.gather(1, last[:, None])[:, 0])


def accept_greedy(tree: Tree, logits: torch.Tensor) -> Acceptance:
    """Longest path whose every token is the target's argmax at its parent, plus the argmax after it."""
    return accept_tokens(tree, logits.argmax(dim=-1))


def node_positions(tree: Tree, root_positions: torch.Tensor) -> torch.Tensor:
    """[B, N] absolute position of the token each node's logits draw: the node's own position + 1."""
    return root_positions[:, None] + tree.depth + 1


def accept_sampling(tree: Tree, logits: torch.Tensor, sampling: SamplingConfig, seeds: torch.Tensor,
                    root_positions: torch.Tensor) -> Acceptance:
    """Greedy acceptance on the noisy logits: exactly the tokens plain sampling would have drawn.

    Rule: the token after node u (at absolute position q(u) = root position + depth(u) + 1) is
    x(u) = argmax(filtered logits(u) + G(seed, q(u))), with G the counter-based Gumbel noise of
    `gumbel_noise`. A drafted child is accepted exactly when it equals x(parent); the bonus is x(last
    accepted node). Nodes at the same depth share their noise (same position): the noise is a property of
    the position in the sequence, not of the tree.

    Proof that it is lossless: plain sampling draws token t as argmax(filtered logits(. | x_<t) + G(seed, t))
    (`sample_next`), which by the Gumbel-max trick is distributed as target_probs(. | x_<t), and the
    noises of different positions are independent, so the sequence has the target's law. On an accepted
    path every node's prefix is the committed sequence, its logits are the target's for that prefix and
    its noise is that of the same position, so every committed token -- accepted or bonus -- is exactly the
    token plain sampling draws there. Speculative output therefore equals plain output token for token
    (whatever the draft, tree shape or batch), and so has the same distribution. The acceptance rate is
    P(the draft's child set contains the noisy argmax), the same as the best lossless rule's for a fixed
    tree (it accepts exactly when a target-distributed token falls among the children).
    """
    return accept_tokens(tree, sample_tokens(logits, sampling, seeds, node_positions(tree, root_positions)))


def accept(tree: Tree, logits: torch.Tensor, sampling: SamplingConfig, seeds: torch.Tensor | None = None,
           root_positions: torch.Tensor | None = None) -> Acceptance:
    if sampling.greedy:
        return accept_greedy(tree, logits)
    return accept_sampling(tree, logits, sampling, seeds, root_positions)


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
