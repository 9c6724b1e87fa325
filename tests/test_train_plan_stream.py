"""Streaming training's first pass (`pipelines.train.plan.stream_first_pass`) streams the corpus through the driver
in chunks (issue 42, item 3, as the extraction driver does): it never collects the conversations (`take_all`), and
its token counts, lengths and held-out ids are those of tokenising the whole corpus at once."""

import json

import ray.data

from eagle_core.features import tokenize_for_training
from pipelines.data import ingest
from pipelines.extract import ExtractConfig
from pipelines.train.config import TrainJobConfig
from pipelines.train.plan import split_heldout, stream_first_pass


def test_first_pass_streams_and_matches_the_whole_corpus_at_once(ray_cluster, tiny_target_dir, tmp_path,
                                                                 monkeypatch):
    from transformers import AutoTokenizer

    corpus = tmp_path / "corpus.jsonl"
    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i} " * (1 + i % 5)},
                                              {"from": "gpt", "value": f"answer {i}"}]} for i in range(45)]
    rows.append(dict(rows[3], id="copy-of-3"))  # deduped by ingest: counted once
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    # pack_length=None: no packing check, so only what this test is about (the pass over the rows) is exercised.
    config = TrainJobConfig(corpus=str(corpus), target=str(tiny_target_dir), eval_fraction=0.2, pack_length=None)
    extract = ExtractConfig(corpus=str(corpus), target=str(tiny_target_dir), max_length=64, regenerate=False)

    # The reference: every conversation in hand, tokenised in one call (the first pass before it streamed).
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    tokenized, _ = tokenize_for_training(tokenizer, ingest(str(corpus)).dataset.take_all(), extract.max_length)
    counts = {}
    for _, ids, mask in tokenized:
        for t, m in zip(ids, mask):
            if m:
                counts[t] = counts.get(t, 0) + 1
    light = [{"id": cid, "length": len(ids)} for cid, ids, _ in tokenized]
    train, held = split_heldout(light, config.eval_fraction)
    expected = {"token_counts": counts, "rows": len(light), "tokens": sum(r["length"] for r in light),
                "eval_ids": sorted(r["id"] for r in held), "train_tokens": sum(r["length"] for r in train)}
    assert expected["rows"] == 45 and expected["eval_ids"]

    def collect(*args, **kwargs):
        raise AssertionError("the first pass collected the whole corpus in the driver (take_all)")

    monkeypatch.setattr(ray.data.Dataset, "take_all", collect)
    # Chunks of 7 rows: several chunks, the last one short.
    assert stream_first_pass(config, extract, chunk_rows=7) == expected
