"""The decoding benchmark's named prompt sets (bench/prompt_sets.py)."""

import pytest

from bench.prompt_sets import LONG_FIRST_CONVERSATION, LONG_MAX_TOKENS, LONG_MIN_TOKENS, prompt_set
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
