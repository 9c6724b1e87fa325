"""Tree verification: tree attention equals plain decoding of each path; greedy acceptance; KV keeps the path."""

import pytest
import torch

from decode_helpers import random_prompts, single_thread  # noqa: F401 (autouse fixture)
from eagle_core.decoding import prefill
from eagle_core.generate import generate
from eagle_core.attention import _transformers_attention, folded_gqa_sdpa
from eagle_core.kv import TargetKV
from eagle_core.target import make_tiny_llama
from eagle_core.tree import tree_from_parents
from eagle_core.verify import (SamplingConfig, accept_greedy, accept_sampling, target_probs, verify_tree)


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama(dtype=torch.float64)


def random_tree(batch: int, n: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    parents = torch.zeros(batch, n, dtype=torch.long)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (batch,), generator=g)
    tokens = torch.randint(3, vocab, (batch, n), generator=g)
    return parents, tokens


def path_to(parents: list[int], node: int) -> list[int]:
    path = [node]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    return path[::-1]


@torch.inference_mode()
def test_tree_logits_equal_plain_forward_of_each_path(target):
    """Ancestor-only mask + depth positions on a ragged batch cache == each path decoded on its own."""
    prompts = random_prompts(3, 512, seed=2)
    kv = TargetKV(3, "cpu")
    prefill(target, kv, prompts, None)
    parents, tokens = random_tree(3, 12, 512, seed=3)
    tree = tree_from_parents(tokens, parents)
    logits, _ = verify_tree(target, kv, tree, None)
    for b in range(3):
        for node in range(12):
            seq = prompts[b] + tokens[b, path_to(parents[b].tolist(), node)].tolist()
            ref = target(torch.tensor([seq])).logits[0, -1]
            torch.testing.assert_close(logits[b, node], ref, rtol=0, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", ["bool", "additive", "shared"])
@pytest.mark.parametrize("new_tokens", [1, 2, 9])
def test_our_cpu_attention_is_transformers_sdpa_bit_for_bit(dtype, mask, new_tokens):
    """On a CPU our attention (SDPA's own grouped-query support, no repeated kv heads, for 2+ queries with a mask)
    returns transformers' SDPA attention exactly."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(new_tokens)
    q = torch.randn(2, 6, new_tokens, 8, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 30, 8, generator=g).to(dtype) for _ in range(2))
    allowed = torch.rand(2 if mask != "shared" else 1, 1, new_tokens, 30, generator=g) > 0.4
    allowed[..., -1] = True
    m = allowed if mask != "additive" else torch.zeros(allowed.shape, dtype=dtype).masked_fill(
        ~allowed, torch.finfo(dtype).min)
    layer = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    ours, _ = _transformers_attention(layer, q, k, v, m, scaling=8 ** -0.5)
    ref, _ = sdpa_attention_forward(layer, q, k, v, m, scaling=8 ** -0.5)
    assert ours.shape == ref.shape == (2, new_tokens, 6, 8)
    assert torch.equal(ours, ref)
    # CUDA's path (the query heads folded over their kv head, `folded_gqa_sdpa`): the same attention up to the
    # rounding of another reduction order
    folded = folded_gqa_sdpa(q, k, v, m, scale=8 ** -0.5).transpose(1, 2)
    torch.testing.assert_close(folded, ref, **({} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}))


@torch.inference_mode()
def test_a_tree_verification_with_folded_query_heads_equals_transformers(monkeypatch):
    """CUDA's grouped-query path (`folds_gqa`, forced here on the CPU): every layer of a tree's verify attends with
    the query heads folded over their kv head, and the logits are transformers' SDPA forward's up to float32
    rounding, on a ragged batch."""
    import eagle_core.attention as attention

    calls = []
    original = attention.folded_gqa_sdpa
    monkeypatch.setattr(attention, "GQA_FOLD_DEVICES", frozenset({"cpu"}))
    model = make_tiny_llama(dtype=torch.float32)
    prompts = random_prompts(2, 512, seed=6)
    parents, tokens = random_tree(2, 9, 512, seed=7)
    logits = {}
    for path in ("folded", "sdpa"):
        monkeypatch.setattr(attention, "use_gqa_sdpa", lambda q, m: False)  # CPUs' own path first otherwise
        if path == "sdpa":
            monkeypatch.setattr(attention, "GQA_FOLD_DEVICES", frozenset())
        monkeypatch.setattr(attention, "folded_gqa_sdpa", lambda q, *a: calls.append(q.shape) or original(q, *a))
        kv = TargetKV(2, "cpu")
        prefill(model, kv, prompts, None)
        calls.clear()
        logits[path], _ = verify_tree(model, kv, tree_from_parents(tokens, parents), None)
        if path == "folded":
            assert calls == [(2, 4, 9, 16)] * model.config.num_hidden_layers
    assert not calls
    torch.testing.assert_close(logits["folded"], logits["sdpa"], atol=1e-5, rtol=1e-5)


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_tree_verification_attends_without_repeating_the_cache_and_equals_transformers(dtype, monkeypatch):
    """A tree verification on CPU takes SDPA's grouped-query path in every layer and its logits equal those of
    transformers' own SDPA forward of the same tree bit for bit; the model keeps SDPA for everything else
    (`generate` of transformers, the benchmark's baseline)."""
    import eagle_core.attention as kv_module

    calls = []
    original = kv_module.use_gqa_sdpa
    monkeypatch.setattr(kv_module, "use_gqa_sdpa", lambda q, m: original(q, m) and not calls.append(q.shape))
    model = make_tiny_llama(dtype=dtype)
    prompts = random_prompts(2, 512, seed=6)
    parents, tokens = random_tree(2, 9, 512, seed=7)
    logits = {}
    for attention in ("ours", "sdpa"):
        if attention == "sdpa":
            monkeypatch.setattr(kv_module, "use_gqa_sdpa", lambda q, m: False)
        kv = TargetKV(2, "cpu")
        prefill(model, kv, prompts, None)
        calls.clear()
        logits[attention], _ = verify_tree(model, kv, tree_from_parents(tokens, parents), None)
        if attention == "ours":
            assert calls == [(2, 4, 9, 16)] * model.config.num_hidden_layers  # the tree's forward, every layer
    assert not calls
    assert model.config._attn_implementation == "sdpa"
    assert logits["ours"].dtype == torch.float32  # logits upcast as transformers' generate does
    assert torch.equal(logits["ours"], logits["sdpa"])


@torch.inference_mode()
def test_greedy_accepts_the_target_path_and_cache_keeps_exactly_it(target):
    """Plant the greedy continuation in a random tree: it is accepted to its planted depth, the bonus is
    the next greedy token, and the cache afterwards equals a plain prefill of prompt + accepted path."""
    prompts = random_prompts(3, 512, seed=4)
    greedy = generate(target, prompts, max_new_tokens=8).tokens  # greedy[b][0] is the root
    plant = [4, 0, 2]  # accepted draft tokens per row
    parents, tokens = random_tree(3, 10, 512, seed=5)
    for b in range(3):
        # nodes 1..plant[b] form a chain of greedy tokens under the root; the rest stays random
        tokens[b, 0] = greedy[b][0]
        for d in range(1, plant[b] + 1):
            parents[b, d] = d - 1
            tokens[b, d] = greedy[b][d]
        for s in range(1, 10):
            # no other node may agree with the target where the planted chain ends or branches
            node = parents[b, s].item()
            on_chain = s <= plant[b]
            if not on_chain and node <= plant[b] and tokens[b, s] == greedy[b][node + 1]:
                tokens[b, s] = (tokens[b, s] + 1) % 512
    tree = tree_from_parents(tokens, parents)
    kv = TargetKV(3, "cpu")
    prefill(target, kv, prompts, None)
    past_width = kv.width
    logits, _ = verify_tree(target, kv, tree, None)
    acc = accept_greedy(tree, logits)
    assert acc.accept_length.tolist() == plant
    for b in range(3):
        assert acc.bonus[b].item() == greedy[b][plant[b] + 1]
    kv.keep_new_(past_width, acc.path, acc.accept_length + 1)
    for b in range(3):
        seq = prompts[b] + greedy[b][: plant[b] + 1]
        assert kv.lengths[b].item() == len(seq)
        ref = TargetKV(1, "cpu")
        prefill(target, ref, [seq], None)
        for layer, ref_layer in zip(kv.cache.layers, ref.cache.layers):
            torch.testing.assert_close(layer.keys[b, :, : len(seq)], ref_layer.keys[0], rtol=0, atol=1e-9)
            torch.testing.assert_close(layer.values[b, :, : len(seq)], ref_layer.values[0], rtol=0, atol=1e-9)


def test_sampling_acceptance_emits_the_target_distribution():
    """Unit check of the sibling rule on a fixed 2-level tree: the first emitted token ~ p at the root."""
    vocab, rows = 6, 6000
    torch.manual_seed(0)
    logits = torch.randn(1, 4, vocab).expand(rows, 4, vocab).clone()
    # root with children tokens 2, 0 (node 1, 2) and a grandchild under node 1
    tree = tree_from_parents(torch.tensor([[5, 2, 0, 1]]).expand(rows, 4), torch.tensor([[0, 0, 0, 1]]).expand(rows, 4))
    sampling = SamplingConfig(temperature=1.0)
    seeds = list(range(rows))
    acc = accept_sampling(tree, logits, sampling, seeds, torch.full((rows,), 5))
    first = torch.where(acc.accept_length > 0, tree.tokens.gather(1, acc.path[:, 1:2])[:, 0], acc.bonus)
    freq = torch.bincount(first, minlength=vocab).double() / rows
    p = target_probs(logits[0, 0], sampling).double()
    assert (freq - p).abs().max() < 4 * (p * (1 - p) / rows).sqrt().max() + 1e-3


def test_preallocated_cache_writes_in_place_and_holds_what_concatenation_would():
    """The target's cache layers write new entries into a buffer with spare room (no copy of the whole cache per
    forward) and, through appends, ragged keeps, dropped rows and merged rows, hold exactly what transformers'
    concatenating `DynamicLayer` holds."""
    from transformers.cache_utils import DynamicLayer

    from eagle_core.kv import keep_new_, kept_slots, pad_cat, preallocated_layer_class

    torch.manual_seed(0)
    ours, ref = preallocated_layer_class()(), DynamicLayer()
    lengths = torch.tensor([0, 0])

    def append(n: int):
        k, v = torch.randn(2, 3, n, 4), torch.randn(2, 3, n, 4)
        a, b = ours.update(k, v), ref.update(k, v)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    def keep(past: int, idx: list[list[int]], n_keep: list[int]):
        nonlocal lengths
        keep_t, n_t = torch.tensor(idx), torch.tensor(n_keep)
        width, slots = int((lengths + n_t).max()), kept_slots(lengths, past, keep_t)
        for layer in (ours, ref):
            layer.keys = keep_new_(layer.keys, slots, width)
            layer.values = keep_new_(layer.values, slots, width)
        lengths = lengths + n_t

    append(5)
    keep(0, [[0, 1, 2, 3, 4]] * 2, [5, 5])
    buffer = ours.keys.data_ptr()
    for _ in range(6):  # tree rounds: 4 new entries, rows keep different paths
        past = ours.keys.shape[-2]
        append(4)
        keep(past, [[0, 2, 3], [1, 3, 0]], [3, 1])
        assert ours.keys.data_ptr() == buffer  # written by index into the same buffer
    valid = lambda layer, row: layer.keys[row, :, : int(lengths[row])]  # noqa: E731
    assert all(torch.equal(valid(ours, r), valid(ref, r)) for r in range(2))
    for layer in (ours, ref):  # a row leaves, another batch's rows join: the layer adopts new tensors
        layer.keys, layer.values = layer.keys[[1]], layer.values[[1]]
        joining = torch.ones(1, 3, 2, 4)
        layer.keys, layer.values = pad_cat(layer.keys, joining), pad_cat(layer.values, joining)
    lengths = torch.tensor([int(lengths[1]), 2])
    past = ours.keys.shape[-2]
    append(2)
    keep(past, [[0, 1], [1, 0]], [2, 1])
    assert all(torch.equal(valid(ours, r), valid(ref, r)) for r in range(2))


@pytest.mark.parametrize("temperature", [0.0, 0.2], ids=["greedy", "sampled"])
@torch.inference_mode()
def test_path_logits_accept_exactly_what_logits_on_every_node_accept(temperature):
    """`TreeConfig.path_logits` runs the lm_head only along the path being accepted: every round accepts the same
    path and bonus as with logits on every node, over multi-token acceptances, in a batch, greedy and sampled;
    and the head sees fewer rows."""
    from decode_helpers import damped_tiny_llama, echo_draft
    from eagle_core.tree import TreeConfig

    target = damped_tiny_llama(0.8, dtype=torch.float64, seed=3)
    draft = echo_draft(target)
    prompts = random_prompts(4, 512, seed=7)
    head_rows, rounds = [], {}
    hook = target.get_output_embeddings().register_forward_hook(
        lambda _m, inputs, _o: head_rows.append(inputs[0].shape[0] * inputs[0].shape[1]))
    for path_logits in (False, True):
        head_rows.clear()
        seen = rounds[path_logits] = []
        tokens = generate(target, prompts, draft=draft, tree=TreeConfig(3, 4, 10, path_logits=path_logits),
                          mode="tree", max_new_tokens=30, temperature=temperature, seed=11,
                          on_round=lambda out, _: seen.append((out.path.tolist(), out.accept_length.tolist(),
                                                               out.root.tolist()))).tokens
        rounds[path_logits] = (seen, tokens, sum(head_rows))
    (every, every_tokens, every_rows), (path, path_tokens, path_rows) = rounds[False], rounds[True]
    assert path == every and path_tokens == every_tokens
    assert max(n for _, lengths, _ in every for n in lengths) >= 2  # walks of several levels were exercised
    assert path_rows < every_rows
    hook.remove()


@torch.inference_mode()
@pytest.mark.parametrize("family", ["llama", "mistral-window", "gemma3"])
def test_grafted_chain_logits_equal_plain_forward_of_each_path(target, family):
    """A context chain grafted beside a random tree (merged into it in one row, under the root in another, absent in
    the third), on a ragged batch cache: every node, chain slots included, scores as its root path decoded alone.
    The chains run past the sliding window (8) of the windowed families: their slots must sit at their path
    positions, or the windows would cut the wrong keys."""
    from family_helpers import tiny_family_model
    from eagle_core.tree import NO_TOKEN, graft_chain

    model = target if family == "llama" else tiny_family_model(family, dtype=torch.float64)
    vocab = model.config.vocab_size
    prompts = random_prompts(3, vocab, lo=10, hi=20, seed=8)
    kv = TargetKV(3, "cpu")
    prefill(model, kv, prompts, None)
    parents, tokens = random_tree(3, 8, vocab, seed=9)
    first = tokens[0, 1].item()  # row 0's chain starts with the root's first child: merged there
    chain = torch.tensor([[first, 5, 6, 7, 8, 9, 10, 11, 12, 13],
                          [4] + list(range(20, 29)),
                          [NO_TOKEN] * 10])
    tokens[1, 1:][parents[1, 1:] == 0] = 3  # no root child of row 1 carries its chain's first token (4)
    tree = graft_chain(tree_from_parents(tokens, parents), chain)
    logits, _ = verify_tree(model, kv, tree, None)
    for b in range(3):
        for node in range(tree.size):
            if tree.tokens[b, node] == NO_TOKEN:
                continue
            seq = prompts[b] + tree.tokens[b, path_to(tree.parents[b].tolist(), node)].tolist()
            ref = model(torch.tensor([seq])).logits[0, -1]
            torch.testing.assert_close(logits[b, node], ref.to(logits.dtype), rtol=0, atol=1e-9)
    assert tree.depth[0].max() == 10 and tree.depth[1].max() == 10


@torch.inference_mode()
def test_greedy_accepts_a_planted_context_chain_and_the_cache_keeps_exactly_it(target):
    """The greedy continuation as the context chain beside a random tree (whose nodes never agree with the target):
    accepted to its planted length through the chain's own slots; the cache then equals a prefill of the path."""
    from eagle_core.tree import NO_TOKEN, graft_chain

    prompts = random_prompts(3, 512, seed=4)
    greedy = generate(target, prompts, max_new_tokens=10).tokens
    plant = [6, 0, 3]
    parents, tokens = random_tree(3, 6, 512, seed=5)
    chain = torch.full((3, 6), NO_TOKEN)
    for b in range(3):
        tokens[b, 0] = greedy[b][0]
        for i in range(1, 6):  # no tree node agrees with the target
            while tokens[b, i].item() in greedy[b][:8]:
                tokens[b, i] = (tokens[b, i] + 1) % 512
        chain[b, :plant[b]] = torch.tensor(greedy[b][1: plant[b] + 1])
        if plant[b] < 6:
            chain[b, plant[b]] = (greedy[b][plant[b] + 1] + 1) % 512  # the chain goes wrong after the plant
    tree = graft_chain(tree_from_parents(tokens, parents), chain)
    kv = TargetKV(3, "cpu")
    prefill(target, kv, prompts, None)
    past_width = kv.width
    logits, _ = verify_tree(target, kv, tree, None)
    acc = accept_greedy(tree, logits)
    assert acc.accept_length.tolist() == plant
    assert [acc.bonus[b].item() for b in range(3)] == [greedy[b][plant[b] + 1] for b in range(3)]
    kv.keep_new_(past_width, acc.path, acc.accept_length + 1)
    for b in range(3):
        seq = prompts[b] + greedy[b][: plant[b] + 1]
        ref = TargetKV(1, "cpu")
        prefill(target, ref, [seq], None)
        for layer, ref_layer in zip(kv.cache.layers, ref.cache.layers):
            torch.testing.assert_close(layer.keys[b, :, : len(seq)], ref_layer.keys[0], rtol=0, atol=1e-9)
