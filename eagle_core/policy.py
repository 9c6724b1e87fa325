"""Which mode a round of speculative decoding uses: the auto policy, shared by `generate()` and the server.

Speculation pays only when tokens per round outweigh what a round costs over a plain step, and both
depend on things known only at run time: the draft and the workload (tau), the hardware and dtype (the
cost of a B x (total_tokens+1) verification over a B-token step). So plain decoding is always a
candidate, and the policy measures instead of predicting.
"""

from __future__ import annotations

from eagle_core.decoding import MODES


class ModeChooser:
    """The auto policy: pick, per batch size, the mode with the best measured throughput.

    Whether a tree pays depends on tau (the draft, the workload) and on how much a B x (total_tokens+1)
    verification costs over a B-token step (the hardware): tree wins iff tau_tree / t_tree(B) >
    1 / t_plain(B). Both sides are measured here, per batch-size bucket (powers of two), as committed
    tokens over seconds, both exponentially decayed sums. Every mode is tried `warmup_rounds` times
    first; afterwards the best one runs, and each other mode is re-measured now and then so that a change
    of load or workload is noticed: `explore_every` rounds after it last ran, an interval that doubles
    (up to `max_explore_every`) each time it is still more than `margin` below the best, so a mode that
    clearly loses costs ever less while a close contender keeps being measured (one round's tokens are
    noisy). A tree round is charged its own cost, not the catch-up of the plain steps before it.
    Switching costs nothing: every mode is lossless and keeps the caches in the same state.
    """

    def __init__(self, modes=MODES, explore_every: int = 16, alpha: float = 0.1, warmup_rounds: int = 2,
                 max_explore_every: int = 256, margin: float = 0.1):
        self.modes, self.explore_every, self.alpha = tuple(modes), explore_every, alpha
        self.warmup_rounds, self.max_explore_every = warmup_rounds, max(max_explore_every, explore_every)
        self.margin = margin  # a mode within this fraction of the best is a contender: no back-off
        # per (bucket, mode): decayed sums of committed tokens and seconds, and the number of rounds seen.
        # A ratio of sums, not a mean of per-round rates: one unlucky round (nothing accepted) must not
        # condemn a mode that pays on average.
        self.tokens: dict[tuple[int, str], float] = {}
        self.seconds: dict[tuple[int, str], float] = {}
        self.samples: dict[tuple[int, str], int] = {}
        self.rounds: dict[int, int] = {}
        self.last: dict[tuple[int, str], int] = {}  # the bucket's round count when the mode last ran
        self.interval: dict[tuple[int, str], int] = {}  # rounds between re-measurements of a losing mode

    @staticmethod
    def bucket(batch_rows: int) -> int:
        return 1 << (batch_rows - 1).bit_length()

    def rate(self, batch_rows: int, mode: str) -> float | None:
        """Measured tokens/s of `mode` at this batch size, None before its first round."""
        key = (self.bucket(batch_rows), mode)
        return self.tokens[key] / max(self.seconds[key], 1e-9) if key in self.tokens else None

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

    def record(self, batch_rows: int, mode: str, tokens: int, seconds: float) -> None:
        b = self.bucket(batch_rows)
        key = (b, mode)
        self.rounds[b] = self.rounds.get(b, 0) + 1
        keep = 1 - self.alpha if key in self.tokens else 0.0
        self.tokens[key] = keep * self.tokens.get(key, 0.0) + tokens
        self.seconds[key] = keep * self.seconds.get(key, 0.0) + seconds
        self.samples[key] = self.samples.get(key, 0) + 1
        self.last[key] = self.rounds[b]
        if self.samples[key] > self.warmup_rounds:  # a re-measurement: back off while it clearly loses
            losing = self.rate(batch_rows, mode) < (1 - self.margin) * self.rate(batch_rows, self.best(batch_rows))
            grown = min(2 * self.interval.get(key, self.explore_every), self.max_explore_every)
            self.interval[key] = grown if losing else self.explore_every
