"""The auto policy (`eagle_core.policy.ModeChooser`), which `generate()` and the serving engine share: it
measures every mode (plain included) per batch size and keeps the fastest, so speculation that does not pay
falls back to plain; and `generate(mode="auto")` stays lossless while it switches."""

import pytest
import torch

from decode_helpers import damped_tiny_llama, echo_draft, random_prompts, single_thread  # noqa: F401 (autouse fixture)
from eagle_core.generate import generate
from eagle_core.policy import ModeChooser
from eagle_core.tree import TreeConfig


def test_mode_chooser_measures_then_keeps_the_fastest_mode():
    """Auto fallback: every mode is tried per batch-size bucket, then the fastest runs, others re-measured."""
    chooser = ModeChooser(explore_every=8)
    speed = {(1, "tree"): 30.0, (1, "chain"): 20.0, (1, "plain"): 10.0,
             (16, "tree"): 40.0, (16, "chain"): 60.0, (16, "plain"): 90.0}
    picks = {1: [], 16: []}
    for _ in range(64):
        for batch in (1, 12):  # 12 rows fall in the bucket of 16
            mode = chooser.choose(batch)
            picks[1 if batch == 1 else 16].append(mode)
            chooser.record(batch, mode, tokens=int(speed[(ModeChooser.bucket(batch), mode)]), seconds=1.0)
    for bucket, best in ((1, "tree"), (16, "plain")):
        assert set(picks[bucket][:3]) == {"tree", "chain", "plain"}  # measured first
        later = picks[bucket][3:]
        assert later.count(best) >= 0.8 * len(later)
        assert len(set(later)) == 3  # the others are still re-measured now and then


def test_one_unlucky_round_does_not_condemn_a_mode():
    """Rates are ratios of decayed sums: tree pays 3 tokens a round on average but its first round got 1."""
    chooser = ModeChooser(modes=("tree", "plain"), explore_every=0, warmup_rounds=2)
    tree_tokens = iter([1, 5, 3, 3, 3, 3, 3, 3])
    picks = []
    for _ in range(8):
        mode = chooser.choose(1)
        picks.append(mode)
        tree = mode == "tree"
        chooser.record(1, mode, tokens=next(tree_tokens) if tree else 1, seconds=1.5 if tree else 1.0)
    assert picks[:4] == ["tree", "plain", "tree", "plain"]
    assert picks[4:] == ["tree"] * 4  # 2 tokens/s against plain's 1, although round one alone said 0.67


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_generate_auto_equals_plain_and_uses_every_mode(temperature):
    target = damped_tiny_llama(0.8, dtype=torch.float64, seed=3)
    prompts = random_prompts(3, 512, seed=4)
    kw = dict(max_new_tokens=24, temperature=temperature, top_k=50 if temperature else 0, seed=100)
    plain = generate(target, prompts, **kw)
    auto = generate(target, prompts, draft=echo_draft(target), tree=TreeConfig(4, 4, 12), mode="auto", **kw)
    assert auto.tokens == plain.tokens
    assert set().union(*(s.modes for s in auto.stats)) == {"tree", "chain", "plain"}
    assert all(s.modes == {"plain": s.rounds} for s in plain.stats)


def test_generate_rejects_an_unknown_mode(tiny_target):
    with pytest.raises(ValueError, match="mode must be"):
        generate(tiny_target, [[1, 2, 3]], draft=echo_draft(tiny_target), mode="fastest", max_new_tokens=2)


def test_a_clearly_losing_mode_is_remeasured_ever_less_often():
    """Re-measuring costs a losing round: the interval doubles while the mode keeps losing (8, 16, 32, ...)."""
    chooser = ModeChooser(modes=("tree", "plain"), explore_every=8, warmup_rounds=1, max_explore_every=64)
    picks = []
    for _ in range(400):
        mode = chooser.choose(1)
        picks.append(mode)
        chooser.record(1, mode, tokens=1, seconds=2.0 if mode == "tree" else 1.0)
    explored = [i for i, m in enumerate(picks) if m == "tree"][1:]  # after the warm-up round
    gaps = [b - a for a, b in zip(explored, explored[1:])]
    assert gaps[:3] == sorted(gaps[:3]) and gaps[0] < gaps[2]  # backing off
    assert max(gaps) <= 64 + 1 and len(explored) >= 5  # but never forgotten


def test_modes_are_compared_on_the_same_rounds():
    """A chain that met easy text in its own two rounds must not win over the tree, when the tree's rounds show
    what the chain would have accepted there (`Step.also`): the yields are compared on the same text."""
    chooser = ModeChooser(modes=("tree", "chain"), explore_every=0, warmup_rounds=2)
    picks = []
    for _ in range(12):
        mode = chooser.choose(1)
        picks.append(mode)
        if mode == "tree":  # 3 tokens a round; a chain would have committed 1 of them
            chooser.record(1, "tree", tokens=3, seconds=1.2, also={"chain": 1, "plain": 1})
        else:  # the chain's own rounds happened to be easy ones
            chooser.record(1, "chain", tokens=3, seconds=1.0, also={"plain": 1})
    assert picks[:4] == ["tree", "chain", "tree", "chain"]
    assert picks[4:] == ["tree"] * 8


def test_a_hard_stretch_of_text_does_not_turn_speculation_off():
    """Trees pay 1.2x plain on average here; six rounds in a row where the draft gets nothing right (a table,
    a name) are a stretch of text, not a change of workload, and must not hand the rounds to plain."""
    chooser = ModeChooser(modes=("tree", "plain"), explore_every=0, warmup_rounds=2)
    rows = 10  # per row: 1.7 tokens per tree round at 1.4 plain steps
    for n in range(52):
        mode = chooser.choose(rows)
        if n >= 4:  # after the warm-up
            assert mode == "tree", n
        hard = 40 <= n < 46
        tokens = rows if mode == "plain" or hard else 17
        chooser.record(rows, mode, tokens=tokens, seconds=1.4 if mode == "tree" else 1.0, also={"plain": rows})


def test_a_primed_policy_starts_from_the_measurement_and_still_checks_it():
    """`prime` (the auto-tune's estimates): the primed modes need no warm-up coin flips, the unprimed one still
    gets its warm-up, plain keeps being re-measured on schedule, and measured rounds overturn a wrong prior."""
    chooser = ModeChooser(explore_every=8)
    chooser.prime(1, "tree", tokens=2.0, seconds=1.4)  # the auto-tune expected 1.43 tokens per plain-step time
    chooser.prime(1, "plain", tokens=1.0, seconds=1.0)
    picks = []
    for _ in range(200):
        mode = chooser.choose(1)
        picks.append(mode)
        # the truth here: the tree commits only 1.2 tokens a round (every fifth round 2), so plain pays
        tokens = {"tree": 2 if len(picks) % 5 == 0 else 1, "chain": 1, "plain": 1}[mode]
        chooser.record(1, mode, tokens, {"tree": 1.4, "chain": 1.2, "plain": 1.0}[mode], also={"plain": 1})
    assert picks[:2] == ["chain", "chain"] and picks[2] == "tree"
    assert "plain" in picks[3:12]  # re-measured after explore_every rounds, not backed off by the priming
    assert picks[-50:].count("plain") >= 40  # the measurements won
