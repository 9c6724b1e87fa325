"""Choose the tree size (`total_tokens`) that maximises expected tokens per second on this machine.

A round costs one draft pass (independent of `total_tokens` for a fixed `top_k`/`depth`) plus one target
forward over `total_tokens + 1` tokens; it yields tau(total_tokens) tokens (accepted + bonus). Both halves
are measured:

* `target_forward_cases`: the verification forward (tree mask, aux capture, lm_head on every node) at a
  few widths on a cache of realistic length; in between, linear interpolation. On a GPU the curve is flat
  up to dozens of tokens, on this CPU a 32-token forward costs ~2.4 one-token ones.
* `calibrate_acceptance`: greedy speculative decoding with the largest tree on a few prompts. The kept
  set of a smaller tree is the top of the same score order (rank < T), and ranks grow along any path, so
  the accept length a T-node tree would have had is the number of accepted nodes with rank <= T: one
  calibration run gives tau(T) for every T at once.

expected tokens/s (T) = tau(T) / (draft time per round + verify time(T + 1)).
The verify's lm_head runs either on every node or only along the accepted path (`TreeConfig.path_logits`:
tau one-row heads instead of one (T + 1)-row head); `head_cases` time the head alone and the cheaper way
is chosen with the shape (on this CPU an fp32 head of 5 rows costs ~2.5 one-row ones; in bf16 or on a GPU
the multi-row head is nearly free).
The plain loop is a candidate too (1 / one-token forward): `mode` says "plain" when no tree beats it.

The depth is tuned the same way, because on a CPU every draft level costs real time: the candidates of
the first D' levels do not depend on later levels, so a depth-D' tree of T nodes is the top T (by score)
of the calibration tree's nodes at depth <= D' (a lower bound on its tau when fewer than T such nodes
were kept), and `draft_cases` time the draft's tree building at every depth on a synthetic context.

The context chain (`TreeConfig.context_chain`, prompt lookup grafted beside the tree) is a third knob, 0 = off.
With candidate lengths given, the calibration decodes in mode "context" with the longest one, and every round
says what every (depth, T, L) would have accepted: the chain's tokens always form one root path (`graft_chain`
merges them into the tree or grafts them), so a chain of L tokens accepts min(L, m) where m is how far the
longest one agreed with the committed tokens, and the round accepts the larger of that and the draft tree's
own share of the path (`draft_accept_length`, exact). A round grafts nothing where the lookup found no match,
so the verify widens by L only in the share of rounds that had one (measured in the same run):
expected round time = draft + (1 - match) * verify(T + 1) + match * verify(T + 1 + L). L is kept only where
this beats L = 0 on the calibration prompts, i.e. where it pays on text like them.

All of these are timed together by `interleaved_ms`, round-robin, so the machine's drift lands on every case
alike: the choice compares costs, and a burst that landed on one width used to pick a different tree.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from eagle_core.decoding import CONTEXT, draft_extend, prefill
from eagle_core.generate import generate
from eagle_core.kv import TargetKV, lm_logits
from eagle_core.packed_linear import decode_kernels
from eagle_core.timing import timer_for
from eagle_core.tree import NO_TOKEN, TreeConfig, tree_from_parents
from eagle_core.verify import verify_tree

DEFAULT_SIZES = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
DEFAULT_CONTEXT_CHAINS = (0, 4, 8, 16)  # context chain lengths tried (0 = off)


@dataclass
class AutotuneResult:
    total_tokens: int  # the choice
    top_k: int
    depth: int
    forward_ms: dict[int, float]  # verify width (tokens incl. root) -> measured target forward time
    forward_ms_monotone: dict[int, float]  # the same, made non-decreasing in width (noise only adds time)
    context_tokens: int  # cache length the forwards were timed on
    draft_ms: dict[int, float]  # depth -> draft time per round (cache extension + tree building)
    tau: dict[str, float]  # "depth/total_tokens" -> expected tokens per round (accepted + bonus)
    expected_tokens_per_s: dict[str, float]  # "depth/total_tokens" -> tau / (draft + verify time)
    calibration: dict = field(default_factory=dict)
    plain_tokens_per_s: float = 0.0  # the plain loop: 1 / a one-token forward
    mode: str = "tree"  # "plain" when no tree is expected to beat the plain loop
    head_ms: dict[int, float] = field(default_factory=dict)  # rows -> the lm_head alone (non-decreasing)
    path_logits: bool = False  # the head only along the accepted path (cheaper for the chosen shape)
    # The context chain: the chosen length (0 = off); tau and expected tokens/s of the shapes with one, keyed
    # "depth/total_tokens+length"; the share of calibration rounds whose lookup found a match.
    context_chain: int = 0
    context_tau: dict[str, float] = field(default_factory=dict)
    context_expected_tokens_per_s: dict[str, float] = field(default_factory=dict)
    context_match_rate: float = 0.0

    @property
    def tree(self) -> TreeConfig:
        return TreeConfig(self.top_k, self.depth, self.total_tokens, path_logits=self.path_logits,
                          context_chain=self.context_chain)

    @property
    def key(self) -> str:
        return f"{self.depth}/{self.total_tokens}"

    def to_dict(self) -> dict:
        return asdict(self)

    def prime(self, chooser, rounds: int = 8) -> None:
        """Start an auto policy (`ModeChooser`, batch 1) from what this measured: the chosen tree's tau and
        expected round time, and a plain step's time, as `rounds` rounds each."""
        tau = self.tau[self.key]
        chooser.prime(1, "tree", tau, tau / self.expected_tokens_per_s[self.key], rounds)
        if self.context_chain:
            key = f"{self.key}+{self.context_chain}"
            tau = self.context_tau[key]
            chooser.prime(1, CONTEXT, tau, tau / self.context_expected_tokens_per_s[key], rounds)
        chooser.prime(1, "plain", 1.0, 1.0 / self.plain_tokens_per_s, rounds)


def rotation(items, turn: int) -> list:
    """`items` starting from the one at `turn` (mod its length): over len(items) turns each leads once."""
    items = list(items)
    start = turn % len(items)
    return items[start:] + items[:start]


def interleaved_ms(device, cases: dict, repeats: int = 9) -> dict:
    """Median wall time (ms) of every case {key: (run, undo or None)}, timed round-robin (`undo`, untimed, puts
    the state back after each run, so every repeat times the same work): each repeat runs every case once, starting from a
    different case each time, after one untimed pass. On a shared machine a burst or a drift then lands on
    every case alike instead of on whichever was being timed, so ratios between cases (what the auto-tune and the
    cost table compare) hold even when absolute times move (on shared CPUs they move by tens of percent between runs).
    Timed with the device's `eagle_core.timing.Timer` (CUDA events on a GPU), each run starting on an idle device, as
    a decoding round does; the times are read once, at the end."""
    keys = list(cases)
    timer = timer_for(device)
    spans = {key: [] for key in keys}
    for rep in range(repeats + 1):
        for key in rotation(keys, rep):
            run, undo = cases[key]
            timer.settle()  # untimed
            start = timer.mark()
            run()
            end = timer.mark()
            if rep:  # the first pass warms up
                spans[key].append((start, end))
            if undo is not None:
                undo()
    timer.settle()
    times = {key: sorted(timer.seconds(start, end) for start, end in s) for key, s in spans.items()}
    return {key: 1000 * t[len(t) // 2] for key, t in times.items()}


def target_forward_cases(target, widths, context_tokens: int = 256, aux_layer_ids=None) -> dict:
    """{width: case}: a verification forward of `width` tokens on a `context_tokens` cache, then dropped."""
    device = target.get_input_embeddings().weight.device
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(0)
    kv = TargetKV(1, device)
    with torch.inference_mode():
        prefill(target, kv, [torch.randint(0, vocab, (context_tokens,), generator=g).tolist()], aux_layer_ids)
    past = kv.width
    cases = {}
    for width in widths:
        # a chain-shaped tree: the forward's cost depends on the width, not on the shape
        parents = torch.clamp(torch.arange(width, device=device) - 1, min=0)[None]
        tokens = torch.randint(0, vocab, (1, width), generator=g).to(device)
        tree = tree_from_parents(tokens, parents)
        cases[width] = (lambda tree=tree: verify_tree(target, kv, tree, aux_layer_ids),
                        lambda: kv.truncate_(past))  # drop the verified entries
    return cases


def head_cases(target, widths) -> dict:
    """{width: case}: the target's lm_head alone on `width` rows (part of every verify forward)."""
    head = target.get_output_embeddings()
    g = torch.Generator().manual_seed(0)
    # one tensor per width, not slices of one: a bf16 linear on CPUs takes a ~15x slower kernel when a 3-d
    # input's leading stride is not its packed one (measured: SmolLM2's head 44 ms on x[:, :1] of a [1, 65, H]
    # tensor, 2.2 ms on a [1, 1, H] one), which the decoding never feeds it
    xs = {w: torch.randn(1, w, target.config.hidden_size, generator=g).to(head.weight.device, head.weight.dtype)
          for w in widths}
    return {width: (lambda x=xs[width]: lm_logits(target, x), None) for width in widths}


def draft_cases(draft, top_k: int, depths, context_tokens: int = 256, extend_tokens: int = 3) -> dict:
    """{depth: case}: one draft round at `depth` (extending its cache by a few tokens + building the tree) on a
    synthetic context."""
    from eagle_core.kv import DraftKV
    from eagle_core.tree import draft_tree

    device = draft.fc.weight.device
    cfg = draft.config
    g = torch.Generator().manual_seed(0)

    def features(n):
        aux = torch.randn(1, n, 3 * cfg.target_hidden_size, generator=g).to(device, draft.fc.weight.dtype)
        return aux, torch.randint(0, cfg.target_vocab_size, (1, n), generator=g).to(device), \
            torch.tensor([n], device=device)

    dkv = DraftKV(1, device)
    with torch.inference_mode():
        draft_extend(draft, dkv, *features(context_tokens))
    snapshot = (dkv.width, dkv.lengths)  # later writes land beyond these rows' lengths
    extension, root = features(extend_tokens), torch.zeros(1, dtype=torch.long, device=device)

    def round_at(depth):
        h = draft_extend(draft, dkv, *extension)
        draft_tree(draft, dkv, h, root, TreeConfig(top_k, depth, 1))

    def restore():
        dkv.width, dkv.lengths = snapshot

    return {depth: (lambda depth=depth: round_at(depth), restore) for depth in depths}


def timed(device, families: dict, repeats: int = 9) -> dict:
    """{family: {key: ms}} for {family: {key: case}}, every case of every family interleaved with all others."""
    flat = {(name, key): case for name, cases in families.items() for key, case in cases.items()}
    with torch.inference_mode():
        ms = interleaved_ms(device, flat, repeats)
    return {name: {key: ms[(name, key)] for key in cases} for name, cases in families.items()}


def round_ms(forward_ms: dict[int, float], head_ms: dict[int, float], draft_ms: dict[int, float], depth: int,
             size: int, tau: float, path_logits: bool) -> float:
    """Expected time of one round: the draft at `depth`, then the verify forward of `size` + 1 tokens with the
    lm_head on every node, or (path_logits) on tau rows, one per level walked (accepted tokens + the bonus)."""
    verify = interpolate(forward_ms, size + 1)
    if path_logits:
        verify += tau * interpolate(head_ms, 1) - interpolate(head_ms, size + 1)
    return draft_ms[depth] + verify


def monotone(points: dict[int, float]) -> dict[int, float]:
    """A wider forward is never cheaper: replace each time by the minimum over all wider widths."""
    out, best = {}, float("inf")
    for width in sorted(points, reverse=True):
        best = min(best, points[width])
        out[width] = best
    return dict(sorted(out.items()))


def interpolate(points: dict[int, float], x: float) -> float:
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if x <= hi:
            return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)
    lo, hi = xs[-2], xs[-1]  # extrapolate linearly beyond the last measurement
    return points[hi] + (points[hi] - points[lo]) * (x - hi) / (hi - lo)


@torch.inference_mode()
def calibrate_acceptance(target, draft, prompts: list[list[int]], tree: TreeConfig, depths, sizes,
                         max_new_tokens: int = 48, eos_token_id=None, context_chains=()):
    """tau(depth, T) for every depth in `depths` and T in `sizes`, from greedy decoding with `tree`.

    With `context_chains` (lengths; 0s ignored) it decodes in mode "context" with a chain of the longest and
    adds tau(depth, T, L) for each length L, keyed (depth, T, L), and the share of row-rounds whose lookup found a
    match, keyed "match"."""
    chains = sorted({length for length in context_chains if length > 0})
    accepted = {(d, t): 0 for d in depths for t in sizes}
    accepted.update({(d, t, length): 0 for d in depths for t in sizes for length in chains})
    rounds = matched = 0

    def on_round(out, _requests):
        nonlocal rounds, matched
        n = out.tree.draft_size or out.tree.size  # the draft's nodes; a grafted context chain's come after them
        depth = out.tree.depth[:, 1:n]  # [B, N-1] kept draft nodes below the root
        rank = out.tree.rank[:, 1:n]
        on_path = torch.zeros_like(depth, dtype=torch.bool)
        steps = torch.arange(out.path.shape[1], device=depth.device)[None, :]
        valid = (steps >= 1) & (steps <= out.accept_length[:, None]) & (out.path < n)
        rows = torch.arange(depth.shape[0], device=depth.device)[:, None].expand_as(out.path)
        on_path[rows[valid], out.path[valid] - 1] = True
        agree = torch.zeros_like(out.accept_length)  # how far each row's context chain agreed with the target
        if out.tree.context is not None:
            proposal = out.tree.context
            width = min(proposal.shape[1], out.tokens.shape[1])
            same = (proposal[:, :width] == out.tokens[:, :width]) & (steps[:, :width] <= out.accept_length[:, None])
            agree = same.long().cumprod(dim=1).sum(dim=1)
            matched += int((proposal[:, 0] != NO_TOKEN).sum())
        for d in depths:
            shallow = depth <= d
            # rank among the nodes of depth <= d: a depth-d tree keeps the best of exactly those
            order = torch.where(shallow, rank, rank.max() + 1 + rank)
            sub_rank = order.argsort(dim=-1).argsort(dim=-1) + 1
            for t in sizes:
                own = (on_path & shallow & (sub_rank <= t)).sum(dim=-1)  # [B] the draft tree's share
                accepted[(d, t)] += int(own.sum())
                for length in chains:  # the chain's tokens form one root path: it accepts min(length, agree)
                    accepted[(d, t, length)] += int(torch.maximum(own, agree.clamp(max=length)).sum())
        rounds += depth.shape[0]

    if chains:
        tree = TreeConfig(tree.top_k, tree.depth, tree.total_tokens, tree.path_logits, context_chain=chains[-1])
    res = generate(target, prompts, draft=draft, tree=tree, mode=CONTEXT if chains else "tree",
                   max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, on_round=on_round)
    tau = {key: 1.0 + n / max(rounds, 1) for key, n in accepted.items()}
    if chains:
        tau["match"] = matched / max(rounds, 1)
    return tau, res


def autotune(target, draft, prompts: list[list[int]], top_k: int = TreeConfig.top_k, depth: int = TreeConfig.depth,
             sizes=DEFAULT_SIZES, depths=None, max_new_tokens: int = 48, context_tokens: int = 256,
             eos_token_id=None, context_chains=DEFAULT_CONTEXT_CHAINS) -> AutotuneResult:
    """Measure, combine, choose (total_tokens and depth <= `depth`, and a context chain length among
    `context_chains`, 0 = off). `prompts` should look like the workload. `context_tokens`: the cache length the
    forwards are timed on."""
    max_size = TreeConfig(top_k, depth, max(sizes)).size
    sizes = sorted({min(s, max_size) for s in sizes})
    depths = sorted(depths or range(1, depth + 1))
    chains = sorted({length for length in context_chains if length > 0})
    t0 = time.perf_counter()
    widths = [1] + [s + 1 for s in sizes]  # verify forwards of a plain step and of every candidate size
    with decode_kernels(target), decode_kernels(draft):  # the kernels the decoding runs
        costs = timed(target.get_input_embeddings().weight.device, {
            "verify": target_forward_cases(target, widths, context_tokens, list(draft.config.aux_layer_ids)),
            "head": head_cases(target, widths),
            "draft": draft_cases(draft, top_k, depths, context_tokens)})
    forward_ms, head_ms, draft_ms = costs["verify"], monotone(costs["head"]), costs["draft"]
    t1 = time.perf_counter()
    tau, res = calibrate_acceptance(target, draft, prompts, TreeConfig(top_k, depth, max_size), depths, sizes,
                                    max_new_tokens, eos_token_id, chains)
    match = tau.pop("match", 0.0)
    t2 = time.perf_counter()
    smooth = monotone(forward_ms)
    expected, path = {}, {}  # (depth, size, chain length) -> tokens/s, and whether path logits are cheaper
    for d in depths:
        for s in sizes:
            if s > TreeConfig(top_k, d, s).num_candidates:
                continue
            for length in [0] + chains:
                t = tau[(d, s, length) if length else (d, s)]
                # a round grafts the chain only where the lookup matched: its verify is `length` tokens wider then
                cost = {p: (1 - match) * round_ms(smooth, head_ms, draft_ms, d, s, t, p)
                        + match * round_ms(smooth, head_ms, draft_ms, d, s + length, t, p) if length
                        else round_ms(smooth, head_ms, draft_ms, d, s, t, p) for p in (False, True)}
                path[(d, s, length)] = cost[True] < cost[False]
                expected[(d, s, length)] = 1000 * t / cost[path[(d, s, length)]]
    best_depth, best_size, best_chain = max(expected, key=expected.get)
    plain = 1000 / smooth[1]  # plain decoding is a candidate: a tree must beat it to be chosen
    calibration = dict(prompts=len(prompts), rounds=sum(s.rounds for s in res.stats),
                       new_tokens=sum(s.new_tokens for s in res.stats),
                       measure_seconds=round(t1 - t0, 1), calibration_seconds=round(t2 - t1, 1))
    best = expected[(best_depth, best_size, best_chain)]

    def named(values: dict, with_chain: bool) -> dict:
        return {f"{k[0]}/{k[1]}" + (f"+{k[2]}" if with_chain else ""): v for k, v in values.items()
                if (len(k) == 3 and k[2] > 0) == with_chain}

    plain_expected = {k[:2]: v for k, v in expected.items() if k[2] == 0}
    return AutotuneResult(total_tokens=best_size, top_k=top_k, depth=best_depth, forward_ms=forward_ms,
                          forward_ms_monotone=smooth, context_tokens=context_tokens, draft_ms=draft_ms,
                          tau=named(tau, False), expected_tokens_per_s=named(plain_expected, False),
                          calibration=calibration, plain_tokens_per_s=plain,
                          mode=("plain" if best <= plain else CONTEXT if best_chain else "tree"),
                          head_ms=head_ms, path_logits=path[(best_depth, best_size, best_chain)],
                          context_chain=best_chain, context_tau=named(tau, True),
                          context_expected_tokens_per_s=named(expected, True), context_match_rate=match)
