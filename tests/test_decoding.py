"""The decoding state that `generate` and the serving engine both drive: plain steps of a speculative batch
defer the draft's update exactly; rows join and leave; the engine (no Ray) switching tree/chain/plain per
round while requests join mid-flight still returns plain decoding for every request -- greedy, and sampled:
a seed means the same tokens with or without speculation, in any mode and any batch."""


import pytest
import torch

from decode_helpers import (IdTokenizer, damped_tiny_llama, echo_draft, random_prompts, run_engine,  # noqa: F401
                            single_thread)  # (autouse fixture)
from eagle_core.decoding import DecodingState
from eagle_core.generate import generate
from eagle_core.target import make_tiny_llama
from eagle_core.tree import TreeConfig
from eagle_core.verify import SamplingConfig


def test_deferred_draft_catch_up_equals_step_by_step():
    """Plain fallback steps queue the draft's inputs; one catch-up forward must leave the draft's cache and
    hidden state exactly as extending it after every step would (so trees resume with the right context)."""
    torch.manual_seed(0)
    target = make_tiny_llama()
    draft = echo_draft(target)
    greedy = SamplingConfig()
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]

    with torch.inference_mode():
        (step_by_step, _), (deferred, _) = (DecodingState.prefill(target, draft, prompts, greedy) for _ in range(2))
        for _ in range(5):
            step_by_step.step("plain")
            step_by_step.catch_up_draft_()
            deferred.step("plain")
        deferred.catch_up_draft_()
    assert torch.equal(step_by_step.root, deferred.root)
    assert torch.equal(step_by_step.dkv.lengths, deferred.dkv.lengths)
    for a, b, lengths in ((step_by_step.dkv.k, deferred.dkv.k, deferred.dkv.lengths),
                          (step_by_step.dkv.v, deferred.dkv.v, deferred.dkv.lengths)):
        for row, n in enumerate(lengths.tolist()):
            torch.testing.assert_close(a[row, :, :n], b[row, :, :n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step_by_step.draft_hidden, deferred.draft_hidden, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def damped():
    return damped_tiny_llama(0.8, dtype=torch.float64, seed=3)


SAMPLINGS = [SamplingConfig(), SamplingConfig(temperature=0.9, top_p=0.95, top_k=50)]


@pytest.mark.parametrize("context", [0, 5], ids=["no-context", "context-chain"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
@torch.inference_mode()
def test_mixed_modes_select_and_merge_equal_plain(damped, sampling, context):
    """Rows decoded with a different mode every round, some leaving and a new group joining mid-way; with a
    context chain, "context" rounds too (the rows' lookup texts follow them through plain rounds, leaving and
    joining)."""
    prompts = random_prompts(5, 512, seed=5)
    config = TreeConfig(3, 4, 10, context_chain=context)
    plain = generate(damped, prompts, max_new_tokens=40, temperature=sampling.temperature, top_p=sampling.top_p,
                     top_k=sampling.top_k, seed=100).tokens  # row i samples with seed 100 + i
    draft = echo_draft(damped)
    state, step = DecodingState.prefill(damped, draft, prompts[:3], sampling, config, [100, 101, 102])
    rows = [0, 1, 2]
    out = {i: list(t) for i, t in zip(rows, step.tokens)}
    modes = ["tree", "plain", "plain", "chain", "plain", "tree", "tree", "chain"] * 4
    if context:
        modes = ["context", "plain", "plain", "context", "tree", "context", "chain", "context"] * 4
    for r, mode in enumerate(modes):
        if r == 2:  # row 1 leaves
            state.select_rows_([0, 2])
            rows = [0, 2]
        if r == 3:  # two new requests join (after deferred plain steps of the old rows)
            new, first = DecodingState.prefill(damped, draft, prompts[3:], sampling, config, [103, 104])
            state.merge_(new)
            rows += [3, 4]
            out.update({i: list(t) for i, t in zip([3, 4], first.tokens)})
        step = state.step(mode)
        for i, tokens in zip(rows, step.tokens):
            out[i] += tokens
    for i, tokens in out.items():
        n = min(len(tokens), len(plain[i]))
        assert tokens[:n] == plain[i][:n] and n >= (20 if i != 1 else 2)
    if context:  # each row's lookup text is its prompt and everything it committed, in its own row
        texts = {i: p + out[i] for i, p in enumerate(prompts)}
        assert [index.tokens for index in state.context] == [texts[i] for i in rows]


def test_decoding_under_no_grad_grows_its_caches_and_equals_plain(damped):
    """The decoding state under `torch.no_grad()`, not only inference mode: trees wide enough to outgrow both
    caches' spare room inside a round (a buffer made there must stay writable by the plain steps and draft
    extensions that follow) still give plain decoding's tokens."""
    prompts = random_prompts(2, 512, seed=7)
    plain = generate(damped, prompts, max_new_tokens=60).tokens
    with torch.no_grad():
        state, step = DecodingState.prefill(damped, echo_draft(damped), prompts, SamplingConfig(), TreeConfig(10, 8, 80))
        out = [list(t) for t in step.tokens]
        buffers = lambda: (state.kv.cache.layers[0].keys.data_ptr(), state.dkv.k.data_ptr())  # noqa: E731
        first = buffers()
        for mode in ["tree", "plain", "tree", "chain", "tree", "plain", "tree"] * 2:
            for row, tokens in zip(out, state.step(mode).tokens):
                row += tokens
            if mode == "tree" and first is not None:
                assert all(a != b for a, b in zip(first, buffers()))  # both caches moved to bigger buffers
                first = None
    for tokens, reference in zip(out, plain):
        n = min(len(tokens), len(reference))
        assert tokens[:n] == reference[:n] and n >= 20


@pytest.mark.parametrize("context", [0, 6], ids=["no-context", "context-chain"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
def test_engine_auto_modes_and_admission_equal_plain(damped, sampling, context):
    """The engine without Ray: auto policy (every mode measured, "context" too where the tree has a context chain),
    requests arriving while others decode (ragged rows, each with its own lookup text); three extra copies of the
    first request (same seed) get its tokens whatever their rounds' modes."""
    from pipelines.serve.engine import Engine, EngineConfig

    prompts = random_prompts(6, 512, seed=9)
    if context:  # prompts that repeat a span of themselves: lookups match
        prompts = [p + p[: 3 + i] for i, p in enumerate(prompts)]
    plain = generate(damped, prompts, max_new_tokens=16, temperature=sampling.temperature, top_p=sampling.top_p,
                     top_k=sampling.top_k, seed=100).tokens
    prompts, plain, seeds = prompts + prompts[:1] * 3, plain + plain[:1] * 3, list(range(100, 106)) + [100] * 3
    engine = Engine(damped, IdTokenizer(), echo_draft(damped),
                    EngineConfig(TreeConfig(3, 4, 10, context_chain=context), max_batch_size=4, max_waiting=8,
                                 explore_every=2))
    done = run_engine(engine, [(p, 16, sampling, seed) for p, seed in zip(prompts, seeds)])
    modes = set()
    for i in range(len(prompts)):
        assert done[i].kind == "done", done[i].text
        assert done[i].token_ids == plain[i]
        modes |= {m for m, n in done[i].stats.modes.items() if n}
    assert modes == {"tree", "chain", "plain"} | ({"context"} if context else set())


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.1, top_k=50)],
                         ids=["greedy", "sampled"])  # cold: the tiny model's logits are flat
@torch.inference_mode()
def test_a_tree_round_says_what_a_chain_would_have_accepted(damped, sampling):
    """`Step.also["chain"]` (the auto policy compares tree and chain on the same rounds with it): from the same
    state, a chain round accepts exactly what the tree round's counterfactual says when the tree holds every
    candidate of two levels (so every node the chain would draft), and no more than it where a deeper tree
    was pruned."""
    prompts = random_prompts(16, 512, seed=11)
    seeds = list(range(300, 316))  # seeds where the sampled tree round accepts more than the chain (non-trivial)
    draft = echo_draft(damped)
    with torch.no_grad():  # a noisy head: its best guess is often wrong where a sibling is right
        head = draft.get_parameter("lm_head.weight")
        head.add_(2 * head.std() * torch.randn(head.shape, generator=torch.Generator().manual_seed(0), dtype=head.dtype))
    for tree, exact in ((TreeConfig(4, 2, 20), True), (TreeConfig(3, 4, 6), False)):
        rounds = {}
        for mode in ("tree", "chain"):
            state, _ = DecodingState.prefill(damped, draft, prompts, sampling, tree, seeds)
            rounds[mode] = state.step(mode)
        tree_step, chain_step = rounds["tree"], rounds["chain"]
        assert tree_step.also["plain"] == chain_step.also["plain"] == len(prompts)
        assert chain_step.committed == len(prompts) + sum(chain_step.accept_lengths)
        if exact:
            assert tree_step.also["chain"] == chain_step.committed
            # not trivial: the tree accepted more than the chain somewhere, and the chain accepted something
            assert tree_step.committed > chain_step.committed > len(prompts)
        else:
            assert tree_step.also["chain"] <= chain_step.committed


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.1, top_k=50)],
                         ids=["greedy", "sampled"])  # cold: lookups match the damped target's repetitions
@torch.inference_mode()
def test_tree_and_context_rounds_say_what_the_other_would_have_committed(damped, sampling):
    """`Step.also` between "tree" and "context" (the auto policy weighs the context chain with it): from the same
    state, a tree round commits exactly what a context round says the tree alone would have; a context round
    commits at least what a tree round says it would have, exactly where the chain disagreed within the tree
    round's tokens."""
    prompts = [p + p[:5] for p in random_prompts(12, 512, seed=13)]
    seeds = list(range(300, 312))
    draft = echo_draft(damped)
    with torch.no_grad():  # a noisy head: the tree alone misses often, so the chain adds something
        head = draft.get_parameter("lm_head.weight")
        head.add_(2 * head.std() * torch.randn(head.shape, generator=torch.Generator().manual_seed(1), dtype=head.dtype))
    config = TreeConfig(3, 3, 6, context_chain=6)
    compared = 0
    for warm in range(4):  # rounds from a few different states
        steps = {}
        for mode in ("tree", "context"):
            state, _ = DecodingState.prefill(damped, draft, prompts, sampling, config, seeds)
            for _ in range(warm):
                state.step("plain")
            steps[mode] = state.step(mode)
        tree_step, context_step = steps["tree"], steps["context"]
        assert context_step.also["tree"] == tree_step.committed
        assert context_step.committed >= tree_step.also["context"] >= tree_step.committed
        if context_step.round.tree.draft_size is not None:
            compared += 1
    assert compared >= 2
    assert context_step.committed > tree_step.committed  # the chain added tokens somewhere


def test_the_engines_static_policy_runs_the_context_chain_where_it_runs_trees():
    from pipelines.serve.engine import EngineConfig, choose_mode

    with_chain = EngineConfig(TreeConfig(3, 4, 10, context_chain=8), tree_max_batch=2, chain_max_batch=4)
    assert [choose_mode(b, with_chain, True) for b in (1, 2, 3, 5)] == ["context", "context", "chain", "plain"]
    assert choose_mode(1, EngineConfig(TreeConfig(3, 4, 10)), True) == "tree"
