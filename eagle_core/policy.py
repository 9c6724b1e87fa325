"""Which mode a round of speculative decoding uses: the auto policy, shared by `generate()` and the server.

Speculation pays only when tokens per round outweigh what a round costs over a plain step, and both
depend on things known only at run time: the draft and the workload (tau), the hardware and dtype (the
cost of a B x (total_tokens+1) verification over a B-token step). So plain decoding is always a
candidate, and the policy measures instead of predicting.

The context chain (`TreeConfig.context_chain`: prompt lookup grafted beside the tree) is weighed the same way: where
the tree has one, "context" (the tree with its chain) is one more mode (`decoding.available_modes`), charged its own
rounds' cost (the wider verify, where the lookup matched) and credited on every tree or context round with what it
would have committed (`Step.also`: a context round says what the tree alone accepted, a tree round what the chain
would have added), so the chain runs only while it pays on the text at hand: on copying text, not on chat.
"""

from __future__ import annotations

from eagle_core.decoding import MODES


class ModeChooser:
    """The auto policy: pick, per batch size, the mode with the best measured throughput.

    Whether a tree pays depends on tau (the draft, the workload) and on how much a B x (total_tokens+1)
    verification costs over a B-token step (the hardware): tree wins iff tau_tree / t_tree(B) >
    1 / t_plain(B). Both halves are measured here, per batch-size bucket (powers of two) and per row, as
    exponentially decayed sums: what a round of each mode costs (seconds, from its own rounds) and what it
    yields (committed tokens). A round also says what the other modes would have committed on the same text
    (`Step.also`: plain one token per row, a chain what the tree's accepted path shows), so yields are
    compared on the same rounds, not on whichever text each mode happened to meet: text varies far more from
    round to round than a mode's cost does, and a mode judged on a lucky stretch used to run on while the
    better one waited for its next re-measurement. Every mode is tried `warmup_rounds` times first;
    afterwards the best one runs, and each other mode is re-measured now and then so that a change of load or
    workload is noticed: `explore_every` rounds after it last ran, an interval that doubles (up to
    `max_explore_every`) each time it is still more than `margin` below the best, so a mode that clearly
    loses costs ever less while a close contender keeps being measured. A tree round is charged its own
    cost, not the catch-up of the plain steps before it. Switching costs nothing: every mode is lossless and
    keeps the caches in the same state.

    `alpha` 0.02 (a memory of ~50 rounds): a slow spell of the machine and a stretch of hard text each last
    tens of rounds, and with 0.1 (~10 rounds) they handed whole requests to plain or chain, which left the policy
    well under the tree it should have kept running (the measurements: docs/experiments.md, the demo's runs).
    """

    def __init__(self, modes=MODES, explore_every: int = 16, alpha: float = 0.02, warmup_rounds: int = 2,
                 max_explore_every: int = 256, margin: float = 0.1):
        self.modes, self.explore_every, self.alpha = tuple(modes), explore_every, alpha
        self.warmup_rounds, self.max_explore_every = warmup_rounds, max(max_explore_every, explore_every)
        self.margin = margin  # a mode within this fraction of the best is a contender: no back-off
        # per (bucket, mode): decayed sums over rows of committed tokens (yield) and of seconds (cost), each
        # with its decayed row count, and the number of rounds the mode ran. Ratios of sums, not means of
        # per-round rates: one unlucky round (nothing accepted) must not condemn a mode that pays on average.
        self.tokens: dict[tuple[int, str], float] = {}
        self.token_rows: dict[tuple[int, str], float] = {}
        self.seconds: dict[tuple[int, str], float] = {}
        self.second_rows: dict[tuple[int, str], float] = {}
        self.samples: dict[tuple[int, str], int] = {}
        self.rounds: dict[int, int] = {}
        self.last: dict[tuple[int, str], int] = {}  # the bucket's round count when the mode last ran
        self.interval: dict[tuple[int, str], int] = {}  # rounds between re-measurements of a losing mode

    @staticmethod
    def bucket(batch_rows: int) -> int:
        return 1 << (batch_rows - 1).bit_length()

    def rate(self, batch_rows: int, mode: str) -> float | None:
        """Measured tokens/s per row of `mode` at this batch size, None before its first round."""
        key = (self.bucket(batch_rows), mode)
        if key not in self.seconds:
            return None
        per_row_s = self.seconds[key] / self.second_rows[key]
        return self.tokens[key] / self.token_rows[key] / max(per_row_s, 1e-12)

    def prime(self, batch_rows: int, mode: str, tokens: float, seconds: float, rounds: int = 8) -> None:
        """Start `mode`'s estimates from an offline measurement (the auto-tune's, `AutotuneResult.prime`): as if it
        had run `rounds` rounds committing `tokens` in `seconds` each (no warm-up rounds for it, no back-off).
        Two warm-up rounds decide by a coin flip (one round commits 1 to depth + 1 tokens) and a mode that lost
        it is then re-measured ever less often; measured rounds outweigh the prior within a few dozen rounds."""
        key = (self.bucket(batch_rows), mode)
        weight = sum((1 - self.alpha) ** i for i in range(rounds))
        self.tokens[key], self.token_rows[key] = weight * tokens, weight * batch_rows
        self.seconds[key], self.second_rows[key] = weight * seconds, weight * batch_rows
        self.samples[key] = max(self.samples.get(key, 0), rounds)

    def choose(self, batch_rows: int) -> str:
        b = self.bucket(batch_rows)
        n = self.rounds.get(b, 0)
        fewest = min(self.modes, key=lambda m: self.samples.get((b, m), 0))  # ties: the order of `modes`
        if self.samples.get((b, fewest), 0) < self.warmup_rounds:
            return fewest
        best = self.best(batch_rows)
        if not self.explore_every:
            return best
        overdue = {m: n - self.last.get((b, m), 0) - self.interval.get((b, m), self.explore_every)
                   for m in self.modes if m != best}
        due = max(overdue, key=overdue.get, default=None)
        return due if due is not None and overdue[due] >= 0 else best

    def best(self, batch_rows: int) -> str:
        return max(self.modes, key=lambda m: self.rate(batch_rows, m) or 0.0)

    def _add(self, sums: dict, rows: dict, key, value: float, batch_rows: int) -> None:
        keep = 1 - self.alpha if key in sums else 0.0
        sums[key] = keep * sums.get(key, 0.0) + value
        rows[key] = keep * rows.get(key, 0.0) + batch_rows

    def record(self, batch_rows: int, mode: str, tokens: int, seconds: float, also: dict | None = None) -> None:
        """A round of `mode` on `batch_rows` rows committed `tokens` in `seconds`; `also`: {other mode: tokens it
        would have committed on the same rows} (`Step.also`), which counts toward those modes' yields only."""
        b = self.bucket(batch_rows)
        key = (b, mode)
        self.rounds[b] = self.rounds.get(b, 0) + 1
        self._add(self.tokens, self.token_rows, key, tokens, batch_rows)
        self._add(self.seconds, self.second_rows, key, seconds, batch_rows)
        for other, other_tokens in (also or {}).items():
            if other != mode and other in self.modes:
                self._add(self.tokens, self.token_rows, (b, other), other_tokens, batch_rows)
        self.samples[key] = self.samples.get(key, 0) + 1
        self.last[key] = self.rounds[b]
        if self.samples[key] > self.warmup_rounds:  # a re-measurement: back off while it clearly loses
            losing = self.rate(batch_rows, mode) < (1 - self.margin) * self.rate(batch_rows, self.best(batch_rows))
            grown = min(2 * self.interval.get(key, self.explore_every), self.max_explore_every)
            self.interval[key] = grown if losing else self.explore_every
