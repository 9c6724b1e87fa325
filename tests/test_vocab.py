"""Draft vocabulary: counting under the loss mask, merging partial counts, the d2t/t2d mapping."""

import pytest
import torch

from eagle_core.vocab import (TokenCounter, build_vocab_mapping, check_vocab_mapping, count_tokens,
                              draft_ids_from_mapping)


def _rows(n=20, vocab=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        length = int(torch.randint(5, 40, (1,), generator=g))
        # Zipf-ish ids so that frequencies differ
        ids = (torch.rand(length, generator=g) ** 3 * vocab).long()
        yield ids, (torch.rand(length, generator=g) > 0.4).long()


def test_counts_only_masked_tokens():
    counter = TokenCounter(10).update([[1, 2, 2, 3]], [[1, 0, 1, 1]])
    assert counter.counts.tolist() == [0, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    assert counter.total == 3 and counter.distinct == 3


def test_merged_partial_counts_equal_one_pass():
    rows = list(_rows())
    whole = count_tokens(rows, 100)
    parts = [count_tokens(rows[i::3], 100) for i in range(3)]
    merged = TokenCounter(100)
    for p in parts:
        merged.merge(p)
    assert torch.equal(merged.counts, whole.counts)


def test_top_n_are_the_most_frequent():
    counter = count_tokens(_rows(), 100)
    d2t, t2d = build_vocab_mapping(counter, 16)
    ids = draft_ids_from_mapping(d2t)
    chosen = counter.counts[ids]
    rest = counter.counts[~t2d]
    assert chosen.min() >= rest.max()  # nothing left out is more frequent than anything kept
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and int(t2d.sum()) == 16
    check_vocab_mapping(d2t, t2d)


def test_pads_with_lowest_ids_when_corpus_is_small():
    counter = TokenCounter(50).update([7, 7, 9, 40])
    d2t, t2d = build_vocab_mapping(counter, 6)
    assert draft_ids_from_mapping(d2t).tolist() == [0, 1, 2, 7, 9, 40]
    check_vocab_mapping(d2t, t2d)


def test_rejects_bad_inputs():
    with pytest.raises(ValueError):
        TokenCounter(10).update([10])
    with pytest.raises(ValueError):
        build_vocab_mapping(torch.zeros(10), 11)
    d2t, t2d = build_vocab_mapping(torch.arange(10), 4)
    t2d[0] = True
    with pytest.raises(ValueError):
        check_vocab_mapping(d2t, t2d)
