"""Assistant-only loss mask: decoding the masked spans gives back exactly the assistant turns."""

import copy
import random

import pytest

from eagle_core.chat import TemplateError, prompt_ids, render_chat, tokenize_conversation

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen3-like: a default system prompt, and an empty think block that scaffolds every assistant turn.
QWEN_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' + message['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
END_OF_TURN = {"smollm2": "<|im_end|>", "llama3": "<|eot_id|>", "qwen": "<|im_end|>"}
# What a template writes after its generation prompt and before the reply: the assistant turn generates it.
TURN_PREFIX = {"smollm2": "", "llama3": "", "qwen": "<think>\n\n</think>\n\n"}


@pytest.fixture(scope="module", params=["smollm2", "llama3", "qwen"])
def templated(request, smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    if request.param == "llama3":
        tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
        tok.chat_template = LLAMA3_TEMPLATE
    elif request.param == "qwen":
        tok.chat_template = QWEN_TEMPLATE
    return request.param, tok


def masked_runs(ids, mask):
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 equals 4."}],
    [
        {"role": "system", "content": "You answer tersely."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, please, and say assistant in it."},
        {"role": "assistant", "content": "Green, said the assistant.\n\nAlso: red!"},
    ],
    # The answer repeats the question: a naive text search would mark the user turn.
    [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Say hello"},
     {"role": "user", "content": "ok"}, {"role": "assistant", "content": "  padded answer  "}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_masked_spans_decode_to_assistant_turns(templated, messages):
    name, tok = templated
    out = tokenize_conversation(tok, messages)
    assert out.input_ids == tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    runs = masked_runs(out.input_ids, out.loss_mask)
    assistants = [m["content"] for m in messages if m["role"] == "assistant"]
    assert len(runs) == len(assistants)
    for run, content in zip(runs, assistants):
        text = tok.decode(run)
        assert text.endswith(END_OF_TURN[name]), text
        assert text.startswith(TURN_PREFIX[name]), text
        assert text[len(TURN_PREFIX[name]): -len(END_OF_TURN[name])].strip() == content.strip()


def test_nothing_outside_assistant_turns_is_masked(templated):
    _, tok = templated
    messages = CONVERSATIONS[1]
    out = tokenize_conversation(tok, messages)
    unmasked = tok.decode([t for t, m in zip(out.input_ids, out.loss_mask) if not m])
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] in unmasked
    assert "Blue." not in unmasked and "Green" not in unmasked


def test_truncation_keeps_a_prefix(templated):
    _, tok = templated
    rng = random.Random(0)
    messages = []
    for i in range(6):
        messages.append({"role": "user", "content": " ".join(rng.choice(["alpha", "beta", "gamma"]) for _ in range(20))})
        messages.append({"role": "assistant", "content": f"answer {i} " + "delta " * 15})
    full = tokenize_conversation(tok, messages)
    cut = tokenize_conversation(tok, messages, max_length=50)
    assert cut.truncated and not full.truncated
    assert cut.input_ids == full.input_ids[:50] and cut.loss_mask == full.loss_mask[:50]


def test_generation_prompt_is_the_prefix_of_the_answered_conversation(templated):
    name, tok = templated
    question = [{"role": "user", "content": "Hi there"}]
    answered = question + [{"role": "assistant", "content": "Hello!"}]
    assert render_chat(tok, answered).startswith(render_chat(tok, question, add_generation_prompt=True))
    prompt = prompt_ids(tok, question)
    full = tokenize_conversation(tok, answered)
    if name != "llama3":  # BPE merges "\n\n" differently when text follows it: a text prefix, not a token prefix
        assert full.input_ids[: len(prompt)] == prompt
    assert sum(full.loss_mask[: len(prompt) - 1]) == 0


def test_template_that_rewrites_the_answer_is_refused(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    with pytest.raises(TemplateError):
        tokenize_conversation(tok, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "lower answer"}])
    assert render_chat(tok, [{"role": "user", "content": "q"}]) == "Q"
