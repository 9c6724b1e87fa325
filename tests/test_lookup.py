"""Context candidates: the prompt lookup's proposals, and the context chain grafted into a draft tree."""

import pytest
import torch

from decode_helpers import drafted_batch, single_thread  # noqa: F401 (autouse fixture)
from eagle_core.lookup import MAX_NGRAM, MIN_NGRAM, ContextIndex, context_yield
from eagle_core.tree import NO_TOKEN, TreeConfig, draft_accept_length, graft_chain, tree_from_parents
from test_tree import naive_ancestors


def naive_proposal(tokens: list[int], length: int) -> list[int]:
    """The definition: the longest n (MAX_NGRAM down to MIN_NGRAM) whose last n tokens occurred earlier, its most
    recent earlier occurrence, and what followed it, read on past the text's end at the same shift."""
    for n in range(min(MAX_NGRAM, len(tokens) - 1), MIN_NGRAM - 1, -1):
        suffix = tokens[-n:]
        starts = [s for s in range(n, len(tokens)) if tokens[s - n: s] == suffix]  # s: where a continuation starts
        if starts:
            text = list(tokens)
            shift = len(tokens) - starts[-1]
            for _ in range(length):
                text.append(text[-shift])
            return text[len(tokens):]
    return []


def test_lookup_proposes_the_longest_most_recent_match_incrementally():
    """Against the definition, on random texts of a small vocabulary (many matches of every length), built in
    one go and token by token (the index is updated lazily between proposals)."""
    g = torch.Generator().manual_seed(0)
    checked = 0
    for trial in range(60):
        vocab = 3 + trial % 6
        text = torch.randint(0, vocab, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        grown = ContextIndex(text[:1])
        for i in range(2, len(text) + 1):
            grown.extend(text[i - 1: i])
            if i % 3 == 0 or i == len(text):
                assert grown.propose(7) == naive_proposal(text[:i], 7), (text[:i])
                checked += 1
        assert ContextIndex(text).propose(5) == naive_proposal(text, 5)
    assert checked > 300


def test_lookup_copies_a_quoted_span_and_repeats_a_loop_whole():
    quote = [11, 12, 13, 14, 15, 16, 17, 18]
    prompt = [1, 2] + quote + [3, 4, 5]
    # the answer starts copying the quote: the lookup proposes the rest of it
    assert ContextIndex(prompt + quote[:3]).propose(5) == quote[3:8]
    # no bigram of the suffix occurred before: nothing
    assert ContextIndex([1, 2, 3, 4, 5]).propose(4) == []
    # a loop of period 3 is proposed past the end of the text
    assert ContextIndex([7, 8, 9, 7, 8, 9, 7, 8]).propose(7) == [9, 7, 8, 9, 7, 8, 9]
    # the most recent occurrence wins over an older one
    assert ContextIndex([5, 6, 1, 0, 5, 6, 2, 0, 5, 6]).propose(1) == [2]


def test_context_yield_is_what_the_chain_adds():
    assert context_yield([4, 5, 6], [4, 5, 9]) == 3  # agrees on 2 of 3 committed: nothing more
    assert context_yield([4, 5, 6], [4, 5]) == 3  # agrees with every committed token: at least one more
    assert context_yield([], [4]) == 1 and context_yield([7], [4, 2]) == 2


def test_a_grafted_chain_merges_into_the_tree_then_branches():
    """Row 0: the chain's first two tokens are a tree path (merged), its third is new (grafted under their node);
    row 1: no tree child carries its first token (grafted under the root); row 2: no proposal. Depths are path
    depths, siblings stay distinct, unused slots are never a target token, and the draft's share of a path
    stops where the path enters the chain."""
    #            root  1   2   3   4   5
    tokens = torch.tensor([[9, 20, 21, 30, 31, 32]] * 3)
    parents = torch.tensor([[0, 0, 0, 1, 1, 3]] * 3)  # 1,2 under root; 3,4 under 1; 5 under 3
    tree = tree_from_parents(tokens, parents)
    chain = torch.tensor([[20, 30, 40, 41], [50, 51, NO_TOKEN, NO_TOKEN], [NO_TOKEN] * 4])
    g = graft_chain(tree, chain)
    assert g.size == 10 and g.draft_size == 6 and torch.equal(g.context, chain)
    assert g.tokens[0, 6:].tolist() == [NO_TOKEN, NO_TOKEN, 40, 41] and g.parents[0, 8:].tolist() == [3, 8]
    assert g.tokens[1, 6:].tolist() == [50, 51, NO_TOKEN, NO_TOKEN] and g.parents[1, 6:8].tolist() == [0, 6]
    assert g.tokens[2, 6:].tolist() == [NO_TOKEN] * 4
    assert g.depth[0, 8:].tolist() == [3, 4] and g.depth[1, 6:8].tolist() == [1, 2]
    for b in range(3):
        assert torch.equal(g.ancestors[b], naive_ancestors(g.parents[b].tolist()))
        kids = {}
        for i in range(1, g.size):
            if g.tokens[b, i] != NO_TOKEN:
                kids.setdefault(int(g.parents[b, i]), []).append(int(g.tokens[b, i]))
        assert all(len(k) == len(set(k)) for k in kids.values())
    assert g.forward_tokens().min() >= 0 and torch.equal(g.tokens[:, :6], tokens)
    assert (g.rank[:, 6:] > g.rank[:, :6].max()).all()
    # accepted paths: row 0 root-1-3-8-9 (into the chain at depth 3), row 1 root-6-7, row 2 root-1-3-5
    path = torch.tensor([[0, 1, 3, 8, 9], [0, 6, 7, 7, 7], [0, 1, 3, 5, 5]])
    assert draft_accept_length(g, path, torch.tensor([4, 2, 3])).tolist() == [2, 0, 3]


@torch.inference_mode()
def test_grafting_onto_a_drafted_tree_keeps_the_draft_tree_and_every_chain_token_on_one_path():
    from eagle_core.tree import draft_tree

    draft, dkv, hidden, root = drafted_batch()
    tree = draft_tree(draft, dkv, hidden, root, TreeConfig(4, 3, 12))
    # chains that start along the draft's best path, then leave it
    best = [tree.tokens[b, 1].item() for b in range(3)]
    chain = torch.tensor([[best[0], 5, 6, 7, 8], [11, 12, 13, NO_TOKEN, NO_TOKEN], [best[2], 14, 15, 16, 17]])
    g = graft_chain(tree, chain)
    for name in ("tokens", "parents", "depth", "rank"):
        assert torch.equal(getattr(g, name)[:, :tree.size], getattr(tree, name))
    for b in range(3):
        proposal = [t for t in chain[b].tolist() if t != NO_TOKEN]
        node = None
        for i in range(g.size):  # the deepest node whose root path spells the proposal
            walk = [j for j in range(g.size) if g.ancestors[b, i, j]][1:]
            if [g.tokens[b, j].item() for j in walk] == proposal:
                node = i
        assert node is not None and g.depth[b, node] == len(proposal)


@pytest.mark.parametrize("length", [0, 3])
def test_tree_config_takes_a_context_chain(length):
    assert TreeConfig(4, 4, 8, context_chain=length).context_chain == length
    with pytest.raises(ValueError):
        TreeConfig(4, 4, 8, context_chain=-1)


def test_a_chain_never_counts_a_context_slot_as_the_drafts_best_child():
    """`chain_accept_length` on a grafted tree: a chain slot hanging under a leaf of the draft's tree is that leaf's
    only child, yet no draft chain would have proposed it."""
    from eagle_core.tree import chain_accept_length

    tree = tree_from_parents(torch.tensor([[9, 20, 21, 30, 31, 32]]), torch.tensor([[0, 0, 0, 1, 1, 3]]))
    g = graft_chain(tree, torch.tensor([[20, 30, 32, 40]]))  # merged down to leaf 5, then slot 9 under it
    assert g.parents[0, 9].item() == 5 and g.tokens[0, 9].item() == 40
    path, accepted = torch.tensor([[0, 1, 3, 5, 9]]), torch.tensor([4])
    assert chain_accept_length(g, path, accepted).tolist() == [3]
    assert draft_accept_length(g, path, accepted).tolist() == [3]
