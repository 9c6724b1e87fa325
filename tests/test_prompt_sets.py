"""The named prompt sets of evaluation (pipelines/prompt_sets.py)."""

import pytest
import torch

from pipelines.prompt_sets import LONG_FIRST_CONVERSATION, LONG_MAX_TOKENS, LONG_MIN_TOKENS, prompt_set
from eagle_core.chat import prompt_ids


def test_mtbench_spreads_over_its_categories_and_calibrates_on_other_questions():
    measured, calib = prompt_set("mtbench", None, 16, 3)
    assert len({item["category"] for item in measured}) == 8
    assert not {item["id"] for item in measured} & {item["id"] for item in calib}


def test_long_prompts_are_held_out_and_as_long_as_promised(smollm2_tokenizer):
    measured, calib = prompt_set("long", smollm2_tokenizer, 3, 1)
    ids = [item["id"] for item in measured + calib]
    assert len(set(ids)) == 4 and all(int(i.split("-")[1]) >= LONG_FIRST_CONVERSATION for i in ids)
    for item in measured + calib:
        assert item["messages"][-1]["role"] == "user"  # the prompt asks for the next answer
        assert LONG_MIN_TOKENS <= len(prompt_ids(smollm2_tokenizer, item["messages"])) <= LONG_MAX_TOKENS


def test_mixed_is_half_of_each_and_unknown_names_are_refused(smollm2_tokenizer):
    measured, _ = prompt_set("mixed", smollm2_tokenizer, 4, 2)
    assert [item["category"] == "long-context" for item in measured] == [False, False, True, True]
    with pytest.raises(ValueError, match="unknown prompt set"):
        prompt_set("humaneval-typo", smollm2_tokenizer, 1, 0)


def test_humaneval_asks_to_complete_each_stub():
    measured, calib = prompt_set("humaneval", None, 8, 2)
    assert len(measured) == 8 and {item["category"] for item in measured} == {"humaneval"}
    assert all(item["id"].startswith("HumanEval/") and "def " in item["messages"][0]["content"] for item in measured)
    assert not {item["id"] for item in measured} & {item["id"] for item in calib}


def test_turn2_follows_the_answer_to_turn1_and_is_refused_without_one():
    asked = []

    def answer(messages):
        asked.append(messages)
        return f"answer {len(asked)}"

    turn1, _ = prompt_set("mtbench", None, 4, 0)
    turn2, calib = prompt_set("mtbench-turn2", None, 4, 1, answer=answer)
    assert len(asked) == 5 and asked[:4] == [item["messages"] for item in turn1]
    for first, second in zip(turn1, turn2):
        user1, reply, user2 = second["messages"]
        assert [user1] == first["messages"] and reply["role"] == "assistant" and user2["role"] == "user"
        assert user2["content"] != user1["content"] and second["category"] == f"{first['category']} (turn 2)"
    assert {item["set"] for item in turn2 + calib} == {"mtbench-turn2"}
    with pytest.raises(ValueError, match="needs the target's answers"):
        prompt_set("mtbench-turn2", None, 2, 0)


def test_all_spreads_over_every_kind(smollm2_tokenizer):
    measured, calib = prompt_set("all", smollm2_tokenizer, 6, 4, answer=lambda messages: "an answer")
    assert [item["set"] for item in measured] == ["mtbench", "mtbench", "mtbench-turn2", "mtbench-turn2",
                                                  "humaneval", "long"]
    assert [item["set"] for item in calib] == ["mtbench", "mtbench-turn2", "humaneval", "long"]
    assert not {item["id"] for item in measured} & {item["id"] for item in calib}


def test_a_jsonl_file_measures_its_first_prompts_and_calibrates_on_the_next(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "one"}\n\n{"messages": [{"role": "user", "content": "two"}]}\n{"prompt": "three"}\n')
    measured, calib = prompt_set(str(path), None, 2, 5)
    assert [item["messages"][-1]["content"] for item in measured + calib] == ["one", "two", "three"]
    assert [item["id"] for item in measured] == ["file-1", "file-3"]
    path.write_text('{"prompt": "one"}\n{"text": "no prompt here"}\n')
    with pytest.raises(ValueError, match="line 2"):
        prompt_set(str(path), None, 2, 0)


def test_the_target_answers_turn_one_with_its_greedy_reply(smollm2):
    from pipelines.prompt_sets import target_answerer

    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "Name a colour."}]
    reply = target_answerer(model, tokenizer, 8)(messages)
    greedy = model.generate(torch.tensor([prompt_ids(tokenizer, messages)]), max_new_tokens=8, do_sample=False)
    expected = tokenizer.decode(greedy[0, len(prompt_ids(tokenizer, messages)):], skip_special_tokens=True).strip()
    assert reply == expected and reply
