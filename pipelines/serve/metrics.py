"""Serving metrics, defined once, exported twice: to Ray's Prometheus export (cluster-wide, `ray_` prefix)
and in Prometheus text format at the replica's own `GET /metrics` (what one replica saw).

Speculative-decoding definitions (the same as `eagle_core.generate.RequestStats`):

* a *draft round* is one verification of one request's tree or chain (a batched round of B rows counts B);
  plain rounds of the load fallback propose nothing and are not draft rounds;
* `accept_length` of a draft round: draft tokens the target accepted, 0..depth, bonus token excluded;
* tau (mean accept length) = 1 + accepted_tokens / draft_rounds: tokens committed per target forward;
* per-position acceptance at depth d = accepted_at_position{position=d} / draft_rounds = P(accept_length >= d),
  non-increasing in d; their sum over d is tau - 1;
* draft vs verify time: wall time of each batched round in the draft (tree growth + cache extension) and
  in the target's verification forward with acceptance (`RoundOutput.draft_s` / `verify_s`).

Per `category` label (`pipelines.serve.acceptance`; at most `acceptance_max_labels` values, the rest "other"):
a finished request's tau over its draft rounds (`request_tau`, requests with no draft round are not observed),
every draft round's accept length (`category_accept_length`), rounds by mode (`category_rounds`); the drift
window's tree tau (`acceptance_window_tau`), the reference it is compared with (`acceptance_reference_tau`, -1
when none is known) and the alert (`drift_alert`: 1 while raised; `drift_alerts`: times raised;
`drift_alerts_suppressed`: crossings held back by the label's rate limit).

The traffic sink (`pipelines.traffic`, only when a deployment turns it on): conversations offered to it, sampled
out and written as rows (`traffic_records{outcome}`), rows dropped by reason (`traffic_dropped{reason}`: a store
failure, the size cap, a full queue, redaction, ...; "engine_error" for records lost before the sink), shards and
bytes committed. The sink keeps its own counters (`TrafficSink.stats`); they are copied in as counter increments
when /metrics is read and when a request finishes.
"""

from __future__ import annotations

import threading

PREFIX = "eagle3_serve_"
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ROUND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


_METHOD = {"counter": "inc", "histogram": "observe", "gauge": "set"}


class _Metric:
    """One metric in both backends. kind: counter | histogram | gauge."""

    def __init__(self, kind: str, name: str, doc: str, labels: tuple[str, ...] = (), buckets=None,
                 registry=None, use_ray: bool = False):
        import prometheus_client as prom

        self.kind, self.labels = kind, labels
        cls = {"counter": prom.Counter, "histogram": prom.Histogram, "gauge": prom.Gauge}[kind]
        extra = {"buckets": buckets} if kind == "histogram" else {}
        self.prom = cls(PREFIX + name, doc, labels, registry=registry, **extra)
        self.ray = None
        if use_ray:
            from ray.serve import metrics as ray_metrics

            ray_cls = {"counter": ray_metrics.Counter, "histogram": ray_metrics.Histogram,
                       "gauge": ray_metrics.Gauge}[kind]
            extra = {"boundaries": list(buckets)} if kind == "histogram" else {}
            self.ray = ray_cls(PREFIX + name, description=doc, tag_keys=labels, **extra)

    def record(self, value: float = 1.0, **labels) -> None:
        method = _METHOD[self.kind]
        getattr(self.prom.labels(**labels) if self.labels else self.prom, method)(value)
        if self.ray is not None and (self.kind != "counter" or value > 0):  # Ray counters refuse inc(0)
            getattr(self.ray, method)(value, tags={k: str(v) for k, v in labels.items()} or None)


class ServeMetrics:
    def __init__(self, depth: int, use_ray: bool = False):
        import prometheus_client as prom

        self.registry = prom.CollectorRegistry()
        self.depth = depth
        m = lambda *a, **k: _Metric(*a, registry=self.registry, use_ray=use_ray, **k)  # noqa: E731
        # Every answered API request once, errors included (route: completions | chat | models | other;
        # a stream counts when it ends: 200, or 500 when it failed after the status line went out).
        self.requests = m("counter", "requests", "HTTP requests by route and status code", ("route", "code"))
        self.latency = m("histogram", "request_latency_seconds", "end-to-end request latency", ("route",),
                         LATENCY_BUCKETS)
        self.prompt_tokens = m("counter", "prompt_tokens", "prompt tokens of finished requests")
        self.generated_tokens = m("counter", "generated_tokens", "tokens generated for finished requests")
        self.rounds = m("counter", "rounds", "batched target forwards after prefill, by decoding mode", ("mode",))
        self.batch_size = m("histogram", "batch_size", "rows decoded together per round", (), BATCH_BUCKETS)
        self.round_seconds = m("histogram", "round_seconds", "wall time per batched round: draft vs verify",
                               ("phase",), ROUND_BUCKETS)
        self.phase_seconds = m("counter", "phase_seconds", "total wall time in draft vs verify vs prefill",
                               ("phase",))
        self.draft_rounds = m("counter", "draft_rounds", "per-request tree/chain verifications (tau's denominator)")
        self.accepted_tokens = m("counter", "accepted_tokens", "draft tokens accepted (bonus excluded)")
        # Buckets at d + 0.5: `le="d.5"` counts accept_length <= d (Ray wants positive boundaries).
        self.accept_length = m("histogram", "accept_length", "draft tokens accepted per draft round", (),
                               tuple(d + 0.5 for d in range(depth)))
        self.accepted_at_position = m("counter", "accepted_at_position",
                                      "draft rounds whose accept_length reached this depth", ("position",))
        self.rejected = m("counter", "rejected", "requests refused with 503 (engine full)")
        self.cancelled = m("counter", "cancelled", "decoding rows dropped because their client went away or timed out")
        self.timeouts = m("counter", "timeouts", "requests that ran past request_timeout_s")
        # ---- acceptance per category label (pipelines/serve/acceptance.py) ----
        # tau of one request lies in [1, depth + 1]: quarter steps resolve the drift margin's scale (0.3 by default)
        self.request_tau = m("histogram", "request_tau", "tau over a finished request's draft rounds, by label",
                             ("category",), tuple(1 + q / 4 for q in range(4 * depth + 1)))
        self.category_accept_length = m("histogram", "category_accept_length",
                                        "draft tokens accepted per draft round, by label", ("category",),
                                        tuple(d + 0.5 for d in range(depth)))
        self.category_rounds = m("counter", "category_rounds", "rounds of finished requests by label and mode",
                                 ("category", "mode"))
        self.window_tau = m("gauge", "acceptance_window_tau", "tree tau over the label's drift window",
                            ("category",))
        self.reference_tau = m("gauge", "acceptance_reference_tau",
                               "the served draft's evaluation tau the drift rule compares with (-1: none known)")
        self.drift_alert = m("gauge", "drift_alert", "1 while the label's window tau is below reference - margin",
                             ("category",))
        self.drift_alerts = m("counter", "drift_alerts", "drift alerts raised, by label", ("category",))
        self.drift_alerts_suppressed = m("counter", "drift_alerts_suppressed",
                                         "drift alerts held back by the label's rate limit (drift_alert_interval_s)",
                                         ("category",))
        self.acceptance_dropped = m("counter", "acceptance_reports_dropped",
                                    "window summaries / drift events not reported (MLflow or the hook failed, "
                                    "or their queue was full)")
        self._metric = m  # metrics defined later (`enable_traffic`)
        self._traffic_seen: dict[tuple, float] = {}  # the sink's counters as last copied (increments go in)
        self._traffic_lock = threading.Lock()
        self._sources: list = []  # called before each exposition (`add_source`)
        # ---- the served draft (pipelines/serve/champion.py) ----
        self.draft_version = m("gauge", "draft_version", "the served draft's registry version (0: none, -1: a folder)")
        self.draft_confirmed_age = m("gauge", "draft_confirmed_age_seconds",
                                     "seconds since the registry last named the served draft (-1: not a registry draft)")
        self.draft_failed_polls = m("gauge", "draft_failed_polls", "registry lookups failed in a row")
        self.draft_stale = m("gauge", "draft_stale", "1 while draft_failed_polls >= draft_stale_polls")
        self.running = m("gauge", "running", "requests decoding")
        self.waiting = m("gauge", "waiting", "requests admitted, not decoding yet")

    # -- engine hooks (engine thread) --
    def on_prefill(self, rows: int, prompt_tokens: int, seconds: float) -> None:
        self.phase_seconds.record(seconds, phase="prefill")

    def on_round(self, mode: str, batch: int, draft_s: float, verify_s: float, accept_lengths: list[int]) -> None:
        self.rounds.record(1, mode=mode)
        self.batch_size.record(batch)
        for phase, seconds in (("draft", draft_s), ("verify", verify_s)):
            self.round_seconds.record(seconds, phase=phase)
            self.phase_seconds.record(seconds, phase=phase)
        self.on_draft_rounds(accept_lengths)

    def on_draft_rounds(self, accept_lengths: list[int]) -> None:
        """Draft rounds' accept lengths (ours per batched round; vLLM's per finished request, its steps)."""
        for n in accept_lengths:
            self.draft_rounds.record(1)
            self.accepted_tokens.record(n)
            self.accept_length.record(n)
            for d in range(1, n + 1):
                self.accepted_at_position.record(1, position=d)

    def on_cancel(self, rows: int) -> None:
        self.cancelled.record(rows)

    def on_timeout(self) -> None:
        self.timeouts.record(1)

    def on_finish(self, stats) -> None:
        self.prompt_tokens.record(stats.prompt_tokens)
        self.generated_tokens.record(stats.new_tokens)

    # -- acceptance hooks (the replica's event loop; pipelines/serve/acceptance.py) --
    def on_acceptance(self, record, window_tau: float | None) -> None:
        """One finished request's record (its label already folded by the cap)."""
        category = record.category
        if record.tau is not None:
            self.request_tau.record(record.tau, category=category)
        for n in record.accept_lengths:
            self.category_accept_length.record(n, category=category)
        for mode, rounds in record.modes.items():
            self.category_rounds.record(rounds, category=category, mode=mode)
        if window_tau is not None:
            self.window_tau.record(window_tau, category=category)

    def on_reference(self, reference_tau: float | None) -> None:
        self.reference_tau.record(-1.0 if reference_tau is None else reference_tau)

    def on_drift(self, event) -> None:
        if event.kind == "suppressed":
            self.drift_alerts_suppressed.record(1, category=event.category)
            return
        self.drift_alert.record(1.0 if event.kind == "alert" else 0.0, category=event.category)
        if event.kind == "alert":
            self.drift_alerts.record(1, category=event.category)

    def clear_drift(self, categories) -> None:
        """A new reference or version: the windows start afresh, so no alert stands."""
        for category in categories:
            self.drift_alert.record(0.0, category=category)

    def on_report_dropped(self, n: int = 1) -> None:
        self.acceptance_dropped.record(n)

    def on_draft(self, follower) -> None:
        status = follower.status()
        self.draft_version.record(follower.version_number())
        age = status.get("confirmed_s_ago")
        self.draft_confirmed_age.record(-1.0 if age is None else age)
        self.draft_failed_polls.record(status.get("failed_polls", 0))
        self.draft_stale.record(1.0 if status.get("stale") else 0.0)

    # -- the traffic sink --
    def enable_traffic(self) -> None:
        """Define the sink's metrics: only a replica whose sink is on exports them (off: no traffic_* series)."""
        m = self._metric
        self.traffic_records = m("counter", "traffic_records",
                                 "served conversations offered to the traffic sink, sampled out, written as rows",
                                 ("outcome",))
        self.traffic_dropped = m("counter", "traffic_dropped", "traffic sink records dropped, by reason", ("reason",))
        self.traffic_shards = m("counter", "traffic_shards", "traffic shards committed")
        self.traffic_bytes = m("counter", "traffic_bytes", "bytes of traffic shards committed")

    def on_traffic(self, stats: dict) -> None:
        """Copy `TrafficSink.stats()` (cumulative counters) in as increments since the last copy."""
        samples = [(self.traffic_records, {"outcome": "offered"}, stats.get("offered", 0)),
                   (self.traffic_records, {"outcome": "sampled_out"}, stats.get("sampled_out", 0)),
                   (self.traffic_records, {"outcome": "written"}, stats.get("rows", 0)),
                   (self.traffic_shards, {}, stats.get("shards", 0)),
                   (self.traffic_bytes, {}, stats.get("bytes", 0))]
        samples += [(self.traffic_dropped, {"reason": reason}, n) for reason, n in stats.get("dropped", {}).items()]
        with self._traffic_lock:
            _copy_increments(samples, self._traffic_seen)

    def add_source(self, sync) -> None:
        """`sync()` runs before each exposition (e.g. copying a component's own counters in)."""
        self._sources.append(sync)

    # -- vLLM's own spec-decode counters (pipelines/serve/vllm_engine.py) --
    def enable_vllm_spec(self, counts) -> None:
        """Export vLLM's engine-wide spec-decode counters (`SpecCounts`, read at each exposition): drafts, drafted and
        accepted tokens, accepted tokens per draft position, as vLLM's own /metrics names them."""
        m = self._metric
        self.vllm_drafts = m("counter", "vllm_spec_decode_drafts", "vLLM verification steps with a draft")
        self.vllm_draft_tokens = m("counter", "vllm_spec_decode_draft_tokens", "draft tokens vLLM verified")
        self.vllm_accepted = m("counter", "vllm_spec_decode_accepted_tokens", "draft tokens vLLM accepted")
        self.vllm_accepted_pos = m("counter", "vllm_spec_decode_accepted_tokens_per_pos",
                                   "draft tokens vLLM accepted, by draft position", ("position",))
        self._vllm_seen: dict = {}

        def sync() -> None:
            samples = [(self.vllm_drafts, {}, counts.num_drafts), (self.vllm_draft_tokens, {}, counts.num_draft_tokens),
                       (self.vllm_accepted, {}, counts.num_accepted_tokens)]
            samples += [(self.vllm_accepted_pos, {"position": str(i)}, n)
                        for i, n in enumerate(counts.accepted_per_pos)]
            _copy_increments(samples, self._vllm_seen)

        self.add_source(sync)

    # -- HTTP hooks --
    def on_response(self, route: str, code: int, seconds: float | None = None) -> None:
        self.requests.record(1, route=route, code=code)
        if seconds is not None:
            self.latency.record(seconds, route=route)
        if code == 503:
            self.rejected.record(1)

    def on_load(self, running: int, waiting: int) -> None:
        self.running.record(running)
        self.waiting.record(waiting)

    def exposition(self) -> bytes:
        import prometheus_client as prom

        for sync in self._sources:
            try:
                sync()
            except Exception:  # noqa: BLE001 -- a failing source must not take /metrics down
                pass
        return prom.generate_latest(self.registry)


def _copy_increments(samples, seen: dict) -> None:
    """Counters kept elsewhere as cumulative values -> our counters' increments since the last copy (`seen`)."""
    for metric, labels, value in samples:
        key = (id(metric), *sorted(labels.items()))
        delta = value - seen.get(key, 0)
        if delta > 0 or key not in seen:  # a first 0 too: the series shows up at 0
            metric.record(max(delta, 0), **labels)
            seen[key] = value
