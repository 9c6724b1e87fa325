"""EAGLE-2 tree building: structure invariants, and equality with a naive per-path draft computation."""

import pytest
import torch

from decode_helpers import drafted_batch, single_thread  # noqa: F401 (autouse fixture)
from eagle_core.decoding import draft_extend
from eagle_core.kv import DraftKV
from eagle_core.tree import TreeConfig, ancestor_matrix, draft_tree


def naive_ancestors(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        anc[i, j] = True
        while j != 0:
            j = parents[j]
            anc[i, j] = True
    return anc


def test_ancestor_matrix_equals_parent_walk():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 5, 17, 64):
        parents = [0] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        # a chain too: the deepest case for pointer doubling
        for ps in (parents, [0] + list(range(n - 1))):
            got = ancestor_matrix(torch.tensor([ps]))[0]
            assert torch.equal(got, naive_ancestors(ps))


@pytest.fixture(scope="module")
def setup():
    return drafted_batch()


@pytest.mark.parametrize("config", [TreeConfig(4, 4, 20), TreeConfig(3, 5, 40), TreeConfig.chain(5),
                                    TreeConfig(2, 3, 100)])
def test_tree_structure(setup, config):
    draft, dkv, hidden, root = setup
    tree = draft_tree(draft, dkv, hidden, root, config)
    n = config.size + 1
    assert tree.tokens.shape == (3, n)
    assert torch.equal(tree.tokens[:, 0], root)
    for b in range(3):
        parents = tree.parents[b].tolist()
        assert all(parents[i] < i for i in range(1, n))  # parents first: a connected, topological tree
        assert int(tree.depth[b].max()) <= config.depth
        score = tree.score[b]
        assert all(score[i] <= score[parents[i]] + 1e-12 for i in range(1, n))
        children = {}
        for i in range(1, n):
            children.setdefault(parents[i], []).append(int(tree.tokens[b, i]))
        assert all(len(c) == len(set(c)) for c in children.values())  # siblings are distinct tokens
        assert all(len(c) <= config.top_k for c in children.values())
        assert torch.equal(tree.ancestors[b], naive_ancestors(parents))


@torch.inference_mode()
def test_tree_scores_equal_per_path_draft(setup):
    """Each node's score is the sum of draft log-probs along its path, computed as a plain chain.

    The tree drafts all frontier nodes in one forward with a tree mask; running every path alone
    (causal, no tree) must give the same numbers, which checks the mask, the positions and the
    own-hidden-state recursion of the tree.
    """
    draft, dkv, hidden, root = setup
    tree = draft_tree(draft, dkv, hidden, root, TreeConfig(3, 4, 25))
    for b in range(3):
        parents = tree.parents[b].tolist()
        past = (dkv.k[b:b + 1, :, : dkv.lengths[b]], dkv.v[b:b + 1, :, : dkv.lengths[b]])
        for node in range(1, tree.size):
            path = []
            j = node
            while j != 0:
                path.append(j)
                j = parents[j]
            path.reverse()
            h, kv, total = hidden[b:b + 1], past, 0.0
            for step, j in enumerate(path):
                logp = torch.log_softmax(draft.compute_logits(h)[0, -1].float(), -1)  # as the tree does
                target_ids = draft.draft_to_target(torch.arange(logp.shape[0]))
                total += float(logp[target_ids == tree.tokens[b, j]][0])
                pos = torch.tensor([[int(dkv.lengths[b]) + step]])
                out, (k, v) = draft(h, tree.tokens[b:b + 1, j:j + 1], pos, past_kv=kv)
                kv = (torch.cat([kv[0], k], 2), torch.cat([kv[1], v], 2))
                h = out
            assert abs(total - float(tree.score[b, node])) < 1e-5, (b, node, path, total, tree.score[b])


@torch.inference_mode()
def test_the_draft_cache_is_written_in_place_and_a_tree_leaves_it_as_it_was(setup):
    """Extensions and tree levels write the draft's cache into the spare room of one buffer (no copy of the cache
    per level or round), a tree gives back the cache it found, and extending a ragged batch round by round holds
    what one extension over the same features holds."""
    draft = setup[0]
    dtype = draft.fc.weight.dtype
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(2, 24, 3 * draft.config.target_hidden_size, generator=g, dtype=dtype)
    tokens = torch.randint(0, draft.config.target_vocab_size, (2, 24), generator=g)
    rounds = [[10, 8], [3, 5], [1, 4], [6, 2]]  # features committed per round, per row
    dkv, done, buffer = DraftKV(2, "cpu"), [0, 0], None
    for i, n in enumerate(rounds):
        a, t = torch.zeros(2, max(n), aux.shape[-1], dtype=dtype), torch.zeros(2, max(n), dtype=torch.long)
        for b in range(2):
            a[b, :n[b]], t[b, :n[b]] = aux[b, done[b]:done[b] + n[b]], tokens[b, done[b]:done[b] + n[b]]
            done[b] += n[b]
        hidden = draft_extend(draft, dkv, a, t, torch.tensor(n))
        buffer = buffer or dkv.k.data_ptr()
        width, k, v = dkv.width, dkv.k.clone(), dkv.v.clone()
        draft_tree(draft, dkv, hidden, torch.tensor([3, 4]), TreeConfig(3, 4, 12))
        assert dkv.width == width and torch.equal(dkv.k, k) and torch.equal(dkv.v, v)
    assert dkv.k.data_ptr() == buffer  # one buffer all along
    assert dkv.lengths.tolist() == done
    whole = DraftKV(2, "cpu")
    draft_extend(draft, whole, aux[:, :max(done)], tokens[:, :max(done)], torch.tensor(done))
    for b in range(2):
        torch.testing.assert_close(dkv.k[b, :, :done[b]], whole.k[b, :, :done[b]])
        torch.testing.assert_close(dkv.v[b, :, :done[b]], whole.v[b, :, :done[b]])
