"""Tree verification: one target forward over the whole draft tree, then the accepted path.

The flattened tree goes through the target on top of its KV cache with an ancestor-only mask and
depth-based positions (`root + depth`), so every node is scored exactly as if its root-to-node path had
been decoded alone. From the target's next-token distributions at every node we pick a path and one extra
token (the bonus: the target's own next token after the last accepted node).

Greedy acceptance: follow the children whose token equals the target's argmax at their parent for as long
as one exists; the bonus is the argmax at the last accepted node. Output = plain greedy decoding.

Sampling: every position's randomness is a function of (seed, absolute position) alone (Gumbel noise
from a counter-based hash of (seed, position, token) in integer tensor ops, `gumbel_noise`), so a token is
the target's *noisy* argmax at its parent and sampling acceptance is greedy acceptance on noisy logits
(`accept_sampling`, with the proof). A seeded request therefore yields the same tokens whether it is decoded
plain, with chains or with trees, whatever the draft and whatever it is batched with; the noise is the same
on CPUs and GPUs, and needs neither a generator nor the host (a CUDA graph can capture it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_core.kv import TargetKV, lm_logits, target_forward
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


# ---- counter-based randomness: the noise of a token depends on (seed, position, token) only ------------------
#
# SplitMix64 (Steele, Lea & Flood 2014) in int64 tensor arithmetic: a position's key is a mix of (seed,
# position), and token j's 64 random bits are mix64(key + (j + 1) * GAMMA), SplitMix64's own counter form. Pure
# elementwise integer ops on device tensors: no generator, no host round trip, capturable in a CUDA graph, and
# the same bits on every device (two's-complement int64 arithmetic wraps alike on CPUs and GPUs).

_MASK64 = (1 << 64) - 1


def _int64(x: int) -> int:
    """The signed int64 with the bits of x mod 2^64 (how a 64-bit constant is written into an int64 tensor)."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


_GAMMA = _int64(0x9E3779B97F4A7C15)
_MUL1 = _int64(0xBF58476D1CE4E5B9)
_MUL2 = _int64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits: `>>` on int64 is arithmetic (copies the sign bit), so mask it off."""
    return (x >> s).bitwise_and_((1 << (64 - s)) - 1)


def _mix64_(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on an int64 tensor, in place (multiplications wrap mod 2^64): a bijection of words."""
    x ^= _shr(x, 30)
    x *= _MUL1
    x ^= _shr(x, 27)
    x *= _MUL2
    x ^= _shr(x, 31)
    return x


def seed_tensor(seeds, device) -> torch.Tensor:
    """Per-row seeds as an int64 tensor [B] on `device` (Python ints are taken mod 2^64); a tensor passes through."""
    if isinstance(seeds, torch.Tensor):
        return seeds.to(device=device, dtype=torch.long)
    return torch.tensor([_int64(s) for s in seeds], dtype=torch.long, device=device)


def noise_uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms [B, M, V] (float64) in (0, 1), a pure function of (seed, position, token) on any device.

    seeds: [B] (ints or int64); positions: [B, M]. Integer ops, then one exact conversion (`_open_unit`): u is
    never 0 or 1 and equal bit for bit on every device.
    """
    seeds = seed_tensor(seeds, positions.device)
    # every operand of an in-place mix below is a fresh tensor
    key = _mix64_(_mix64_(seeds + _GAMMA)[:, None] ^ positions.long())  # [B, M]: one stream per (seed, position)
    counter = torch.arange(1, vocab + 1, dtype=torch.long, device=positions.device) * _GAMMA  # [V], wraps
    return _open_unit(_mix64_(key[:, :, None] + counter))  # [B, M, V]


def _open_unit(bits: torch.Tensor) -> torch.Tensor:
    """64-bit words -> float64 in (0, 1): the top 52 bits k give (2k + 1) / 2^53 (the top 53 bits with the lowest
    set, scaled), exact, in [2^-53, 1 - 2^-53]."""
    return _shr(bits, 11).bitwise_or_(1).double().mul_(2.0 ** -53)


def gumbel_noise(seeds, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise [B, M, V] (float32), a pure function of (seed, position, token).

    seeds: one per row (a list of ints or an int64 tensor [B]); positions: [B, M] absolute positions of the tokens
    being drawn. The same (seed, position) always gives the same noise, in any batch, for any decoding mode and on
    any device (`noise_uniforms` is integer arithmetic; -log(-log u) then rounds alike up to the last bit of the
    float64 log, which the float32 result almost never sees); different pairs give independent streams.
    """
    return noise_uniforms(seeds, positions, vocab).log().neg_().log_().neg_().float()


def sample_tokens(logits: torch.Tensor, sampling: SamplingConfig, seeds=None,
                  positions: torch.Tensor | None = None) -> torch.Tensor:
    """The token at each position: logits [B, M, V] -> [B, M].

    Greedy: the argmax. Sampling: the argmax of the filtered logits plus `gumbel_noise(seeds, positions)`,
    which is distributed exactly as `target_probs` (the Gumbel-max trick).
    """
    if sampling.greedy:
        return logits.argmax(dim=-1)
    noisy = filtered_logits(logits, sampling) + gumbel_noise(seeds, positions, logits.shape[-1])
    return noisy.argmax(dim=-1)


def sample_next(logits: torch.Tensor, sampling: SamplingConfig, seeds=None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row from logits [B, V] drawn at positions [B] (see `sample_tokens`)."""
    pos = positions[:, None] if positions is not None else None
    return sample_tokens(logits[:, None], sampling, seeds, pos)[:, 0]


@torch.no_grad()  # see draft_tree: the target cache may grow here
def verify_hidden(target, kv: TargetKV, tree: Tree, aux_layer_ids: list[int] | None):
    """Target forward over the flattened tree, up to the lm_head: (hidden [B, N, H], aux [B, N, 3H] or None).

    The N entries are appended to `kv` at slots [P, P+N); `kv.keep_new_` must follow with the path.
    """
    position_ids = kv.lengths[:, None] + tree.depth  # [B, N]
    return target_forward(target, kv, tree.forward_tokens(), position_ids, tree.ancestors, aux_layer_ids)


def verify_tree(target, kv: TargetKV, tree: Tree, aux_layer_ids: list[int] | None):
    """`verify_hidden` with the lm_head on every node: (logits [B, N, V], aux [B, N, 3H] or None)."""
    hidden, aux = verify_hidden(target, kv, tree, aux_layer_ids)
    return lm_logits(target, hidden), aux


@dataclass
class Acceptance:
    path: torch.Tensor  # [B, D+1] tree indices root-first; entries beyond accept_length repeat the last
    accept_length: torch.Tensor  # [B] draft tokens accepted (the path minus the root)
    bonus: torch.Tensor  # [B] the target's token after the path (the next round's root)


def accept_tokens(tree: Tree, chosen: torch.Tensor, levels: int | None = None) -> Acceptance:
    """Longest path whose every token is `chosen` at its parent, plus the chosen token after it.

    chosen: [B, N] the target's token after each node (its argmax, or its noisy argmax when sampling). levels: the
    path's width, at least the tree's depth + 1 (None: read from the tree, one host sync; a compiled step passes
    it: `eagle_core.static_kv`).
    """
    match = tree.tokens == chosen.gather(1, tree.parents)  # [B, N]: node agrees with the target at its parent
    match[:, 0] = True
    on_path = ~(tree.ancestors & ~match[:, None, :]).any(dim=-1)  # node and all its ancestors agree
    # Siblings carry distinct tokens, so the agreeing nodes form one chain from the root: take its end.
    last = torch.where(on_path, tree.depth, -1).argmax(dim=-1)  # [B]
    return _acceptance(tree, last, chosen.gather(1, last[:, None])[:, 0], levels)


def accept_greedy(tree: Tree, logits: torch.Tensor, levels: int | None = None) -> Acceptance:
    """Longest path whose every token is the target's argmax at its parent, plus the argmax after it."""
    return accept_tokens(tree, logits.argmax(dim=-1), levels)


def level_positions(root_positions: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """[B, D+1] absolute position of the token drawn after a node at each depth: the node's own + 1."""
    return root_positions[:, None] + levels[None, :] + 1


def accept_sampling(tree: Tree, logits: torch.Tensor, sampling: SamplingConfig, seeds,
                    root_positions: torch.Tensor, levels: int | None = None) -> Acceptance:
    """Greedy acceptance on the noisy logits: exactly the tokens plain sampling would have drawn.

    Rule: the token after node u (at absolute position q(u) = root position + depth(u) + 1) is
    x(u) = argmax(filtered logits(u) + G(seed, q(u))), with G the Gumbel noise of `gumbel_noise` (a hash
    of (seed, q, token)). A drafted child is accepted exactly when it equals
    x(parent); the bonus is x(last accepted node). Nodes at the same depth share their noise (same
    position): the noise is a property of the position in the sequence, not of the tree.

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
    vocab = logits.shape[-1]
    depths = torch.arange(int(tree.depth.max()) + 1 if levels is None else levels, device=logits.device)
    noise = gumbel_noise(seeds, level_positions(root_positions, depths), vocab)  # [B, D+1, V]: one per depth
    noise = noise.gather(1, tree.depth[:, :, None].expand(-1, -1, vocab))  # [B, N, V]
    return accept_tokens(tree, (filtered_logits(logits, sampling) + noise).argmax(dim=-1), levels)


def accept(tree: Tree, logits: torch.Tensor, sampling: SamplingConfig, seeds=None,
           root_positions: torch.Tensor | None = None, levels: int | None = None) -> Acceptance:
    """`accept_greedy` or `accept_sampling`; levels: see `accept_tokens`."""
    if sampling.greedy:
        return accept_greedy(tree, logits, levels)
    return accept_sampling(tree, logits, sampling, seeds, root_positions, levels)


@torch.no_grad()
def accept_on_path(target, tree: Tree, hidden: torch.Tensor, sampling: SamplingConfig, seeds=None,
                   root_positions: torch.Tensor | None = None) -> Acceptance:
    """`accept(tree, lm_logits(target, hidden), ...)` with the lm_head applied only where acceptance looks.

    Acceptance reads the target's token at the nodes of the accepted path alone (`accept_tokens`), so walk it
    level by level from the root: the token at the current node (argmax, or noisy argmax at the position of
    its depth, exactly as `accept_sampling`), then the child carrying it, if any (siblings carry distinct
    tokens). One lm_head row per still-accepting sequence and level, accept_length + 1 levels, instead of N
    rows: the same acceptance, cheaper wherever a multi-row head costs more than that (fp32 on CPUs).
    """
    b, _ = tree.tokens.shape
    device = tree.tokens.device
    node = torch.zeros(b, dtype=torch.long, device=device)
    bonus = torch.zeros(b, dtype=torch.long, device=device)
    active = torch.arange(b, device=device)  # rows whose last chosen token was a child in the tree
    seeds = None if sampling.greedy else seed_tensor(seeds, device)
    for level in range(int(tree.depth.max()) + 1):
        at = node[active]
        logits = lm_logits(target, hidden[active, at][:, None])  # [A, 1, V]
        positions = None if sampling.greedy else (root_positions[active] + level + 1)[:, None]
        rows_seeds = None if sampling.greedy else seeds[active]
        chosen = sample_tokens(logits, sampling, rows_seeds, positions)[:, 0]  # [A]
        bonus[active] = chosen
        child = ((tree.parents[active] == at[:, None]) & (tree.depth[active] == level + 1)
                 & (tree.tokens[active] == chosen[:, None]))  # [A, N]: at most one per row
        found = child.any(dim=-1)
        node[active] = torch.where(found, child.int().argmax(dim=-1), at)
        active = active[found]
        if active.numel() == 0:
            break
    return _acceptance(tree, node, bonus)


def _acceptance(tree: Tree, last: torch.Tensor, bonus: torch.Tensor, levels: int | None = None) -> Acceptance:
    # last: [B] the deepest accepted node; its ancestors, ordered by depth, are the path (`levels` wide).
    b, n = tree.tokens.shape
    on_path = tree.ancestors[torch.arange(b, device=last.device), last]  # [B, N]
    key = torch.where(on_path, tree.depth, n + tree.depth)  # path nodes first, by depth
    accept_length = tree.depth.gather(1, last[:, None])[:, 0]
    width = int(tree.depth.max()) + 1 if levels is None else levels
    path = key.argsort(dim=-1)[:, :width]
    # Pad each row's path by repeating its last node (never read beyond accept_length + 1).
    steps = torch.arange(width, device=last.device)[None, :]
    path = torch.where(steps <= accept_length[:, None], path, last[:, None])
    return Acceptance(path=path, accept_length=accept_length, bonus=bonus)
