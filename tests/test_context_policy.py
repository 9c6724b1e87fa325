"""The auto policy and the context chain: "context" (the tree with its chain) is one more mode, measured like the
others and kept only while it pays; `generate(mode="auto")` stays lossless while it switches."""

import pytest
import torch

from decode_helpers import damped_tiny_llama, echo_draft, random_prompts, single_thread  # noqa: F401 (autouse fixture)
from eagle_core.decoding import available_modes
from eagle_core.generate import generate
from eagle_core.policy import ModeChooser
from eagle_core.tree import TreeConfig


def test_the_context_mode_exists_only_with_a_context_chain():
    assert "context" not in available_modes(TreeConfig(4, 4, 8))
    assert "context" in available_modes(TreeConfig(4, 4, 8, context_chain=8))
    assert "context" not in available_modes(None)


@pytest.mark.parametrize("copying", [False, True], ids=["chat", "extraction"])
def test_the_chain_is_kept_only_where_it_pays(copying):
    """Rounds as `DecodingState.step` reports them: a context round costs 1.3x a tree round (the wider verify) and
    says what the tree alone would have committed; a tree round says what the chain would have added. On chat
    text the chain adds nothing and the policy settles on the tree; on text that copies its context it adds
    three tokens a round and the policy settles on the chain."""
    chooser = ModeChooser(("tree", "context", "plain"), explore_every=8)
    picks = []
    for n in range(120):
        mode = chooser.choose(1)
        picks.append(mode)
        tree_tokens = 2 + n % 2  # 2.5 a round
        context_tokens = tree_tokens + (3 if copying else 0)
        if mode == "tree":
            chooser.record(1, mode, tree_tokens, 1.0, also={"plain": 1, "context": context_tokens})
        elif mode == "context":
            chooser.record(1, mode, context_tokens, 1.3, also={"plain": 1, "tree": tree_tokens})
        else:
            chooser.record(1, mode, 1, 0.7)
    settled = picks[-60:]
    best = "context" if copying else "tree"
    assert settled.count(best) >= 50
    assert len(set(settled)) > 1  # the others are still re-measured now and then


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_generate_auto_with_a_context_chain_equals_plain_and_uses_every_mode(temperature):
    target = damped_tiny_llama(0.8, dtype=torch.float64, seed=3)
    prompts = [p + p[:5] for p in random_prompts(3, 512, seed=4)]
    kw = dict(max_new_tokens=24, temperature=temperature, top_k=50 if temperature else 0, seed=100)
    plain = generate(target, prompts, **kw)
    auto = generate(target, prompts, draft=echo_draft(target), tree=TreeConfig(4, 4, 12, context_chain=6),
                    mode="auto", **kw)
    assert auto.tokens == plain.tokens
    assert set().union(*(s.modes for s in auto.stats)) == {"tree", "context", "chain", "plain"}
