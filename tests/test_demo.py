"""The demo's last line says what the evaluation measured, about the draft that is served."""

from dataclasses import asdict

from eagle_core.tree import TreeConfig
from jobs.demo import champion_evaluation, result_line


def evaluation(speedup: float, promoted: bool) -> dict:
    candidate = {"tau": 1.7, "speedup": 0.5, "tree_speedup": 0.4, "tuned_tree": asdict(TreeConfig(8, 1, 4))}
    champion = {"tau": 1.8, "speedup": speedup, "tree_speedup": 1.04, "tuned_tree": asdict(TreeConfig(8, 2, 12))}
    if promoted:
        candidate.update(speedup=speedup)
    return {**candidate, "promoted": promoted, "champion_tau": 1.8,
            **{f"champion_{k}": v for k, v in champion.items()}}


def test_the_verdict_agrees_with_the_printed_ratio():
    assert "1.00x plain greedy on this machine (as fast as plain" in result_line(evaluation(0.996, False))
    assert "0.99x plain greedy on this machine (slower than plain" in result_line(evaluation(0.994, False))
    assert "1.01x plain greedy on this machine (faster than plain" in result_line(evaluation(1.006, False))


def test_it_reports_the_champion_unless_the_candidate_was_promoted():
    kept = result_line(evaluation(0.98, promoted=False))
    assert "tau 1.80" in kept and "depth 2, 12 nodes" in kept and "1.04x" in kept
    promoted = result_line(evaluation(1.2, promoted=True))
    assert "tau 1.70" in promoted and "depth 1, 4 nodes" in promoted and "1.20x" in promoted
    # and the served tree is that draft's
    assert champion_evaluation(evaluation(0.98, promoted=False))["tuned_tree"]["total_tokens"] == 12
    assert champion_evaluation(evaluation(1.2, promoted=True))["tuned_tree"]["total_tokens"] == 4
