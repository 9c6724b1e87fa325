"""The demo's last line says what the evaluation measured, about the draft that is served."""

from jobs.demo import result_line


def evaluation(speedup: float, promoted: bool) -> dict:
    candidate = {"tau": 1.7, "speedup": 0.5, "tree_speedup": 0.4, "tuned_tree": "candidate-tree"}
    champion = {"tau": 1.8, "speedup": speedup, "tree_speedup": 1.04, "tuned_tree": "champion-tree"}
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
    assert "tau 1.80" in kept and "champion-tree" in kept and "1.04x" in kept
    promoted = result_line(evaluation(1.2, promoted=True))
    assert "tau 1.70" in promoted and "candidate-tree" in promoted and "1.20x" in promoted
