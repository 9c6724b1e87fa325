"""Corpus ingest: every row is kept, quarantined or deduped (and counted); nothing raises on bad input."""

import json
import random

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.data import ingest, iter_file_records, load_mtbench_questions, parse_file, spread_indices
from pipelines.records import QuarantineError, normalize_record


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


# --------------------------------------------------------------------------------------------------
# Tool calls, tool results and reasoning, as OpenAI-format corpora carry them

def _call(name, arguments, call_id=None):
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return {**call, "id": call_id} if call_id else call


WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def tool_corpus():
    """(rows, {id: expected quarantine reason}) of an OpenAI-format corpus; every other row is well formed."""
    good = [
        {"id": "tool-call", "tools": WEATHER_TOOLS, "messages": [
            {"role": "system", "content": "Answer with the tools."},
            {"role": "user", "content": "Rain in Paris?"},
            {"role": "assistant", "content": None, "reasoning_content": "Look it up.",
             "tool_calls": [_call("get_weather", "{\"city\": \"Paris\"}", "call_1")]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"rain\": true}"},
            {"role": "assistant", "content": "Yes, it rains in Paris.", "reasoning_content": "rain is true"}]},
        {"id": "parallel", "messages": [
            {"role": "user", "content": "Paris and Rome?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                _call("get_weather", {"city": "Paris"}), _call("get_weather", {"city": "Rome"})]},
            {"role": "tool", "content": "rain"}, {"role": "tool", "content": ""},
            {"role": "assistant", "content": "Rain in Paris; Rome did not answer."}]},
        {"id": "think-inline", "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4."}]},
        {"id": "reasoning-multi", "messages": [
            {"role": "user", "content": "Pick a colour."},
            {"role": "assistant", "content": "Blue.", "reasoning": "Any will do."},
            {"role": "user", "content": "Another?"},
            {"role": "assistant", "content": "Green.", "reasoning_content": "Not blue again."}]},
        {"id": "sharegpt-tools", "conversations": [
            {"from": "human", "value": "Weather in Oslo?"},
            {"from": "function_call", "value": "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}"},
            {"from": "observation", "value": "heavy snowfall"},
            {"from": "gpt", "value": "It snows in Oslo."}]},
        {"id": "legacy-function", "messages": [
            {"role": "user", "content": "Time?"},
            {"role": "assistant", "content": None, "function_call": {"name": "now", "arguments": "{}"}},
            {"role": "function", "name": "now", "content": "12:00"},
            {"role": "assistant", "content": "It is noon."}]},
    ]
    bad = {
        "call-without-name": {"messages": [{"role": "user", "content": "q"},
                                           {"role": "assistant", "content": None, "tool_calls": [_call("", "{}")]}]},
        "result-without-call": {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"},
                                             {"role": "assistant", "content": "a"}]},
        "arguments-not-text": {"messages": [{"role": "user", "content": "q"},
                                            {"role": "assistant", "tool_calls": [_call("f", 42)]}]},
        "reasoning-not-text": {"messages": [{"role": "user", "content": "q"},
                                            {"role": "assistant", "content": "a", "reasoning_content": ["x"]}]},
        "empty-assistant": {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]},
        "bad-sharegpt-call": {"conversations": [{"from": "human", "value": "q"},
                                                {"from": "function_call", "value": "not json"}]},
        "bad-tools": {"tools": "not json", "messages": [{"role": "user", "content": "q"},
                                                        {"role": "assistant", "content": "a"}]},
    }
    reasons = {"call-without-name": "bad_tool_call", "result-without-call": "tool_result_without_call",
               "arguments-not-text": "bad_tool_call", "reasoning-not-text": "non_string_reasoning",
               "empty-assistant": "empty_turn", "bad-sharegpt-call": "bad_tool_call", "bad-tools": "bad_tools"}
    return good + [{"id": k, **v} for k, v in bad.items()], reasons


def test_tool_and_reasoning_turns_normalise_to_openai_format():
    rows, reasons = tool_corpus()
    by_id = {r["id"]: r for r in rows}
    messages, _ = normalize_record(by_id["tool-call"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2] == {"role": "assistant", "content": "", "reasoning_content": "Look it up.",
                           "tool_calls": [_call("get_weather", "{\"city\": \"Paris\"}", "call_1")]}
    assert messages[3] == {"role": "tool", "content": "{\"rain\": true}", "tool_call_id": "call_1"}
    parallel, _ = normalize_record(by_id["parallel"])
    assert parallel[1]["tool_calls"][1]["function"]["arguments"] == "{\"city\": \"Rome\"}"  # dicts become JSON text
    sharegpt_calls, _ = normalize_record(by_id["sharegpt-tools"])
    assert sharegpt_calls[1] == {"role": "assistant", "content": "",
                                 "tool_calls": [_call("get_weather", "{\"city\": \"Oslo\"}")]}
    assert sharegpt_calls[2] == {"role": "tool", "content": "heavy snowfall"}
    assert normalize_record(by_id["reasoning-multi"])[0][1]["reasoning_content"] == "Any will do."
    for row_id, reason in reasons.items():
        with pytest.raises(QuarantineError, match=reason):
            normalize_record(by_id[row_id])
            from pipelines.records import record_tools
            record_tools(by_id[row_id])


def test_openai_tool_corpus_keeps_every_well_formed_row_and_masks_by_the_rule(ray_cluster, tmp_path, smollm2_tokenizer):
    """Ingest keeps every well-formed row (tool calls, tool results, reasoning); the loss mask of each under a
    tools-capable template trains on what assistants generate and nothing else."""
    import copy

    from eagle_core.chat import render_chat, tokenize_conversation
    from tests.chat_templates import QWEN3_STYLE

    rows, reasons = tool_corpus()
    (tmp_path / "tools.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = ingest(str(tmp_path / "tools.jsonl"))
    kept = out.dataset.take_all()
    assert [r["id"] for r in kept] == [r["id"] for r in rows if r["id"] not in reasons]
    assert out.stats.quarantined == len(reasons) and out.stats.deduped == 0
    assert {q["id"]: q["reason"] for q in out.quarantine.take_all()} == reasons
    assert json.loads(kept[0]["tools"]) == WEATHER_TOOLS

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = QWEN3_STYLE
    for row in kept:
        messages = row["messages"]  # as Ray hands them back (absent fields filled with None)
        out = tokenize_conversation(tok, messages, tools=row.get("tools"))
        masked = tok.decode([t for t, m in zip(out.input_ids, out.loss_mask) if m])
        unmasked = tok.decode([t for t, m in zip(out.input_ids, out.loss_mask) if not m])
        rendered = render_chat(tok, messages, tools=row.get("tools"))
        for m in messages:
            content = (m.get("content") or "").split("</think>")[-1].strip()
            if m["role"] == "assistant":
                for call in m.get("tool_calls") or []:
                    assert call["function"]["name"] in masked, (row["id"], call)
                    assert json.dumps(json.loads(call["function"]["arguments"])) in masked, (row["id"], call)
                reasoning = m.get("reasoning_content")
                if reasoning and reasoning in rendered:  # trained where the template renders it
                    assert reasoning in masked, (row["id"], reasoning)
                assert content in masked, (row["id"], content)
            elif content:
                assert content in unmasked and content not in masked, (row["id"], m)
        assert masked.count("<|im_end|>") == sum(m["role"] == "assistant" for m in messages)
        assert "<tool_response>" not in masked and "get_weather\", \"parameters\"" not in masked
