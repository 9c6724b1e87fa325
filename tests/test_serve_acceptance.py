"""Acceptance as a live signal (issue 43, part 1): the per-label windows and the drift rule, pure Python.

Properties:
- The alert is raised exactly when the pooled tree tau of the label's last N requests first falls below
  reference - margin, never before the window holds N requests, once per crossing; it clears exactly when the
  window is back at or above the threshold; checked step by step against a brute-force recomputation on random
  traffic, and on a hand-made sequence.
- Only tree ("context") rounds enter the drift window: chain and plain rounds (the load fallback) do not raise it.
- Labels are kept apart; beyond the cap they fold into "other"; a malformed label is refused.
- Records of a version no longer served are not counted; a new version or reference starts afresh.
- A summary is produced every N requests of a label, with its pooled tau.
- Alerts are rate-limited per label, across versions (a flooded label cannot steer retraining alert after alert).
- The reporter calls a drift hook once per alert (at most once per cooldown), as a callable or a command that
  gets the event on stdin, and survives a hook that fails (counted as dropped).
"""

import json
import math
import random
import sys

import pytest

from pipelines.serve.acceptance import (DEFAULT_LABEL, OTHER_LABEL, AcceptanceRecord, AcceptanceTracker, DriftEvent,
                                        LabelCap, check_label)


def rec(tree: tuple[int, int], category: str = DEFAULT_LABEL, version: str | None = "3",
        chain: tuple[int, int] = (0, 0), plain: int = 0) -> AcceptanceRecord:
    """A request with `tree` = (rounds, accepted) in tree mode (spread evenly), `chain` likewise, `plain` rounds."""
    lengths = []
    for rounds, accepted in (tree, chain):
        lengths += [accepted // rounds + (i < accepted % rounds) for i in range(rounds)] if rounds else []
    by_mode = {m: v for m, v in (("tree", tree), ("chain", chain)) if v[0]}
    modes = {**{m: v[0] for m, v in by_mode.items()}, **({"plain": plain} if plain else {})}
    return AcceptanceRecord(category, version, tuple(lengths), by_mode, modes)


def test_alert_fires_once_after_the_window_fills_and_clears_on_recovery():
    t = AcceptanceTracker(window=4, margin=0.5, reference_tau=3.0, version="3")  # threshold 2.5
    low, high = rec((4, 2)), rec((4, 12))  # tau 1.5 and 4.0
    kinds = []
    for r in [low, low, low]:
        kinds += [e.kind for e in t.observe(r)[1]]
    assert kinds == [] and not t.alerting(DEFAULT_LABEL)  # three low requests: no decision before N = 4
    _, events = t.observe(low)
    assert [e.kind for e in events] == ["alert"] and t.alerting(DEFAULT_LABEL)
    assert events[0].window_tau == pytest.approx(1.5) and events[0].threshold == pytest.approx(2.5)
    for _ in range(5):
        assert t.observe(low)[1] == []  # still below: no second alert
    # recovery: windows [l,l,l,h] 2.125, [l,l,h,h] 2.75 >= 2.5 -> clear at the second high request
    assert t.observe(high)[1] == []
    _, events = t.observe(high)
    assert [e.kind for e in events] == ["clear"] and not t.alerting(DEFAULT_LABEL)
    assert t.observe(high)[1] == []
    # a second crossing below raises a second alert: [h,h,l,l] 2.75, [h,l,l,l] 2.125
    assert t.observe(low)[1] == [] and t.observe(low)[1] == []
    assert [e.kind for e in t.observe(low)[1]] == ["alert"]


def test_alerts_match_a_brute_force_recomputation_on_random_traffic():
    rng = random.Random(0)
    window, margin, reference = 8, 0.3, 2.6
    t = AcceptanceTracker(window=window, margin=margin, reference_tau=reference, version="3")
    history, alerting, raised = [], False, 0
    for i in range(3000):
        # drifting traffic: acceptance moves slowly up and down, so the threshold is crossed many times
        level = 1.5 + 1.2 * (1 + math.sin(i / 60)) / 2
        rounds = rng.randint(1, 6)
        accepted = sum(rng.random() < (level - 1) / 3 for _ in range(rounds * 3))
        record = rec((rounds, accepted), chain=(rng.randint(0, 3), 0))  # chain rounds must not count
        _, events = t.observe(record)
        history.append((rounds, accepted))
        last = history[-window:]
        tau = 1 + sum(a for _, a in last) / sum(r for r, _ in last)
        expected = alerting
        if len(history) >= window:
            expected = tau < reference - margin
        want = [] if expected == alerting else ["alert" if expected else "clear"]
        assert [e.kind for e in events] == want, (i, tau)
        if events:
            assert events[0].window_tau == pytest.approx(tau)
        raised += want == ["alert"]
        alerting = expected
        assert t.alerting(DEFAULT_LABEL) == alerting
    assert raised >= 5  # the sequence really crossed, repeatedly


def test_only_tree_rounds_enter_the_drift_window():
    t = AcceptanceTracker(window=2, margin=0.1, reference_tau=3.0, version="3")
    for _ in range(10):  # chain rounds at tau 1 and plain rounds: the load fallback, not drift
        assert t.observe(rec((0, 0), chain=(5, 0), plain=3))[1] == []
    assert t.window_tau(DEFAULT_LABEL) is None
    t.observe(rec((2, 0), chain=(5, 15)))  # a tree tau of 1 with good chains still counts as its tree rounds
    assert [e.kind for e in t.observe(rec((2, 0)))[1]] == ["alert"]


def test_labels_are_kept_apart_and_capped():
    t = AcceptanceTracker(window=2, margin=0.0, reference_tau=2.0, version="3")
    for _ in range(2):
        t.observe(rec((1, 0), category="code"))
        t.observe(rec((1, 3), category="chat"))
    assert t.alerting("code") and not t.alerting("chat")
    assert t.window_tau("code") == pytest.approx(1.0) and t.window_tau("chat") == pytest.approx(4.0)
    cap = LabelCap(3)
    assert [cap.fold(x) for x in ("a", "b", "c", "a", DEFAULT_LABEL, OTHER_LABEL)] == \
        ["a", "b", OTHER_LABEL, "a", DEFAULT_LABEL, OTHER_LABEL]


def test_alerts_are_rate_limited_per_label_across_versions():
    """Issue 54 (13): a label raises at most one alert per `alert_interval_s`, even after a new version (the draft
    retrained on a flooding client's traffic) starts the windows afresh; a crossing within the interval is one
    "suppressed" event, and the alert comes at the first request past the interval if the window is still below.
    Other labels are not held back by it."""
    now = [1000.0]
    t = AcceptanceTracker(window=1, margin=0.0, reference_tau=3.0, version="3", alert_interval_s=100,
                          clock=lambda: now[0])
    low, high = rec((4, 0), category="code"), rec((4, 12), category="code")  # tau 1 and 4 against 3

    def kinds(r):
        return [e.kind for e in t.observe(r)[1]]

    assert kinds(low) == ["alert"] and t.alerting("code")
    assert kinds(high) == ["clear"]
    now[0] += 10
    assert kinds(low) == ["suppressed"] and not t.alerting("code")  # within the interval: held back, once
    assert kinds(low) == [] and kinds(low) == []
    assert kinds(rec((4, 0), category="chat")) == ["alert"]  # another label alerts
    t.set_reference("4", 3.0)  # the retrained draft is served: windows start afresh, the limit stays
    assert kinds(rec((4, 0), category="code", version="4")) == ["suppressed"]
    assert kinds(rec((4, 12), category="code", version="4")) == []  # back above: nothing was raised to clear
    assert kinds(rec((4, 0), category="code", version="4")) == ["suppressed"]  # a new crossing, counted again
    now[0] += 95  # 105 s after the alert
    assert kinds(rec((4, 0), category="code", version="4")) == ["alert"] and t.alerting("code")
    assert kinds(rec((4, 12), category="code", version="4")) == ["clear"]
    with pytest.raises(ValueError, match="alert_interval_s"):
        AcceptanceTracker(alert_interval_s=-1)


@pytest.mark.parametrize("label", ["", "x" * 65, "a b", "a/b", "é", "a\nb", 'a"b', "a{b}"])
def test_malformed_labels_are_refused(label):
    with pytest.raises(ValueError, match="1-64 characters"):
        check_label(label)


def test_no_reference_means_no_alert_and_versions_are_kept_apart():
    t = AcceptanceTracker(window=1, margin=0.0, reference_tau=None, version="3")
    assert t.observe(rec((4, 0)))[1] == []  # no champion tau known: drift rule off
    t.set_reference("4", 3.0)
    assert t.observe(rec((4, 0), version="3"))[1] == []  # a request that finished on the old draft
    assert t.window_tau(DEFAULT_LABEL) is None
    assert [e.kind for e in t.observe(rec((4, 0), version="4"))[1]] == ["alert"]
    t.set_reference("4", 1.0)  # a new reference starts the windows and alerts afresh
    assert not t.alerting(DEFAULT_LABEL) and t.observe(rec((4, 0), version="4"))[1] == []


def test_a_summary_every_window_of_requests():
    t = AcceptanceTracker(window=3, margin=0.3, reference_tau=None, version="3")
    out = [t.observe(rec((2, 4), chain=(2, 0), plain=1))[0] for _ in range(7)]
    summaries = [s for batch in out for s in batch]
    assert [s.index for s in summaries] == [0, 1] and all(s.requests == 3 for s in summaries)
    metrics = summaries[0].metrics()
    assert metrics["tau/default"] == pytest.approx(2.0)  # (4 accepted over 4 draft rounds) + 1
    assert metrics["tree_tau/default"] == pytest.approx(3.0)
    assert metrics["round_share_plain/default"] == pytest.approx(1 / 5)


def _event(kind="alert", category="code"):
    return DriftEvent(kind, category, "3", 1.2, 2.0, 0.3, 4)


def hook_calls(event):  # a drift hook given as "test_serve_acceptance:hook_calls"
    CALLS.append(event)


CALLS: list = []


def test_reporter_calls_the_hook_once_per_alert_within_the_cooldown(tmp_path):
    from pipelines.serve.acceptance_report import AcceptanceReporter, resolve_hook

    CALLS.clear()
    dropped = []
    hook = resolve_hook("test_serve_acceptance:hook_calls", 5)
    reporter = AcceptanceReporter("", None, hook, hook_cooldown_s=3600, on_drop=dropped.append)
    for item in (_event(), _event("clear"), _event(category="chat")):
        reporter.submit(item)
    assert reporter.flush(10)
    assert [(c["kind"], c["category"]) for c in CALLS] == [("alert", "code")]  # the second alert: cooldown
    reporter.close()

    out = tmp_path / "event.json"  # a command gets the event on stdin
    script = f"import sys; open({str(out)!r}, 'w').write(sys.stdin.read())"
    reporter = AcceptanceReporter("", None, resolve_hook(f"{sys.executable} -c \"{script}\"", 30), 0,
                                  on_drop=dropped.append)
    reporter.submit(_event())
    assert reporter.flush(30)
    assert json.loads(out.read_text())["category"] == "code" and not dropped
    reporter.hook = resolve_hook(f"{sys.executable} -c \"import sys; sys.exit(3)\"", 30)
    reporter.submit(_event())  # a failing hook: dropped and counted, the reporter goes on
    reporter.submit(_event("clear"))
    assert reporter.flush(30) and dropped == [1] and reporter.thread.is_alive()
    reporter.close()
    with pytest.raises(ValueError):
        resolve_hook("   ", 1)
