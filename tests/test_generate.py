"""The generator: plain loop == transformers greedy; speculative greedy == plain greedy for any draft;
seeded speculative sampling == seeded plain sampling, token for token; batch > 1 == one by one; stopping
rules; stats definitions."""

import pytest
import torch

from decode_helpers import damped_tiny_llama, echo_draft, random_draft, random_prompts, single_thread  # noqa: F401 (autouse fixture)
from eagle_core.generate import generate
from eagle_core.target import make_tiny_llama
from eagle_core.tree import TreeConfig

CONFIGS = [TreeConfig(4, 4, 16), TreeConfig(8, 6, 60), TreeConfig.chain(4), TreeConfig(2, 3, 5)]


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama(dtype=torch.float64)


@pytest.fixture(scope="module")
def damped():
    return damped_tiny_llama(0.8, dtype=torch.float64, seed=3)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(10, 512, seed=7)


def test_plain_loop_equals_transformers_greedy(target, prompts):
    ours = generate(target, prompts, max_new_tokens=16).tokens
    for p, got in zip(prompts, ours):
        ref = target.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert got == ref[0, len(p):].tolist()


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("which", ["random", "echo"])
def test_speculative_greedy_is_lossless(target, damped, prompts, config, which):
    """Exact token equality with plain greedy decoding, for a useless and for a good draft."""
    model = target if which == "random" else damped
    draft = random_draft(model, 300) if which == "random" else echo_draft(model)
    plain = generate(model, prompts, max_new_tokens=24).tokens
    spec = generate(model, prompts, draft=draft, tree=config, mode="tree", max_new_tokens=24)
    assert spec.tokens == plain
    if which == "echo":  # the test must exercise multi-token acceptance to mean anything
        assert max(s.tau for s in spec.stats) > 1.5


@pytest.mark.parametrize("config", [TreeConfig(4, 4, 16), TreeConfig.chain(4)], ids=str)
@pytest.mark.parametrize("which", ["random", "echo"])
def test_p_eagle_drafts_every_depth_in_one_forward_and_stays_lossless(target, damped, prompts, config, which):
    """A P-EAGLE draft (`parallel_drafting`): greedy tokens equal plain greedy in a batch of ragged rows, and a round
    calls the draft once past its root (the mask slots' forward), however deep the tree; the static caches accept
    what the eager ones do."""
    model = target if which == "random" else damped
    kind = dict(parallel_drafting=True, mask_token_id=3)
    draft = random_draft(model, 300, **kind) if which == "random" else echo_draft(model, **kind)
    calls = []
    hook = draft.register_forward_hook(lambda module, args, out: calls.append(
        "mask" if bool((args[1] == 3).all()) and args[1].shape[1] == config.depth - 1 else "other"))
    try:
        spec = generate(model, prompts, draft=draft, tree=config, mode="tree", max_new_tokens=24)
    finally:
        hook.remove()
    assert spec.tokens == generate(model, prompts, max_new_tokens=24).tokens
    rounds = max(s.rounds for s in spec.stats)
    # per round: one forward over depth - 1 mask slots, one over the committed tokens; + the prefill's
    assert calls.count("mask") == rounds and len(calls) == 2 * rounds + 1, (rounds, calls)
    if which == "echo":  # depth 1 is the echo draft's: tokens get accepted
        assert max(s.tau for s in spec.stats) > 1.3
        from eagle_core.static_rows import StaticConfig  # the static caches draft it the same way

        static = generate(model, prompts, draft=draft, tree=config, mode="tree", max_new_tokens=24,
                          static=StaticConfig(capacity=256))
        assert static.tokens == spec.tokens
        assert [s.accept_lengths for s in static.stats] == [s.accept_lengths for s in spec.stats]


@pytest.mark.parametrize("config", [TreeConfig(4, 4, 16), TreeConfig.chain(3)], ids=str)
@pytest.mark.parametrize("which", ["random", "echo"])
def test_seeded_speculative_sampling_equals_plain_sampling(target, damped, prompts, config, which):
    """A seed means the same tokens with or without speculation, with any draft, alone or in a batch."""
    model = target if which == "random" else damped
    draft = random_draft(model, 300) if which == "random" else echo_draft(model)
    # a cool temperature for the echo draft: its multi-token paths must get accepted now and then
    kw = dict(max_new_tokens=24, temperature=0.9 if which == "random" else 0.2, top_p=0.95, top_k=40, seed=5)
    plain = generate(model, prompts, **kw).tokens  # row i samples with seed 5 + i
    spec = generate(model, prompts, draft=draft, tree=config, mode="tree", **kw)
    assert spec.tokens == plain
    alone = generate(model, prompts[3:4], draft=draft, tree=config, mode="tree", **{**kw, "seed": 8})
    assert alone.tokens[0] == plain[3]
    other_seed = generate(model, prompts, **{**kw, "seed": 6}).tokens
    assert other_seed != plain  # the seed matters
    if which == "echo":  # multi-token acceptance must happen for this to mean anything
        assert sum(a >= 2 for s in spec.stats for a in s.accept_lengths) >= 3


@pytest.mark.parametrize("config", [TreeConfig(4, 4, 16), TreeConfig.chain(3)], ids=str)
def test_batch_equals_one_by_one(damped, prompts, config):
    draft = echo_draft(damped)
    batch = generate(damped, prompts, draft=draft, tree=config, mode="tree", max_new_tokens=20)
    for p, got, stats in zip(prompts, batch.tokens, batch.stats):
        alone = generate(damped, [p], draft=draft, tree=config, mode="tree", max_new_tokens=20)
        assert alone.tokens[0] == got
        assert alone.stats[0].accept_lengths == stats.accept_lengths  # rows advance independently
    # ...and different rows did accept different numbers of tokens in the same round
    assert len({tuple(s.accept_lengths) for s in batch.stats}) > 1


def test_stopping_rules(damped, prompts):
    draft = echo_draft(damped)
    plain = generate(damped, prompts, max_new_tokens=24).tokens
    # eos: pick, per prompt, a token that appears mid-way in its greedy output; all rows share the set
    eos = {row[10] for row in plain}
    spec = generate(damped, prompts, draft=draft, tree=TreeConfig(4, 5, 20), mode="tree", max_new_tokens=24,
                    eos_token_id=list(eos))
    for row, got, stats in zip(plain, spec.tokens, spec.stats):
        cut = next(i for i, t in enumerate(row) if t in eos)
        assert got == row[: cut + 1] and stats.finish_reason == "eos"
    # max_new_tokens is exact even when a round accepts more than what is left
    for n in (1, 2, 5):
        spec = generate(damped, prompts, draft=draft, tree=TreeConfig(4, 5, 20), mode="tree", max_new_tokens=n)
        assert spec.tokens == [row[:n] for row in plain]


def test_stats_definitions(damped, prompts):
    config = TreeConfig(4, 5, 20)
    res = generate(damped, prompts, draft=echo_draft(damped), tree=config, mode="tree", max_new_tokens=24)
    for s, toks in zip(res.stats, res.tokens):
        assert s.rounds == len(s.accept_lengths) > 0
        assert all(0 <= a <= config.depth for a in s.accept_lengths)
        assert s.tau == pytest.approx(1 + sum(s.accept_lengths) / s.rounds)
        # the root from the prefill, then accept_length + 1 per round (the last round may be cut)
        assert s.new_tokens == len(toks) <= 1 + sum(a + 1 for a in s.accept_lengths)
        assert s.new_tokens > 1 + sum(a + 1 for a in s.accept_lengths[:-1])
        assert s.draft_s > 0 and s.verify_s > 0


def test_autotune_choice_and_calibration(damped, prompts):
    """The chosen (depth, total_tokens) maximises the reported estimate, and the estimate's tau for the
    calibration tree itself equals the tau that the calibration run actually achieved."""
    from eagle_core.autotune import autotune, calibrate_acceptance, round_ms

    draft = echo_draft(damped)
    res = autotune(damped, draft, prompts[:3], top_k=3, depth=4, sizes=(1, 4, 8, 16), max_new_tokens=16,
                   context_tokens=32, context_chains=(0,))  # the tree's knobs alone (the context chain: below)
    assert res.context_chain == 0 and not res.context_tau
    best = max(res.expected_tokens_per_s, key=res.expected_tokens_per_s.get)
    assert best == f"{res.depth}/{res.total_tokens}"
    tau, run = calibrate_acceptance(damped, draft, prompts[:3], TreeConfig(3, 4, 16), [1, 4], [1, 16],
                                    max_new_tokens=16)
    achieved = sum(sum(s.accept_lengths) for s in run.stats) / sum(s.rounds for s in run.stats) + 1
    assert tau[(4, 16)] == pytest.approx(achieved)
    assert tau[(1, 16)] <= tau[(4, 16)] and tau[(4, 1)] <= tau[(4, 16)]
    # the head (all nodes or the path) is the cheaper one for the chosen shape, and the tree carries it
    assert set(res.head_ms) >= {1, res.total_tokens + 1} and res.tree.path_logits == res.path_logits
    cost = {p: round_ms(res.forward_ms_monotone, res.head_ms, res.draft_ms, res.depth, res.total_tokens,
                        res.tau[best], p) for p in (False, True)}
    assert cost[res.path_logits] == min(cost.values())
    assert res.expected_tokens_per_s[best] == pytest.approx(1000 * res.tau[best] / min(cost.values()))


def test_round_cost_counts_the_head_on_every_node_or_on_the_path():
    """fp32 on a CPU: a 5-row head costs 3 one-row heads, so a 1/4 tree accepting 1.5 tokens per round is
    cheaper with path logits; with a nearly free multi-row head (bf16, GPUs) it is not."""
    from eagle_core.autotune import round_ms

    forward, draft = {1: 60.0, 5: 100.0}, {1: 5.0}
    fp32, bf16 = {1: 10.0, 5: 30.0}, {1: 3.0, 5: 3.5}
    assert round_ms(forward, fp32, draft, 1, 4, 1.5, False) == round_ms(forward, bf16, draft, 1, 4, 1.5, False) == 105
    assert round_ms(forward, fp32, draft, 1, 4, 1.5, True) == pytest.approx(90.0)
    assert round_ms(forward, bf16, draft, 1, 4, 1.5, True) == pytest.approx(106.0)


def test_interleaved_timing_rotates_the_order_and_undoes_every_run():
    """Every repeat runs every case once, each repeat starting from the next case (so a slow spell of the
    machine lands on all cases alike), each run is followed by its own undo, and the first pass is not timed."""
    from eagle_core.autotune import interleaved_ms

    log = []
    cases = {k: (lambda k=k: log.append(("run", k)), None if k == "c" else (lambda k=k: log.append(("undo", k))))
             for k in "abc"}
    ms = interleaved_ms("cpu", cases, repeats=4)
    assert set(ms) == set("abc") and all(v >= 0 for v in ms.values())
    runs = [k for kind, k in log if kind == "run"]
    assert len(runs) == 3 * 5
    assert [runs[3 * r] for r in range(5)] == ["a", "b", "c", "a", "b"]  # who goes first rotates
    assert all(sorted(runs[3 * r: 3 * r + 3]) == ["a", "b", "c"] for r in range(5))
    for i, (kind, k) in enumerate(log):
        if kind == "run" and k != "c":
            assert log[i + 1] == ("undo", k)


def test_a_truncated_target_cache_recomputes_the_same_forward_in_place(damped):
    """`TargetKV.truncate_` rolls a cache back (the timing loops' undo): the next forward writes into the same
    buffer, and a verify repeated after the rollback gives the same logits."""
    from eagle_core.decoding import prefill
    from eagle_core.kv import TargetKV, lm_logits
    from eagle_core.tree import tree_from_parents
    from eagle_core.verify import verify_hidden

    kv = TargetKV(1, "cpu")
    prefill(damped, kv, [list(range(3, 20))], None)
    past = kv.width
    tree = tree_from_parents(torch.tensor([[5, 6, 7, 8]]), torch.tensor([[0, 0, 1, 1]]))
    first = lm_logits(damped, verify_hidden(damped, kv, tree, None)[0])
    buffer = kv.cache.layers[0].keys.untyped_storage().data_ptr()
    kv.truncate_(past)
    assert kv.width == past and int(kv.lengths[0]) == past
    again = lm_logits(damped, verify_hidden(damped, kv, tree, None)[0])
    assert kv.cache.layers[0].keys.untyped_storage().data_ptr() == buffer
    torch.testing.assert_close(again, first, rtol=0, atol=0)


@pytest.mark.parametrize("lengths_equal,first_row_keeps", [(True, [0, 1, 2]), (False, [0, 1, 2]), (True, [0, 2, 1])])
def test_keeping_new_entries_in_place_equals_moving_them(damped, lengths_equal, first_row_keeps):
    """`TargetKV.keep_new_` leaves each row's cache as its definition says: its old valid entries, then the kept new
    ones in order. Full rows keeping a prefix of the new entries keep them where they are (no copy, the same
    buffer); ragged rows, and a row keeping entries out of order, move them."""
    from eagle_core.decoding import prefill
    from eagle_core.kv import TargetKV, target_forward

    prompts = [list(range(3, 14)), list(range(5, 16 if lengths_equal else 12))]
    kv = TargetKV(2, "cpu")
    prefill(damped, kv, prompts, None)
    past, lengths = kv.width, kv.lengths.clone()
    ids = torch.tensor([[7, 8, 9], [4, 5, 6]])
    causal = torch.ones(3, 3, dtype=torch.bool).tril()[None].expand(2, 3, 3)
    target_forward(damped, kv, ids, lengths[:, None] + torch.arange(3)[None], causal)
    keep, n_keep = torch.tensor([first_row_keeps, [0, 1, 2]]), torch.tensor([3, 1])
    expected = [[torch.cat([layer.keys[r, :, :lengths[r]], layer.keys[r, :, past + keep[r, :n_keep[r]]]], dim=1)
                 for r in range(2)] for layer in kv.cache.layers]
    buffer = kv.cache.layers[0].keys.untyped_storage().data_ptr()
    kv.keep_new_(past, keep, n_keep)
    assert kv.lengths.tolist() == (lengths + n_keep).tolist() and kv.width == past + 3
    for layer, rows in zip(kv.cache.layers, expected):
        for r, n in enumerate(kv.lengths.tolist()):
            torch.testing.assert_close(layer.keys[r, :, :n], rows[r], rtol=0, atol=0)
    assert kv.cache.layers[0].keys.untyped_storage().data_ptr() == buffer


def test_the_head_is_timed_on_packed_inputs(damped):
    """The auto-tune times the lm_head on inputs laid out as the decoding's (packed), not on slices of one
    wider tensor: on CPUs a bf16 linear on such a slice takes a kernel ~15x slower than the decoding ever meets."""
    from eagle_core.autotune import head_cases

    seen = []
    handle = damped.get_output_embeddings().register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        for run, _undo in head_cases(damped, [1, 3, 8]).values():
            run()
    finally:
        handle.remove()
    assert [x.shape[1] for x in seen] == [1, 3, 8]
    assert all(x.stride() == torch.empty(x.shape).stride() for x in seen)


# ---- context chains (prompt lookup grafted beside the tree: mode "context") --------------------------------------

CONTEXT_CONFIGS = [TreeConfig(4, 4, 16, context_chain=6), TreeConfig(1, 3, 3, context_chain=8),
                   TreeConfig(2, 3, 5, context_chain=1)]


@pytest.fixture(scope="module")
def echo_prompts():
    """Prompts that repeat spans of themselves (ragged lengths): lookups match from the first round on."""
    return [p + p[: 4 + i % 5] for i, p in enumerate(random_prompts(10, 512, seed=7))]


def context_rounds(counter: list):
    """on_round: counts, per round, the rows whose accepted path entered the context chain's own slots."""
    def on_round(out, _):
        if out.tree.draft_size is not None:
            steps = torch.arange(out.path.shape[1])[None, :]
            in_chain = (out.path >= out.tree.draft_size) & (steps <= out.accept_length[:, None])
            counter.append(int(in_chain.any(dim=1).sum()))
    return on_round


@pytest.mark.parametrize("config", CONTEXT_CONFIGS, ids=str)
@pytest.mark.parametrize("which", ["random", "echo"])
def test_context_chain_greedy_is_lossless(target, damped, echo_prompts, config, which):
    """Greedy with a grafted context chain == plain greedy, and the chain's own nodes were accepted."""
    model = target if which == "random" else damped
    draft = random_draft(model, 300) if which == "random" else echo_draft(model)
    plain = generate(model, echo_prompts, max_new_tokens=24).tokens
    counter = []
    spec = generate(model, echo_prompts, draft=draft, tree=config, mode="context", max_new_tokens=24,
                    on_round=context_rounds(counter))
    assert spec.tokens == plain
    if which == "echo" and config.context_chain > 1:  # a 1-token chain is mostly the tree's own best child
        assert sum(counter) >= 5 and max(s.tau for s in spec.stats) > 2


@pytest.mark.parametrize("config", [CONTEXT_CONFIGS[1], TreeConfig(2, 2, 3, context_chain=6)], ids=str)
def test_context_chain_seeded_sampling_equals_plain_sampling(damped, echo_prompts, config):
    """A random draft: the target's repetitions are the chain's to propose, so its own slots get accepted."""
    draft = random_draft(damped, 300)
    kw = dict(max_new_tokens=24, temperature=0.2, top_p=0.95, top_k=40, seed=5)
    plain = generate(damped, echo_prompts, **kw).tokens
    counter = []
    spec = generate(damped, echo_prompts, draft=draft, tree=config, mode="context", on_round=context_rounds(counter),
                    **kw)
    assert spec.tokens == plain and sum(counter) >= 5
    alone = generate(damped, echo_prompts[3:4], draft=draft, tree=config, mode="context", **{**kw, "seed": 8})
    assert alone.tokens[0] == plain[3]


def test_context_chain_batch_equals_one_by_one(damped, echo_prompts):
    config = CONTEXT_CONFIGS[0]
    draft = echo_draft(damped)
    batch = generate(damped, echo_prompts, draft=draft, tree=config, mode="context", max_new_tokens=20)
    for p, got, stats in zip(echo_prompts, batch.tokens, batch.stats):
        alone = generate(damped, [p], draft=draft, tree=config, mode="context", max_new_tokens=20)
        assert alone.tokens[0] == got
        assert alone.stats[0].accept_lengths == stats.accept_lengths  # the chain's width is per batch, not per row
    assert len({tuple(s.accept_lengths) for s in batch.stats}) > 1


def _wrong_verify(verify_hidden, wrong: str):
    """A verify forward wrong on the chain's own slots only: at their slot index instead of their path depth, as
    if appended after the tree ("positions"), or blind to the chain tokens before them ("mask"). Acceptance still
    reads the tree as it is."""
    from eagle_core.kv import target_forward

    def verify(target, kv, tree, aux_layer_ids):
        if tree.draft_size is None:
            return verify_hidden(target, kv, tree, aux_layer_ids)
        slot = torch.arange(tree.size) >= tree.draft_size
        positions, mask = kv.lengths[:, None] + tree.depth, tree.ancestors
        if wrong == "positions":
            positions = torch.where(slot, kv.lengths[:, None] + torch.arange(tree.size), positions)
        else:
            mask = mask & ~(slot[:, None] & slot[None, :]) | torch.eye(tree.size, dtype=torch.bool)
        return target_forward(target, kv, tree.forward_tokens(), positions, mask, aux_layer_ids)
    return verify


@pytest.mark.parametrize("wrong", ["positions", "mask"])
def test_a_wrong_graft_fails_the_lossless_test(damped, echo_prompts, monkeypatch, wrong):
    """The context tests above can fail: chain slots verified at the wrong positions, or blind to the chain before
    them, change the committed tokens."""
    import eagle_core.decoding as decoding

    plain = generate(damped, echo_prompts, max_new_tokens=40).tokens
    draft = random_draft(damped, 300)  # the target's repetitions are the chain's to propose: its slots get accepted
    right = generate(damped, echo_prompts, draft=draft, tree=CONTEXT_CONFIGS[1], mode="context", max_new_tokens=40)
    assert right.tokens == plain
    monkeypatch.setattr(decoding, "verify_hidden", _wrong_verify(decoding.verify_hidden, wrong))
    spec = generate(damped, echo_prompts, draft=draft, tree=CONTEXT_CONFIGS[1], mode="context", max_new_tokens=40)
    assert spec.tokens != plain


def test_context_mode_needs_a_context_chain(damped):
    with pytest.raises(ValueError, match="mode must be"):
        generate(damped, [[1, 2, 3]], draft=echo_draft(damped), tree=TreeConfig(2, 2, 3), mode="context",
                 max_new_tokens=2)


def test_autotune_weighs_the_context_chain_as_a_knob(damped, echo_prompts):
    """With context chain lengths to try, the auto-tune's estimate for each (depth, size, length) is its calibrated
    tau over the round time with the verify widened by the length in the share of rounds whose lookup matched;
    the choice maximises over shapes with and without a chain, and the tree it returns carries the length. The
    calibration's tau for the longest chain on the calibration tree is what that run achieved, and a longer chain
    never accepts less. Priming a policy from it primes the context mode too."""
    from eagle_core.autotune import autotune, calibrate_acceptance, round_ms
    from eagle_core.policy import ModeChooser

    draft = echo_draft(damped)
    res = autotune(damped, draft, echo_prompts[:3], top_k=3, depth=3, sizes=(1, 4, 8), max_new_tokens=16,
                   context_tokens=32, context_chains=(0, 2, 6))
    both = {**res.expected_tokens_per_s, **res.context_expected_tokens_per_s}
    best = max(both, key=both.get)
    assert best == res.key + (f"+{res.context_chain}" if res.context_chain else "")
    assert res.tree.context_chain == res.context_chain and 0 < res.context_match_rate <= 1
    assert res.context_chain > 0  # these prompts repeat themselves: the chain pays here
    d, s, c = res.depth, res.total_tokens, res.context_chain
    tau, match = res.context_tau[best], res.context_match_rate
    cost = ((1 - match) * round_ms(res.forward_ms_monotone, res.head_ms, res.draft_ms, d, s, tau, res.path_logits)
            + match * round_ms(res.forward_ms_monotone, res.head_ms, res.draft_ms, d, s + c, tau, res.path_logits))
    assert both[best] == pytest.approx(1000 * tau / cost)

    tau, run = calibrate_acceptance(damped, draft, echo_prompts[:3], TreeConfig(3, 3, 8), [1, 3], [1, 8],
                                    max_new_tokens=16, context_chains=[2, 6])
    achieved = sum(sum(s.accept_lengths) for s in run.stats) / sum(s.rounds for s in run.stats) + 1
    assert set().union(*(s.modes for s in run.stats)) == {"context"}
    assert tau[(3, 8, 6)] == pytest.approx(achieved)
    assert tau[(3, 8)] <= tau[(3, 8, 2)] <= tau[(3, 8, 6)] and tau[(3, 8)] < tau[(3, 8, 6)]
    chooser = ModeChooser(("tree", "context", "plain"))
    res.prime(chooser)
    assert chooser.rate(1, "context") == pytest.approx(res.context_expected_tokens_per_s[best])
