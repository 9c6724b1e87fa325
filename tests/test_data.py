"""Corpus ingest: every row is kept, quarantined or deduped (and counted); nothing raises on bad input."""

import json
import random

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.data import (ingest, iter_file_records, load_mtbench_questions, normalize_record, parse_file,
                            QuarantineError, spread_indices)


def sharegpt(i, *turns):
    return {"id": f"c{i}", "conversations": [{"from": r, "value": v} for r, v in turns]}


def fuzzed_jsonl_lines(rng, n):
    """A mix of good rows, duplicates and every kind of malformed row, as raw bytes lines."""
    lines, expect = [], {"good": 0, "dupes": 0}
    good_rows = []
    for i in range(n):
        kind = rng.choice(["good", "good", "good", "dup", "bad_json", "bad_utf8", "wrong_type", "unknown_role",
                           "empty", "no_assistant", "leading_gpt", "openai", "not_object", "empty_turn"])
        if kind == "good":
            row = sharegpt(i, ("human", f"question {i} {rng.random()}"), ("gpt", f"answer {i}"))
            good_rows.append(row)
        elif kind == "dup" and good_rows:
            row = dict(rng.choice(good_rows), id=f"dup{i}")
        elif kind == "bad_json":
            lines.append(b'{"id": "x", "conversations": [ {"from": "human", "value": "unterminated')
            continue
        elif kind == "bad_utf8":
            lines.append(b'{"id": "u", "conversations": [{"from": "human", "value": "\xff\xfe bad"}]}')
            continue
        elif kind == "wrong_type":
            row = {"id": i, "conversations": [{"from": "human", "value": 42}, {"from": "gpt", "value": "a"}]}
        elif kind == "unknown_role":
            row = sharegpt(i, ("wizard", "hi"), ("gpt", "hello"))
        elif kind == "empty":
            row = {"id": f"e{i}", "conversations": []}
        elif kind == "no_assistant":
            row = sharegpt(i, ("human", "only a question"))
        elif kind == "leading_gpt":
            row = sharegpt(i, ("gpt", "tail of an earlier chat"), ("human", f"q{i}"), ("gpt", f"a{i}"))
        elif kind == "openai":
            row = {"id": f"o{i}", "messages": [{"role": "system", "content": "be brief"},
                                                {"role": "user", "content": [{"type": "text", "text": f"q{i}"}]},
                                                {"role": "assistant", "content": f"a{i}"}]}
        elif kind == "not_object":
            row = ["just", "a", "list"]
        else:
            row = sharegpt(i, ("human", "q"), ("gpt", "   "))
        lines.append(json.dumps(row).encode())
    return lines


def test_normalize_roles_and_trimming():
    messages, trimmed = normalize_record(
        sharegpt(0, ("system", "s"), ("gpt", "orphan"), ("Human", "q"), ("ChatGPT", "a"), ("user", "q2"), ("bard", "a2")))
    assert trimmed == 1
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    for bad, reason in [({"messages": "x"}, "messages_not_a_list"), ({}, "no_messages"),
                        (sharegpt(1, ("human", "q")), "no_assistant_turn")]:
        with pytest.raises(QuarantineError, match=reason):
            normalize_record(bad)


def test_truncated_json_array_yields_every_whole_record(tmp_path):
    rows = [sharegpt(i, ("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(50)]
    text = json.dumps(rows, indent=2)
    path = tmp_path / "corpus.json"
    path.write_text(text[: len(text) - 40])  # cut inside the last record
    parsed = parse_file({"path": str(path), "file_index": 0})
    kept = [r for r in parsed if r["status"] == "kept"]
    assert [r["id"] for r in kept] == [f"c{i}" for i in range(49)]
    assert [r["reason"] for r in parsed if r["status"] != "kept"] == ["truncated_record"]


def test_small_chunks_do_not_change_the_json_array_parse(tmp_path):
    from pipelines import data

    rows = [sharegpt(i, ("human", "q" * (i * 37 % 500)), ("gpt", f"a{i}")) for i in range(1, 40)]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(rows))
    with open(path, "rb") as f:
        small = list(data._iter_json_array(f, chunk_bytes=64))
    assert [r["id"] for r, err, _ in small] == [r["id"] for r in rows]


def test_fuzzed_corpus_never_raises_and_counts_add_up(ray_cluster):
    rng = random.Random(7)
    lines = fuzzed_jsonl_lines(rng, 400)
    with fsspec.open("memory://fuzz/corpus.jsonl", "wb") as f:
        f.write(b"\n".join(lines) + b"\n\n")
    out = ingest("memory://fuzz/corpus.jsonl")
    s = out.stats
    assert s.read == len(lines)
    assert s.kept + s.quarantined + s.deduped == s.read
    assert s.quarantined == sum(s.quarantined_by_reason.values())
    for reason in ["bad_json", "bad_utf8", "non_string_content", "unknown_role", "empty", "no_assistant_turn",
                   "not_an_object", "empty_turn"]:
        assert s.quarantined_by_reason.get(reason, 0) > 0, reason
    assert s.deduped > 0 and s.trimmed_rows > 0
    kept = out.dataset.take_all()
    assert len(kept) == s.kept
    assert len({r["id"] for r in kept}) == len(kept)
    assert len({json.dumps(r["messages"]) for r in kept}) == len(kept)
    for r in kept:
        assert r["messages"][-1]["role"] in ("assistant", "user")
        assert any(m["role"] == "assistant" for m in r["messages"])
        assert r["messages"][0]["role"] in ("system", "user")
    assert out.quarantine.count() == s.quarantined
    assert all(q["reason"] for q in out.quarantine.take_all())


def test_formats_agree_and_order_is_preserved(ray_cluster, tmp_path):
    rows = [sharegpt(i, ("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(30)]
    rows.append(dict(rows[3], id="copy-of-3"))
    rows.append({"id": "c0", "messages": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "x"}]})
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "a.json").write_text(json.dumps(rows))
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    table = pa.table({"id": [r["id"] for r in rows], "conversations": [json.dumps(r.get("conversations")) for r in rows]})
    # Parquet with a real nested column (what HF datasets write):
    nested = pa.Table.from_pylist([{"id": r["id"], "conversations": r.get("conversations") or [
        {"from": m["role"], "value": m["content"]} for m in r["messages"]]} for r in rows])
    pq.write_table(nested, tmp_path / "d.parquet")
    del table
    results = [ingest(str(p)) for p in (tmp_path / "json", tmp_path / "c.jsonl", tmp_path / "d.parquet")]
    ids = [[r["id"] for r in res.dataset.take_all()] for res in results]
    assert ids[0] == ids[1] == ids[2]
    assert ids[0][:30] == [f"c{i}" for i in range(30)]
    assert ids[0][30] == "c0#1"  # a distinct conversation reusing an id keeps its data under a new id
    for res in results:
        assert (res.stats.read, res.stats.kept, res.stats.deduped) == (32, 31, 1)


def test_limit_reads_a_prefix(tmp_path, ray_cluster):
    rows = [sharegpt(i, ("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(20)]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    out = ingest(str(tmp_path / "c.jsonl"), limit=5)
    assert [r["id"] for r in out.dataset.take_all()] == [f"c{i}" for i in range(5)]
    assert len(list(iter_file_records(str(tmp_path / "c.jsonl"), limit=3))) == 3


@pytest.mark.slow
def test_default_sharegpt_file_yields_all_whole_records():
    """The packaged ShareGPT JSON is truncated mid-record; every whole conversation before the cut is read."""
    from pipelines.data import default_corpus_path

    rows = parse_file({"path": default_corpus_path(), "file_index": 0})
    reasons = [r["reason"] for r in rows if r["status"] != "kept"]
    assert reasons.count("truncated_record") == 1 and rows[-1]["reason"] == "truncated_record"
    assert len(rows) > 17_000
    assert sum(r["status"] == "kept" for r in rows) > 16_000


def test_spread_mtbench_prompts_cover_every_category():
    questions = load_mtbench_questions()
    categories = {q["category"] for q in questions}
    assert len(questions) == 80 and len(categories) == 8
    for n in (8, 16):
        picked = spread_indices(n, len(questions))
        assert len(picked) == n and len(set(picked)) == n
        assert {questions[i]["category"] for i in picked} == categories
    assert spread_indices(100, 80) == list(range(80))
