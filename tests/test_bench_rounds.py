"""bench.rounds: the phase timer changes no token, puts every function back, and splits a round into phases that add
up to it (exclusive times: no phase counted twice, none lost)."""

from types import SimpleNamespace

import pytest
import torch

from bench import rounds
from decode_helpers import damped_tiny_llama, echo_draft, random_prompts, single_thread  # noqa: F401 (autouse fixture)
from eagle_core import decoding
from eagle_core.generate import generate
from eagle_core.tree import TreeConfig

TREE = TreeConfig(4, 2, 6, context_chain=5)


@pytest.fixture(scope="module")
def models():
    target = damped_tiny_llama(0.5, dtype=torch.float32, seed=3)
    return target, echo_draft(target)


@pytest.fixture(scope="module")
def prompts():
    # repeated spans, so the context chain finds matches and is grafted
    return [p * 3 for p in random_prompts(3, 512, lo=6, hi=10, seed=5)]


def test_timing_changes_no_token_and_restores_the_functions(models, prompts):
    target, draft = models
    originals = {(o, n): o.__dict__[n] for o, n, _ in rounds.PHASES}
    plain = generate(target, prompts, max_new_tokens=24, mode="plain")
    with rounds.PhaseTimer(target.device) as timer:
        assert decoding.draft_tree is not originals[(decoding, "draft_tree")]
        timed = generate(target, prompts, draft=draft, tree=TREE, max_new_tokens=24, mode="context")
    assert timed.tokens == plain.tokens
    assert {(o, n): o.__dict__[n] for o, n, _ in rounds.PHASES} == originals
    assert timer.rounds["context"] == max(s.rounds for s in timed.stats)  # the batch steps until its last row ends


def test_phases_add_up_to_the_rounds(models, prompts):
    target, draft = models
    args = SimpleNamespace(max_new_tokens=24, repeats=1)
    timer, totals, costs = rounds.run(args, target, draft, None, prompts, TREE,
                                      rounds.cost_cases(target, draft, TREE, context_tokens=32))
    costs["context_tokens"] = 32
    phases = timer.per_round("context")
    for phase in ("context lookup", "draft tree", "graft chain", "verify forward", "acceptance", "draft extend",
                  "target cache keep", "bookkeeping"):
        assert phases.get(phase, 0.0) > 0.0, phase
    assert "target forward" not in phases  # the verify's forward is inside "verify forward", counted once
    assert {"target forward", "head", "sample"} <= set(timer.per_round("plain"))
    for mode, total in totals.items():
        in_rounds = sum(timer.per_round(mode).values()) * timer.rounds[mode] / 1000
        # every round's time is in its phases (exclusive times sum to the rounds), and the rounds are inside the
        # decode time (the loop around them is what is left)
        assert 0.5 * total["seconds"] < in_rounds <= total["seconds"] * 1.001, mode
        assert timer.rounds[mode] == total["rounds"]
    summary = rounds.summarize(timer, totals, TREE, costs)
    assert summary["tau"] > 1.0
    assert summary["round_ms"]["context"] == pytest.approx(sum(summary["phases_ms"]["context"].values()))
    # the cost model prices a round at a draft plus a verify of 2+ tokens, which its non-decreasing forward curve
    # puts at or above its one-token step (compared with the curve, not with a raw timing that noise can invert)
    assert summary["model_round_ms"] > summary["model_step_ms"] > 0
    meta = dict(dtype="float32", tree=str(TREE), command="python -m bench.rounds", date="today", machine="cpu",
                target="tiny", draft="echo", prompt_set="random", prompts=len(prompts), max_new_tokens=24)
    text = rounds.markdown(dict(meta=meta, summary=summary, costs=costs))
    assert "| verify forward |" in text and "plain steps" in text
