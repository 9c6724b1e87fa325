"""Training on several features sources (`TrainJobConfig.features` as a list of `FeatureSource`s): each epoch draws
its training rows from the sources by weight (`plan.mix_rows`), and a source's conversations below its `holdout` by
id hash are never read (`plan.held_out_by_hash`). Retraining from traffic mixes a traffic sink's output in this way
(tests/test_retrain_traffic.py: the held-out slice on real shards).

Properties: the stated fraction of every epoch's rows comes from each source, a smaller source repeating its rows and
a larger one subsampled anew each epoch, and the plan still hands each rank its rows in step order (repeated rows
included, or the workers would skip them); one source plans exactly as before; the held-out bound is decided per
conversation, so it is stable as a source grows; a malformed list of sources is refused.
"""

from collections import Counter

import pytest

from pipelines.train.config import TrainJobConfig
from pipelines.train.plan import held_out_by_hash, make_plan, mix_rows


def rows_of(source: int, files: int, per_file: int) -> list[dict]:
    return [{"id": f"s{source}-f{f}-r{r}", "file": f"src{source}/f{f}.parquet", "row": r, "length": 5 + (r % 7),
             "source": source} for f in range(files) for r in range(per_file)]


def test_each_epoch_draws_the_stated_fraction_from_traffic_and_every_drawn_row_is_planned():
    base, traffic = rows_of(0, 3, 30), rows_of(1, 1, 12)  # 90 base rows, 12 traffic rows
    config = TrainJobConfig(features="x", epochs=3, tokens_per_batch=64, seed=4)
    plan, epochs, _ = make_plan(base + traffic, [], config, world=2, weights=[0.75, 0.25])
    samples = []
    for e, per_rank in enumerate(epochs):
        entries = [x for rank in per_rank for x in rank]
        by_source = Counter(x["file"].split("/")[0] for x in entries)
        assert len(entries) == 102 and by_source == {"src0": 76, "src1": 26}  # round(102 * 0.25) from traffic
        repeats = Counter((x["file"], x["row"]) for x in entries if x["file"].startswith("src1"))
        assert sorted(set(repeats.values())) == [2, 3]  # 26 = 12 * 2 + 2: every traffic row twice, 2 of them thrice
        base_drawn = [(x["file"], x["row"]) for x in entries if x["file"].startswith("src0")]
        assert len(set(base_drawn)) == 76  # subsampled without repeats
        samples.append(set(base_drawn))
        for rank in per_rank:  # the workers read a rank's rows in step order (batches.planned_micro_batches)
            assert [x["step"] for x in rank] == sorted(x["step"] for x in rank)
        assert sum(1 for rank in per_rank for _ in rank) == sum(1 for _ in entries)
        assert plan.steps_per_epoch[e] == 1 + max(x["step"] for x in entries)
    assert samples[0] != samples[1]  # a new sample of the larger source each epoch
    # one source: every row exactly once, as before mixing existed
    assert sorted(map(id, mix_rows(base, [1.0], 4, 0))) == sorted(map(id, base))


def test_the_held_out_bound_is_per_conversation_and_stable():
    ids = [f"conv-{i}" for i in range(4000)]
    held = {c for c in ids if held_out_by_hash(c, 0.1)}
    assert 300 < len(held) < 500  # about a tenth
    assert held <= {c for c in ids if held_out_by_hash(c, 0.2)}  # a larger slice keeps the smaller one
    assert not any(held_out_by_hash(c, 0.0) for c in ids)


def test_a_malformed_list_of_sources_is_refused():
    for features, message in (([], "non-empty list"), ([{"url": "a", "weight": -1}], "weights must be >= 0"),
                              ([{"url": "a", "weight": 0}], "not all 0"), ([{"url": "a", "holdout": 1}], r"\[0, 1\)"),
                              ([{"url": "a", "ratio": 1}], "a source is a URL")):
        with pytest.raises(ValueError, match=message):
            TrainJobConfig(features=features)


def test_sources_of_another_dtype_or_aux_layers_are_not_mixed():
    from types import SimpleNamespace

    from pipelines.feature_files import FingerprintMismatch
    from pipelines.train.config import feature_sources
    from pipelines.train.driver import check_sources_agree

    def manifest(**kw):
        return SimpleNamespace(**{"target_hidden_size": 64, "target_vocab_size": 512, "aux_layer_ids": [1, 2, 3],
                                  "dtype": "float32", **kw})

    sources = feature_sources(["base", "traffic"])
    check_sources_agree(sources, [manifest(), manifest()])
    with pytest.raises(FingerprintMismatch, match=r"traffic \(mixed with base\).*aux_layer_ids.*dtype: 'float32' -> "
                                                  "'bfloat16'"):
        check_sources_agree(sources, [manifest(), manifest(dtype="bfloat16", aux_layer_ids=[1, 2, 4])])
