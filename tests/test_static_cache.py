"""The static decoding path (`eagle_core.static_kv`, issue 39) against today's growing caches (`eagle_core.kv`):

* the target's cache holds the same entries: random trees verified on both caches, random paths kept (not
  prefixes, a different length per row), plain steps between, past sliding windows and chunks, for every family it
  claims; the draft's cache grows the same trees and holds the same entries;
* decoding on it gives today's tokens (fp32, greedy and seeded sampling, batch 1 and a ragged batch, plain, tree,
  chain and context rounds mixed, every family it claims, the serving engine), with rows leaving and joining,
  while every buffer of both caches keeps its `data_ptr()`;
* garbage in the slots no row owns changes no token;
* the plain step, the verify step and the draft loop trace whole (`torch.compile(fullgraph=True)`: one graph
  each, no break) and compile once; trees of one width bucket share a graph, and so do batches of one row bucket
  (rows leaving and joining within it); compiled steps keep today's tokens through mode switches and rows leaving
  and joining; padding rows change no token of the real rows;
* what does not fit is refused before anything is written, and a batch decodes on eagerly past it (one log
  line); a target over several devices is refused; Llama 4's temperature-tuning bound is kept where the eager path
  keeps it; `bench.gpu --tiny` times it and checks its tokens.
"""

import pytest
import torch

from decode_helpers import (IdTokenizer, damped_tiny_llama, echo_draft, random_draft, random_prompts,  # noqa: F401
                            run_engine, single_thread)  # (autouse fixture)
from family_helpers import tiny_family_model
from eagle_core.decoding import DecodingState, plain_step, prefill
from eagle_core.families import UnsupportedTarget
from eagle_core.generate import generate
from eagle_core.kv import TargetKV, lm_logits
from eagle_core.static_kv import StaticKV
from eagle_core.static_rows import CacheFull, StaticConfig, first_rows
from eagle_core.tree import TreeConfig, _grow, tree_from_parents
from eagle_core.verify import SamplingConfig, accept, verify_hidden

# family_helpers names of the families whose decoder forward the static path reproduces (`STATIC_FAMILIES`)
STATIC = ["llama", "mistral-window", "qwen2-window", "qwen3", "qwen3-moe", "phi3", "olmo2", "gpt-oss", "gemma2",
          "gemma3", "granite", "llama4"]
GREEDY, SAMPLED = SamplingConfig(), SamplingConfig(temperature=0.9, top_p=0.95, top_k=50)


def random_tree(b: int, n: int, vocab: int, g: torch.Generator, among: int | None = None):
    """B random trees of n nodes (each node's parent drawn among the earlier ones, or the first `among` of them:
    then no deeper than `among`)."""
    parents = torch.stack([torch.randint(0, max(min(i, among or i), 1), (b,), generator=g) for i in range(n)], dim=1)
    return tree_from_parents(torch.randint(3, vocab, (b, n), generator=g), parents)


def path_to(tree, last: torch.Tensor) -> torch.Tensor:
    """[B, D+1] the root-to-`last` path of every row, root first, padded by repeating `last` (as `Acceptance`)."""
    b, n = tree.tokens.shape
    on_path = tree.ancestors[torch.arange(b), last]
    order = torch.where(on_path, tree.depth, n + tree.depth).argsort(dim=-1)[:, : int(tree.depth.max()) + 1]
    steps = torch.arange(order.shape[1])[None, :]
    return torch.where(steps <= tree.depth.gather(1, last[:, None]), order, last[:, None])


@pytest.mark.parametrize("name", STATIC)
@torch.inference_mode()
def test_the_static_cache_holds_what_the_growing_cache_holds(name):
    """Same forward outputs and, row by row and layer by layer, the same committed keys and values after every
    keep: the in-place compaction moves exactly the kept entries, whatever path and length each row keeps."""
    target = tiny_family_model(name)
    prompts = random_prompts(3, 256, lo=10, hi=20, seed=1)
    g = torch.Generator().manual_seed(0)
    eager, static = TargetKV(3, "cpu"), StaticKV(target, 3, StaticConfig(capacity=160, bucket=16))
    for kv in (eager, static):
        logits, aux, _, _ = prefill(target, kv, prompts, [1, 2, 3])
        kv.logits, kv.aux = logits, aux
    torch.testing.assert_close(static.logits, eager.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(static.aux, eager.aux, rtol=1e-5, atol=1e-5)
    token = static.logits.argmax(-1)
    for round_ in range(6):  # 6 x (a tree keeping up to 5 entries + a plain step): past windows and chunks of 8
        tree = random_tree(3, 9, 256, g)
        last = torch.randint(0, 9, (3,), generator=g)
        path = path_to(tree, last)
        outs = []
        for kv in (eager, static):
            past = kv.width
            hidden, aux = verify_hidden(target, kv, tree, [1, 2, 3])
            kv.keep_new_(past, path, tree.depth.gather(1, last[:, None])[:, 0] + 1)
            nxt, step_aux = plain_step(target, kv, token, GREEDY, None, [1, 2, 3])
            outs.append((hidden, aux, step_aux))
        for mine, theirs in zip(*outs[::-1]):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
        assert torch.equal(static.lengths, eager.lengths)
        for layer, (k, v) in enumerate(zip(static.keys, static.values)):
            for row, n in enumerate(eager.lengths.tolist()):
                want = eager.cache.layers[layer]
                torch.testing.assert_close(k[row, :, :n], want.keys[row, :, :n], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(v[row, :, :n], want.values[row, :, :n], rtol=1e-5, atol=1e-5)
    assert int(eager.lengths.min()) > 24 + 8  # the windows and chunks of 8 were crossed several times


def decode(target, draft, prompts, sampling, modes, static=None, join=None, leave=None, between=None,
           tree=TreeConfig(3, 4, 10)):
    """Tokens per prompt of a `DecodingState` run through `modes`: row 1 leaves before round `leave`, the `join`
    prompts (the last ones) join before round 3; `between(state)` runs before every round."""
    first = len(prompts) - len(join or [])
    seeds = [100 + i for i in range(len(prompts))]
    state, step = DecodingState.prefill(target, draft, prompts[:first], sampling, tree, seeds[:first], static=static)
    rows = list(range(first))
    out = {i: list(t) for i, t in zip(rows, step.tokens)}
    for r, mode in enumerate(modes):
        if r == leave:
            keep = [i for i in range(len(rows)) if i != 1]
            state.select_rows_(keep)
            rows = [rows[i] for i in keep]
        if r == 3 and join:
            new, joined = DecodingState.prefill(target, draft, join, sampling, tree, seeds[first:], static=static)
            state.merge_(new)
            out.update({first + i: list(t) for i, t in enumerate(joined.tokens)})
            rows += list(range(first, len(prompts)))
        if between is not None:
            between(state)
        for i, tokens in zip(rows, state.step(mode).tokens):
            out[i] += tokens
    return [out[i] for i in sorted(out)]


MODES = ["plain", "tree", "plain", "chain", "tree", "plain", "tree", "tree"] * 2


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("batch", [1, 3], ids=["alone", "ragged-batch"])
@pytest.mark.parametrize("kind", ["diverse", "repeating"])
@torch.inference_mode()
def test_static_decoding_gives_todays_tokens(kind, batch, sampling):
    """fp32, every mode mixed: a random-weight family target whose answers vary (trees rarely accepted), and a
    damped one with a draft that accepts long paths (keeps of several entries every round)."""
    if kind == "diverse":
        target = tiny_family_model("llama")
        draft, prompts = random_draft(target, 256), random_prompts(3, 256, lo=10, hi=20, seed=1)[:batch]
    else:
        target = damped_tiny_llama(0.8, seed=3)
        draft, prompts = echo_draft(target), random_prompts(3, 512, seed=5)[:batch]
    eager = decode(target, draft, prompts, sampling, MODES)
    assert decode(target, draft, prompts, sampling, MODES, static=StaticConfig(capacity=256)) == eager
    assert min(map(len, eager)) >= len(MODES) + 1
    if kind == "repeating" and sampling.greedy:  # rounds accepted several tokens: keeps of several entries
        assert min(map(len, eager)) >= 2 * len(MODES)


@pytest.mark.parametrize("name", STATIC)
@torch.inference_mode()
def test_every_family_it_claims_decodes_todays_tokens(name):
    """`generate(static=...)` against `generate`, each family of `STATIC_FAMILIES` (windows and chunks of 8 crossed),
    a ragged batch in every mode, greedy, and tree rounds with seeded sampling (the logits' family post-processing,
    Granite's scaling, Gemma 2's soft-cap, shapes the distribution): the forward and the verify step's masks per
    layer kind, as the eager path's."""
    target = tiny_family_model(name)
    draft, prompts = random_draft(target, 256), random_prompts(3, 256, lo=10, hi=20, seed=1)
    sampled = dict(temperature=0.9, top_p=0.95, top_k=50, seed=7, max_new_tokens=12)
    for mode, tree, sampling in [("plain", None, {}), ("tree", TreeConfig(4, 4, 16), {}),
                                 ("chain", TreeConfig.chain(4), {}), ("tree", TreeConfig(4, 4, 16), sampled)]:
        kw = dict(draft=None if tree is None else draft, tree=tree, mode=mode, **{"max_new_tokens": 24, **sampling})
        eager = generate(target, prompts, **kw).tokens
        assert generate(target, prompts, static=StaticConfig(capacity=128, bucket=16), **kw).tokens == eager, kw


@pytest.mark.parametrize("kind", ["diverse", "repeating"])
@torch.inference_mode()
def test_the_static_draft_cache_grows_the_same_trees(kind):
    """The draft's cache changes no token whatever it holds (acceptance is lossless), so it is held against the
    eager `DraftKV` directly: every round drafts the same tree (tokens, parents) from the same draft hidden state,
    and the rows' committed draft entries are the same, through catch-ups, tree levels and keeps. The batch of 3
    drafts on 4 rows (a padding row: `ROW_BUCKETS`)."""
    if kind == "diverse":
        target = tiny_family_model("llama")
        draft, prompts = random_draft(target, 256), random_prompts(3, 256, lo=10, hi=20, seed=1)
    else:  # float64: the echo draft's near-tied scores would let float32 rounding reorder the rerank's tail
        target = damped_tiny_llama(0.8, seed=3, dtype=torch.float64)
        draft, prompts = echo_draft(target), random_prompts(3, 512, seed=5)
    tree = TreeConfig(3, 4, 10)
    eager, static = (DecodingState.prefill(target, draft, prompts, GREEDY, tree, static=config)[0]
                     for config in (None, StaticConfig(capacity=256, bucket=16, rows=4)))  # steps on 4 rows
    for mode in MODES:
        steps = [state.step(mode) for state in (eager, static)]
        if mode != "plain":
            mine, theirs = steps[1].round.tree, steps[0].round.tree
            assert torch.equal(mine.tokens, theirs.tokens) and torch.equal(mine.parents, theirs.parents)
            torch.testing.assert_close(static.draft_hidden, eager.draft_hidden, rtol=1e-5, atol=1e-5)
    assert torch.equal(static.dkv.lengths, eager.dkv.lengths)
    for row, n in enumerate(eager.dkv.lengths.tolist()):
        torch.testing.assert_close(static.dkv.keys[0][row, :, :n], eager.dkv.k[row, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(static.dkv.values[0][row, :, :n], eager.dkv.v[row, :, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@torch.inference_mode()
def test_context_rounds_give_todays_tokens(sampling):
    """Rounds with a prompt-lookup chain grafted under the tree (its own depth: the accepted path's width comes
    from the longer of the two) give today's tokens."""
    target = damped_tiny_llama(0.8, seed=3)
    draft, prompts = echo_draft(target), random_prompts(3, 512, seed=5)
    tree, modes = TreeConfig(3, 2, 6, context_chain=5), ["context", "plain", "tree", "context", "chain"] * 3
    eager = decode(target, draft, prompts, sampling, modes, tree=tree)
    assert decode(target, draft, prompts, sampling, modes, StaticConfig(capacity=256), tree=tree) == eager


@pytest.mark.parametrize("rows", [4, 2], ids=["spare-rows", "falls-back"])
def test_the_serving_engine_on_static_caches_equals_plain(rows, caplog):
    """The engine (no Ray) with `EngineConfig.static`: auto policy, requests arriving while others decode (joining
    the running lane's static caches, or falling back to eager where its rows are too few), greedy and sampled
    lanes: every request gets plain decoding's tokens."""
    from pipelines.serve.engine import Engine, EngineConfig

    target = damped_tiny_llama(0.8, seed=3)
    prompts = random_prompts(6, 512, seed=9)
    requests = []
    for sampling in (GREEDY, SAMPLED):
        plain = generate(target, prompts, max_new_tokens=16, temperature=sampling.temperature, top_p=sampling.top_p,
                         top_k=sampling.top_k, seed=100).tokens
        requests += [(p, 16, sampling, 100 + i, want) for i, (p, want) in enumerate(zip(prompts, plain))]
    config = EngineConfig(TreeConfig(3, 4, 10), max_batch_size=4, max_waiting=12, explore_every=2,
                          static=StaticConfig(capacity=128, rows=rows))
    with caplog.at_level("WARNING", logger="eagle_core.static_kv"):
        done = run_engine(Engine(target, IdTokenizer(), echo_draft(target), config), [r[:4] for r in requests])
    for event, request in zip(done, requests):
        assert event.kind == "done", event.text
        assert event.token_ids == request[4]
    fell_back = [r for r in caplog.records if r.name == "eagle_core.static_kv" and "rows joining" in r.getMessage()]
    assert bool(fell_back) == (rows == 2)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@torch.inference_mode()
def test_rows_leave_and_join_in_place_and_no_buffer_moves(sampling):
    """Row 1 leaves, two prefilled rows join (into the caches' spare rows): today's tokens, and every buffer of the
    batch's target and draft caches (keys, values, lengths) keeps its `data_ptr()` across rounds, the selection and
    the merge."""
    target = damped_tiny_llama(0.8, seed=3)
    draft, prompts = echo_draft(target), random_prompts(5, 512, seed=5)
    eager = decode(target, draft, prompts, sampling, MODES, join=prompts[3:], leave=2)
    seen = {}

    def same_buffers(state):
        pointers = [t.data_ptr() for kv in (state.kv, state.dkv) for t in kv.buffers()]
        assert seen.setdefault("pointers", pointers) == pointers

    static = StaticConfig(capacity=256, rows=4)
    assert decode(target, draft, prompts, sampling, MODES, static, prompts[3:], 2, same_buffers) == eager
    assert len(eager) == 5 and min(len(t) for i, t in enumerate(eager) if i != 1) >= len(MODES) - 2


@torch.inference_mode()
def test_garbage_in_unused_slots_changes_no_token():
    """Before every round, every slot no row owns (past each row's length, and the spare rows) of the target's and
    the draft's caches is filled with large random values, and the spare rows' lengths with random ones: the masks
    never let a query see them, and the padding row the batch of 3 steps with (4 rows, `ROW_BUCKETS`) starts
    empty, so the tokens stay today's."""
    target = tiny_family_model("qwen2-window")  # full and sliding layers: both kinds of mask
    prompts = random_prompts(3, 256, lo=10, hi=20, seed=1)
    draft = random_draft(target, 256)
    g = torch.Generator().manual_seed(0)

    def garbage(state):
        for kv in (state.kv, state.dkv):
            lengths = torch.zeros_like(kv._lengths)
            lengths[: kv.batch] = kv.lengths  # spare rows own nothing
            for buf in (*kv.keys, *kv.values):
                unused = torch.arange(buf.shape[2])[None, :] >= lengths[:, None]  # [rows, capacity]
                noise = torch.randn(buf.shape, generator=g, dtype=buf.dtype) * 1e3
                buf.copy_(torch.where(unused[:, None, :, None], noise, buf))
            kv._lengths[kv.batch:] = torch.randint(0, kv.config.capacity + 1, (len(lengths) - kv.batch,), generator=g)

    eager = decode(target, draft, prompts, GREEDY, MODES)
    assert decode(target, draft, prompts, GREEDY, MODES, StaticConfig(capacity=128, rows=5), between=garbage) == eager


def eager_static_compiled(target, draft, prompts, sampling, tree=None):
    """Three decoding states of one batch (seeds 1, 2): today's eager caches, the static caches uncompiled, and
    the static caches with their steps compiled whole (fullgraph, the eager backend: tracing only)."""
    compiled = StaticConfig(capacity=128, compile=lambda f: torch.compile(f, fullgraph=True, backend="eager"))
    return [DecodingState.prefill(target, draft, prompts, sampling, tree, seeds=[1, 2], static=config)[0]
            for config in (None, StaticConfig(capacity=128), compiled)]


@torch.inference_mode()
def test_the_plain_step_traces_whole_and_compiles_once():
    """`torch._dynamo.explain`: one graph, no break; compiled with fullgraph=True, three steps (greedy, then seeded
    sampling) run without recompiling and give the eager steps' tokens."""
    from torch._dynamo.utils import counters

    target = tiny_family_model("llama")
    prompts = random_prompts(2, 256, lo=10, hi=20, seed=1)
    for sampling in (GREEDY, SAMPLED):
        torch._dynamo.reset()
        counters.clear()
        states = eager_static_compiled(target, None, prompts, sampling)
        kv = states[1].kv
        kv._reserve(1)
        explained = torch._dynamo.explain(kv._plain_step)(states[1].root, sampling, states[1].seeds, ())
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        torch._dynamo.reset()
        counters.clear()
        eager, static = states[0], states[2]
        for step in range(3):
            with torch._dynamo.config.patch(error_on_recompile=step > 0):
                assert static.step("plain").tokens == eager.step("plain").tokens
        assert counters["stats"]["unique_graphs"] == 1


@torch.inference_mode()
def test_the_verify_step_and_the_draft_loop_trace_whole_and_compile_once():
    """The verify step (tree forward, acceptance, keep of the accepted path) and the draft loop (levels, top-k,
    rerank, ancestor matrix): one graph each, no break; compiled with fullgraph=True, three tree rounds run without
    recompiling either and give the eager rounds' tokens."""
    from torch._dynamo.utils import counters

    target = tiny_family_model("qwen2-window")  # full and sliding layers
    prompts = random_prompts(2, 256, lo=10, hi=20, seed=1)
    draft, tree = random_draft(target, 256), TreeConfig(3, 4, 10)
    for sampling in (GREEDY, SAMPLED):
        torch._dynamo.reset()
        states = eager_static_compiled(target, draft, prompts, sampling, tree)
        state = states[1]
        state.dkv._reserve((tree.depth - 1) * tree.top_k)
        state.dkv.reserved = True
        explained = torch._dynamo.explain(_grow)(draft, state.dkv, state.draft_hidden, state.root, tree, 0)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        state.dkv.truncate_(state.dkv.width)
        drafted = state.dkv.draft_tree(draft, state.draft_hidden, state.root, tree)
        state.kv._reserve(drafted.size)
        explained = torch._dynamo.explain(state.kv._verify_step)(drafted, sampling, state.seeds,
                                                                  tuple(draft.config.aux_layer_ids), tree.depth + 1)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        torch._dynamo.reset()
        counters.clear()
        eager, static = states[0], states[2]
        for round_ in range(3):
            with torch._dynamo.config.patch(error_on_recompile=round_ > 0):
                assert static.step("tree").tokens == eager.step("tree").tokens
        assert counters["stats"]["unique_graphs"] == 2  # the draft loop and the verify step


@torch.inference_mode()
def test_trees_of_one_width_bucket_share_one_compiled_verify():
    """Trees of 9, 12 and 16 nodes are verified padded to 16 nodes, one of 5 to 8 (`WIDTH_BUCKETS`): two compiled
    graphs for four sizes, and every acceptance (path, accepted length, bonus) and every node's aux is the eager
    verify's (the padding nodes are never accepted, never kept and seen by no real node)."""
    from torch._dynamo.utils import counters

    target = tiny_family_model("llama")
    prompts, aux_ids = random_prompts(3, 256, lo=10, hi=20, seed=1), [1, 2, 3]
    compiled = StaticConfig(capacity=160, bucket=160,  # one attention width throughout
                            compile=lambda f: torch.compile(f, fullgraph=True, backend="eager"))
    eager, static = TargetKV(3, "cpu"), StaticKV(target, 3, compiled)
    for kv in (eager, static):
        prefill(target, kv, prompts, aux_ids)
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    for n in (9, 12, 16, 5):
        tree = random_tree(3, n, 256, g, among=4)  # depth <= 4: the accepted path is at most 5 wide
        past = eager.width
        hidden, aux = verify_hidden(target, eager, tree, aux_ids)
        want = accept(tree, lm_logits(target, hidden), GREEDY)
        eager.keep_new_(past, want.path, want.accept_length + 1)
        got, static_aux = static.verify(tree, GREEDY, None, aux_ids, 5)
        width = want.path.shape[1]
        assert torch.equal(got.path[:, :width], want.path) and torch.equal(got.accept_length, want.accept_length)
        assert torch.equal(got.bonus, want.bonus) and torch.equal(static.lengths, eager.lengths)
        torch.testing.assert_close(static_aux, aux, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 2


@torch.inference_mode()
def test_compiled_steps_give_todays_tokens_through_mode_switches_and_rows_leaving_and_joining():
    """`StaticConfig.compile` with fullgraph=True (a graph break anywhere would raise): plain, tree and chain rounds
    mixed, a batch of 4 rows where row 1 leaves after the first round (a tree and a plain round on 3 rows) and a row
    joins before the fourth. Every step runs on the batch's `ROW_BUCKETS` rows, 4 throughout, and attention reads
    one width (bucket = capacity): one graph per step, compiled once, whatever the rows in use: plain, the tree's
    and the chain's verify and draft loop, 5. Greedy only (seconds of tracing on 2 cores); the compiled sampled
    steps are checked above."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    target = damped_tiny_llama(0.8, seed=3)
    draft, prompts = echo_draft(target), random_prompts(5, 512, seed=5)
    eager = decode(target, draft, prompts, GREEDY, MODES, join=prompts[4:], leave=1)
    compiled = StaticConfig(capacity=256, rows=4, bucket=256,
                            compile=lambda f: torch.compile(f, fullgraph=True, backend="eager"))
    assert decode(target, draft, prompts, GREEDY, MODES, compiled, prompts[4:], 1) == eager
    assert counters["stats"]["unique_graphs"] == 5


@torch.inference_mode()
def test_a_thousand_tokens_compile_each_step_once_whatever_the_cache_length():
    """Issue 55: with compiled steps and the default bucket (the whole capacity), 1 000 tokens of plain decoding
    compile the plain step once (batch 1: one row bucket), though the cache grows from 12 to 1 012 slots (at the
    former 64-slot buckets, 16 compiles); a second generation (new caches, another prompt length) compiles nothing
    more. 1 000 tokens of tree rounds, a tree whose node count varies round to round inside one `WIDTH_BUCKETS`
    bucket (the context chain's lookup tokens come and go), compile the verify and the draft loop once each, and
    every token is the eager path's. dynamo's compiles are counted per step (a `CompileCounter` backend each:
    tracing only, no code generated)."""
    from torch._dynamo.testing import CompileCounter

    counters = {}

    def counted(step):
        counter = counters.setdefault(step.__name__, CompileCounter())
        return torch.compile(step, fullgraph=True, backend=counter)

    def compiles():  # steps compiled at least once: compiles each
        return {name: c.frame_count for name, c in counters.items() if c.frame_count}

    torch._dynamo.reset()
    target = damped_tiny_llama(0.8, seed=3)
    draft, prompts = echo_draft(target), random_prompts(2, 512, lo=10, hi=14, seed=7)
    config = StaticConfig(capacity=1100, compile=counted)
    assert config.attention_bucket == 1100 and StaticConfig(capacity=1100).attention_bucket == 64
    for prompt in prompts:
        eager = generate(target, [prompt], max_new_tokens=1000).tokens
        assert generate(target, [prompt], max_new_tokens=1000, static=config).tokens == eager
    assert compiles() == {"_plain_step": 1}
    tree = TreeConfig(3, 4, 10, context_chain=3)
    eager = generate(target, prompts[:1], draft=draft, tree=tree, mode="context", max_new_tokens=1000)
    static = generate(target, prompts[:1], draft=draft, tree=tree, mode="context", max_new_tokens=1000,
                      static=config)
    assert static.tokens == eager.tokens and len(static.tokens[0]) == 1000
    assert len(static.stats[0].accept_lengths) > 100  # hundreds of rounds, of several tree sizes, one graph each
    assert compiles() == {"_plain_step": 1, "_verify_step": 1, "_grow": 1}


COMPILE_ONCE = """
import json, sys, torch
from torch._dynamo.utils import counters
from eagle_core.generate import generate
from eagle_core.static_rows import StaticConfig, inductor
from eagle_core.target import make_tiny_llama
torch.manual_seed(0)
target = make_tiny_llama(num_hidden_layers=2)
config = StaticConfig(capacity=64, compile=inductor())
tokens = generate(target, [[5, 6, 7]], max_new_tokens=4, static=config).tokens
print(json.dumps({"tokens": tokens, "hit": counters["inductor"]["fxgraph_cache_hit"],
                  "miss": counters["inductor"]["fxgraph_cache_miss"], "dir": __import__("os").environ[
                  "TORCHINDUCTOR_CACHE_DIR"]}))
"""


def test_a_second_process_loads_the_compiled_step_from_the_machines_cache(tmp_path):
    """`inductor()` keeps torch's compile caches under EAGLE3_CACHE/torch-compile (not torch's /tmp default): the
    first process compiles the plain step (an Inductor FX-graph cache miss), a second process on the same machine
    finds it there (a hit, no miss) and decodes the same tokens."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(EAGLE3_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    runs = [json.loads(subprocess.run([sys.executable, "-c", COMPILE_ONCE], env=env, capture_output=True, text=True,
                                      check=True, timeout=600).stdout.splitlines()[-1]) for _ in range(2)]
    assert runs[0]["dir"] == runs[1]["dir"] == str(tmp_path / "cache" / "torch-compile")
    assert runs[0]["miss"] >= 1 and runs[0]["hit"] == 0
    assert runs[1]["hit"] >= 1 and runs[1]["miss"] == 0
    assert runs[0]["tokens"] == runs[1]["tokens"]


@torch.inference_mode()
def test_padding_rows_change_no_token_of_the_real_rows():
    """A batch of 3 rows steps on 4 (`ROW_BUCKETS`): its plain step and its verify (seeded sampling) give the real
    rows the tokens, acceptance, features and cache entries they get when row 3 is a real row with its own prompt and
    ids, though the padding row holds garbage entries and a garbage length before each step."""
    target = tiny_family_model("llama")
    prompts, aux_ids = random_prompts(4, 256, lo=10, hi=20, seed=1), [1, 2, 3]
    kv = StaticKV(target, 4, StaticConfig(capacity=64, bucket=64))
    logits, _, _, _ = prefill(target, kv, prompts, aux_ids)
    snapshot, width = [t.clone() for t in kv.buffers()], kv.width
    token, seeds = logits.argmax(-1), torch.tensor([5, 6, 7, 8])
    tree = random_tree(4, 9, 256, torch.Generator().manual_seed(0))
    levels = int(tree.depth.max()) + 1

    def run(b: int):
        for buf, saved in zip(kv.buffers(), snapshot):
            buf.copy_(saved)
        kv.batch, kv.width = 4, width
        kv.select_rows_(torch.arange(b))
        outs = []
        for step in ("plain", "verify"):
            if b < 4:  # the padding row: garbage entries, a garbage length
                for buf in (*kv.keys, *kv.values):
                    buf[3].normal_(0, 1e3)
                kv._lengths[3] = 64
            if step == "plain":
                outs += kv.plain_step(token[:b], SAMPLED, seeds[:b], aux_ids)
            else:
                acc, aux = kv.verify(first_rows(tree, b), SAMPLED, seeds[:b], aux_ids, levels)
                outs += [acc.path, acc.accept_length, acc.bonus, aux]
        return outs + [t[:3, :, : kv.width] for t in (*kv.keys, *kv.values)] + [kv.lengths[:3]]

    alone, padded = run(4), run(3)
    for mine, theirs in zip(padded, alone):
        assert torch.equal(mine, theirs[:3])


def test_the_gpu_benchmark_times_the_static_path_and_checks_its_tokens(tmp_path):
    """`bench.gpu --tiny` (on the CPU): the static path's plain and verify steps timed beside the eager ones (ratios
    from its own times), and its 32 greedy steps equal to the eager loop's."""
    import json

    import bench.gpu as gpu

    out = tmp_path / "gpu.json"
    assert gpu.main(["--tiny", "--no-ttt", "--targets", "llama3.1-8b", "--out", str(out)]) == 0
    d = json.loads(out.read_text())["targets"]["llama3.1-8b"]["decode"]
    st = d["static"]["static"]
    assert st["tokens_equal_eager"] is True and st["greedy_steps"] == 32
    assert list(st["verify_ms"]) == [str(w) for w in gpu.TINY["widths"]]
    assert abs(st["plain_over_eager"] - st["plain_step_ms"] / d["plain"]["our_step_ms"]) < 1e-9
    assert "Static path (static): plain step" in out.with_suffix(".md").read_text()


@torch.inference_mode()
def test_what_does_not_fit_is_refused_before_anything_is_written():
    """A forward past the capacity and a merge past the spare rows raise `CacheFull` and leave the cache as it was;
    a target spread over several devices is refused (it decodes eagerly; every family of the matrix is on the path,
    any other is refused by name the same way)."""
    target = tiny_family_model("llama")
    prompts = random_prompts(2, 256, lo=10, hi=20, seed=1)
    state, _ = DecodingState.prefill(target, None, prompts, GREEDY, static=StaticConfig(capacity=24))
    kv, token = state.kv, state.root
    before = [t.clone() for t in kv.buffers()]
    with pytest.raises(CacheFull, match="StaticConfig.capacity"):
        while True:
            token, _ = kv.plain_step(token, GREEDY)
    after = [t.clone() for t in kv.buffers()]
    assert kv.width == 24 and all(torch.equal(a, b) for a, b in zip(after, kv.buffers()))
    other, _ = DecodingState.prefill(target, None, prompts[:1], GREEDY, static=StaticConfig(capacity=24))
    with pytest.raises(CacheFull, match="rows"):
        kv.merge_(other.kv)
    assert kv.batch == 2 and all(torch.equal(a, b) for a, b in zip(after, kv.buffers()))
    assert not all(torch.equal(a, b) for a, b in zip(before, after))  # the steps before did write
    spread = tiny_family_model("llama")
    spread.model.layers[-1].to("meta")
    with pytest.raises(UnsupportedTarget, match="several devices decodes eagerly"):
        StaticKV(spread, 1)


@torch.inference_mode()
def test_llama4_keeps_to_its_temperature_tuning_bound_where_the_eager_path_does():
    """Llama 4's no-RoPE layers scale queries by the cache length from `floor_scale` on (24 here: a bound of 23
    tokens), by exactly 1 before it: up to the bound the static path gives the eager path's logits and tokens, plain
    and tree rounds; past it a direct forward is refused as the eager one is, and a batch hands its rows to the eager
    cache, which refuses at the same token as today (a 12-token prompt and 9, 11 or 16 new tokens). Fails when the
    static forward's scale is not 1 (`get_seq_length`) or the eager cache it hands over is wider than its longest
    row (a tree round's fallback then refuses earlier than today)."""
    target = tiny_family_model("llama4")
    target.config.floor_scale = 24
    for layer in target.model.layers:
        layer.self_attn.floor_scale = 24
    draft, prompt = random_draft(target, 256), random_prompts(1, 256, lo=12, hi=13, seed=1)

    def outcome(**kw):
        try:
            return generate(target, prompt, draft=draft, tree=TreeConfig(2, 2, 3), **kw).tokens
        except UnsupportedTarget as err:
            return str(err)

    outcomes = []
    for mode in ("plain", "tree"):
        for n in (9, 11, 16):
            eager = outcome(mode=mode, max_new_tokens=n)
            assert outcome(mode=mode, max_new_tokens=n, static=StaticConfig(capacity=64, bucket=16)) == eager
            outcomes.append(isinstance(eager, str))
    assert outcomes == [False, False, True, False, True, True]  # tree rounds verify nodes past the cache: 11 refused
    logits = [prefill(target, kv, [list(range(3, 26))], None)[0] for kv in (TargetKV(1, "cpu"), StaticKV(
        target, 1, StaticConfig(capacity=64, bucket=16)))]  # 23 tokens: the scale still 1, the same logits
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(UnsupportedTarget, match="Llama 4: attention temperature tuning"):
        prefill(target, StaticKV(target, 1, StaticConfig(capacity=64, bucket=16)), [list(range(3, 27))], None)


@torch.inference_mode()
def test_a_step_that_fails_to_compile_runs_uncompiled_with_one_log_line(caplog):
    """A compile whose steps run once and then fail (as a CUDA graph's capture may, out of memory, after its warm-up
    has written the buffers): each of the three steps is run uncompiled from then on, one log line each, and the
    tokens are today's (the lengths the failed call moved are put back)."""
    def run_then_fail(step):
        def compiled(*args):
            step(*args)
            raise RuntimeError("CUDA graph capture failed: out of memory")
        return compiled

    target = damped_tiny_llama(0.8, seed=3)
    draft, prompts = echo_draft(target), random_prompts(3, 512, seed=5)
    eager = decode(target, draft, prompts, GREEDY, MODES)
    with caplog.at_level("WARNING", logger="eagle_core.static_kv"):
        assert decode(target, draft, prompts, GREEDY, MODES, StaticConfig(capacity=256, compile=run_then_fail)) == eager
    lines = sorted(r.getMessage() for r in caplog.records if r.name == "eagle_core.static_kv")
    assert [line.split(" uncompiled")[0] for line in lines] == [
        f"static decoding runs its {step}" for step in ("draft loop", "plain step", "verify step")]
    assert all("RuntimeError: CUDA graph capture failed: out of memory" in line for line in lines)


@pytest.mark.parametrize("short, why", [("context", "StaticConfig.capacity"), ("rows", "rows joining"),
                                        ("wide", "wider than the widest compiled step (64"),
                                        ("many", "17 rows are more than the largest compiled batch (16")])
@torch.inference_mode()
def test_what_does_not_fit_decodes_on_eagerly_with_one_log_line(short, why, caplog):
    """A batch whose context outgrows the capacity, whose joining rows outnumber the spare ones, whose tree is wider
    than the widest verify bucket (71 tokens) or whose rows (2 + 15 joining) outnumber the largest row bucket hands
    its rows to the eager cache once (one log line saying why) and gives today's tokens."""
    target = damped_tiny_llama(0.8, seed=3)
    draft, prompts = echo_draft(target), random_prompts(18 if short == "many" else 5, 512, seed=5)
    tree = TreeConfig(4, 10, 70) if short == "wide" else TreeConfig(3, 4, 10)
    eager = decode(target, draft, prompts, GREEDY, MODES, join=prompts[3:], leave=2, tree=tree)
    static = {"context": StaticConfig(capacity=48, rows=4), "rows": StaticConfig(capacity=256, rows=3)}.get(
        short, StaticConfig(capacity=256, rows=32))
    with caplog.at_level("WARNING", logger="eagle_core.static_kv"):
        assert decode(target, draft, prompts, GREEDY, MODES, static, prompts[3:], 2, tree=tree) == eager
    lines = [r.getMessage() for r in caplog.records if r.name == "eagle_core.static_kv"]
    assert len(lines) == 1 and "falls back to eager" in lines[0] and why in lines[0], lines
