"""Acceptance as a live signal: per-request records, per-label windows and the drift rule. Pure Python (no Ray,
no MLflow, no torch), so every rule here is unit-tested directly; `pipelines.serve.acceptance_report` does the
I/O (MLflow, the drift hook) and `pipelines.serve.service` feeds it.

Definitions (the project's, `eagle_core.generate.RequestStats`): a *draft round* is one verification of a tree
or chain for one request; its accept length counts the draft tokens accepted (bonus excluded);
tau = 1 + accepted / draft rounds, pooled over whatever is being measured (a request, a window of requests).

The drift rule compares like with like: the champion's evaluation tau (`pipelines.retrain.evaluate.evaluate_draft`,
the version tag `tau`) is measured on tree rounds, so the drift window pools only a request's tree rounds
(`DRIFT_MODES`, "context" being a tree with a prompt-lookup chain grafted beside it). Chain rounds (the load
fallback) have a shorter path by construction and plain rounds propose nothing; counting them would raise an alert
whenever load rises. A request with no tree round does not enter the drift window. On vLLM (`engine_name` vllm)
every round is a vLLM verification step (mode "vllm"), compared with the version's acceptance length in vLLM (the
tag `eagle3.vllm_acceptance_length`, written by the serving-engine gate).

Per label, over the last `window` requests of the served version: window tau < reference tau - margin raises the
alert (once, when it crosses), window tau >= that threshold clears it (once). No decision is taken before the
window holds `window` requests. A new served version (a champion swap) or a new reference tau starts every window
and alert afresh; records of the previous version (requests that finish on it after the swap) still count in the
histograms but not in the windows.

Alerts are rate-limited per label (`alert_interval_s`): a label raises at most one alert per interval, whatever
versions were served meanwhile (a client flooding one label with low-acceptance prompts gets one alert, hence at
most one retraining on its data, per interval, and cannot re-raise it once the retrained draft is served). A
crossing within the interval is held back: an event of kind "suppressed" (counted, nothing else), and the alert is
raised at the first request after the interval if the window is still below the threshold.
"""

from __future__ import annotations

import re
import time
from collections import deque
from dataclasses import dataclass, field

DEFAULT_LABEL = "default"
OTHER_LABEL = "other"  # where labels beyond the cap are folded (bounded metric cardinality)
LABEL_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
DRIFT_MODES = ("tree", "context", "vllm")  # "vllm": a verification step of vLLM's EAGLE-3 (its replicas have no other)


def check_label(label: str) -> str:
    """The label itself, or ValueError saying what a label may be (the HTTP layer turns it into a 400)."""
    if not isinstance(label, str) or not LABEL_PATTERN.fullmatch(label):
        raise ValueError(f"must be 1-64 characters of A-Z a-z 0-9 _ . - (got {label!r:.80})")
    return label


class LabelCap:
    """Bounded label values: the first `max_labels` distinct labels seen keep their name, every later one is
    folded into "other". "default" is always kept and counts against the cap."""

    def __init__(self, max_labels: int):
        if max_labels < 1:
            raise ValueError("max_labels must be >= 1")
        self.max_labels = max_labels
        self.kept: set[str] = {DEFAULT_LABEL}

    def fold(self, label: str) -> str:
        if label in self.kept or label == OTHER_LABEL:
            return label
        if len(self.kept) < self.max_labels:
            self.kept.add(label)
            return label
        return OTHER_LABEL


@dataclass(frozen=True)
class AcceptanceRecord:
    """One finished request: its label, the draft version that decoded it, and its draft rounds by mode as
    (rounds, accepted tokens); `accept_lengths` is every draft round's accept length, in order; `modes` counts
    every round (plain ones too) by mode."""

    category: str
    version: str | None
    accept_lengths: tuple[int, ...]
    by_mode: dict[str, tuple[int, int]]
    modes: dict[str, int]

    @property
    def tau(self) -> float | None:
        """Tokens per draft round over all of the request's draft rounds; None when it had none."""
        if not self.accept_lengths:
            return None
        return 1.0 + sum(self.accept_lengths) / len(self.accept_lengths)

    @property
    def drift_rounds(self) -> tuple[int, int]:
        """(rounds, accepted) over the modes the drift rule compares (`DRIFT_MODES`)."""
        pairs = [self.by_mode.get(m, (0, 0)) for m in DRIFT_MODES]
        return sum(r for r, _ in pairs), sum(a for _, a in pairs)

    @property
    def mode(self) -> str:
        """The mode most of the request's rounds used ("plain" when it had none)."""
        return max(self.modes.items(), key=lambda kv: kv[1])[0] if any(self.modes.values()) else "plain"


class SlidingTau:
    """Pooled tau over the last `size` entries of (rounds, accepted), with running sums (O(1) per entry)."""

    def __init__(self, size: int):
        self.size = size
        self.entries: deque[tuple[int, int]] = deque()
        self.rounds = self.accepted = 0

    def add(self, rounds: int, accepted: int) -> None:
        self.entries.append((rounds, accepted))
        self.rounds += rounds
        self.accepted += accepted
        if len(self.entries) > self.size:
            r, a = self.entries.popleft()
            self.rounds -= r
            self.accepted -= a

    @property
    def full(self) -> bool:
        return len(self.entries) >= self.size

    @property
    def tau(self) -> float | None:
        return 1.0 + self.accepted / self.rounds if self.rounds else None


@dataclass
class DriftEvent:
    """An alert raised (`kind` "alert"), cleared ("clear") or held back by the label's rate limit ("suppressed")
    for one label."""

    kind: str
    category: str
    version: str | None
    window_tau: float
    reference_tau: float
    margin: float
    window: int
    at: float = field(default_factory=time.time)

    @property
    def threshold(self) -> float:
        return self.reference_tau - self.margin

    def to_dict(self) -> dict:
        return {"kind": self.kind, "category": self.category, "version": self.version,
                "window_tau": round(self.window_tau, 4), "reference_tau": self.reference_tau,
                "margin": self.margin, "threshold": round(self.threshold, 4), "window": self.window, "at": self.at}


@dataclass
class WindowSummary:
    """`requests` records of one label and version, aggregated for MLflow (`index`: 0, 1, ... per label)."""

    category: str
    version: str | None
    index: int
    requests: int
    draft_rounds: int
    accepted: int
    drift_rounds: int
    drift_accepted: int
    rounds_by_mode: dict[str, int]

    @property
    def tau(self) -> float | None:
        return 1.0 + self.accepted / self.draft_rounds if self.draft_rounds else None

    @property
    def tree_tau(self) -> float | None:
        return 1.0 + self.drift_accepted / self.drift_rounds if self.drift_rounds else None

    def metrics(self) -> dict[str, float]:
        """Flat MLflow metrics, keyed `<name>/<label>`."""
        out = {"requests": self.requests, "draft_rounds": self.draft_rounds,
               "accept_length_mean": self.accepted / self.draft_rounds if self.draft_rounds else 0.0}
        if self.tau is not None:
            out["tau"] = self.tau
        if self.tree_tau is not None:
            out["tree_tau"] = self.tree_tau
        total = sum(self.rounds_by_mode.values())
        for mode, n in self.rounds_by_mode.items():
            out[f"round_share_{mode}"] = n / total
        return {f"{k}/{self.category}": float(v) for k, v in out.items()}


class _Label:
    """One label's state: the drift window, whether its alert is raised, and the summary being accumulated."""

    def __init__(self, window: int):
        self.window = SlidingTau(window)
        self.alerting = False
        self.held = False  # below the threshold, its alert held back by the label's rate limit
        self.index = 0
        self.reset_summary()

    def reset_summary(self) -> None:
        self.requests = self.rounds = self.accepted = self.drift_rounds = self.drift_accepted = 0
        self.modes: dict[str, int] = {}


class AcceptanceTracker:
    """Per label: the sliding drift window of `window` requests and, every `summary_every` requests, a
    `WindowSummary`. `observe` returns what the caller must report: summaries (to MLflow) and drift events (to
    the alert gauge, MLflow and the hook). Not thread-safe: one caller (the replica's event loop) at a time.

    `alert_interval_s`: each label raises at most one alert per this many seconds of `clock` (0: no limit); when
    it last did is kept across versions and references."""

    def __init__(self, window: int = 64, margin: float = 0.3, reference_tau: float | None = None,
                 version: str | None = None, max_labels: int = 16, summary_every: int | None = None,
                 alert_interval_s: float = 0.0, clock=time.monotonic):
        if window < 1 or margin < 0 or alert_interval_s < 0:
            raise ValueError("window must be >= 1, margin and alert_interval_s >= 0")
        self.window, self.margin = window, margin
        self.alert_interval_s, self.clock = alert_interval_s, clock
        self.last_alert: dict[str, float] = {}  # label -> when it last raised an alert (survives version changes)
        self.summary_every = summary_every or window
        self.cap = LabelCap(max_labels)
        self.version: str | None = version
        self.reference_tau: float | None = reference_tau
        self.labels: dict[str, _Label] = {}

    def set_reference(self, version: str | None, reference_tau: float | None) -> None:
        """A new served version or reference: every window and alert starts afresh (acceptance is the draft's)."""
        if (version, reference_tau) != (self.version, self.reference_tau):
            self.version, self.reference_tau = version, reference_tau
            self.labels = {}

    @property
    def threshold(self) -> float | None:
        return None if self.reference_tau is None else self.reference_tau - self.margin

    def window_tau(self, category: str) -> float | None:
        state = self.labels.get(category)
        return None if state is None else state.window.tau

    def alerting(self, category: str) -> bool:
        state = self.labels.get(category)
        return state is not None and state.alerting

    def observe(self, record: AcceptanceRecord) -> tuple[list[WindowSummary], list[DriftEvent]]:
        """Account one finished request (its `category` already folded by the cap)."""
        if record.version != self.version:
            return [], []  # decoded by a draft no longer served: not this version's acceptance
        state = self.labels.setdefault(record.category, _Label(self.window))
        summaries = self._summarise(state, record)
        rounds, accepted = record.drift_rounds
        if not rounds:
            return summaries, []
        state.window.add(rounds, accepted)
        if self.reference_tau is None or not state.window.full:
            return summaries, []
        tau = state.window.tau
        below = tau < self.reference_tau - self.margin
        if not below:
            state.held = False  # a later crossing is a new one
        if below == state.alerting:
            return summaries, []
        kind = "alert" if below else "clear"
        if below:
            now = self.clock()
            last = self.last_alert.get(record.category)
            if last is not None and now - last < self.alert_interval_s:
                if state.held:
                    return summaries, []  # still held back: counted once per crossing
                state.held = True
                kind = "suppressed"
            else:
                self.last_alert[record.category] = now
                state.alerting, state.held = True, False
        else:
            state.alerting = False
        event = DriftEvent(kind, record.category, self.version, tau, self.reference_tau, self.margin, self.window)
        return summaries, [event]

    def _summarise(self, state: _Label, record: AcceptanceRecord) -> list[WindowSummary]:
        state.requests += 1
        state.rounds += len(record.accept_lengths)
        state.accepted += sum(record.accept_lengths)
        state.drift_rounds, state.drift_accepted = (a + b for a, b in zip((state.drift_rounds, state.drift_accepted),
                                                                         record.drift_rounds))
        for mode, n in record.modes.items():
            state.modes[mode] = state.modes.get(mode, 0) + n
        if state.requests < self.summary_every:
            return []
        summary = WindowSummary(record.category, self.version, state.index, state.requests, state.rounds,
                                state.accepted, state.drift_rounds, state.drift_accepted, dict(state.modes))
        state.index += 1
        state.reset_summary()
        return [summary]
