"""Tool calls, tool results and reasoning under a tools-capable (Qwen3-style) template: the loss mask follows the
documented rule (docs/data-and-exports.md), and tokenizers without a template fail with one clear error."""

import copy

import pytest

from eagle_core.chat import (NoChatTemplateError, TemplateError, assistant_char_spans, encode_prompt, prompt_ids,
                             render_chat, tokenize_conversation)
from tests.chat_templates import QWEN3_STYLE, STRICT_ROLES

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

# An OpenAI-format conversation: a system prompt, a question, a reasoned tool call (arguments as JSON text, as
# OpenAI sends them), the tool's result, and a reasoned final answer.
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": "Is it raining in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should look the weather up.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"rain\": true, \"temp_c\": 11}"},
    {"role": "assistant", "content": "Yes, it is raining in Paris (11 °C).",
     "reasoning_content": "The tool says rain: true."},
]


@pytest.fixture(scope="module")
def qwen3(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = QWEN3_STYLE
    return tok


def _masked_and_unmasked(tok, out):
    masked = tok.decode([t for t, m in zip(out.input_ids, out.loss_mask) if m])
    unmasked = tok.decode([t for t, m in zip(out.input_ids, out.loss_mask) if not m])
    return masked, unmasked


def test_tool_turns_spans_are_what_the_assistant_generates(qwen3):
    text = render_chat(qwen3, TOOL_CONVERSATION, tools=TOOLS)
    spans = [text[a:b] for a, b in assistant_char_spans(text, TOOL_CONVERSATION, qwen3, TOOLS)]
    assert spans == [
        '<think>\nI should look the weather up.\n</think>\n\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        '<think>\nThe tool says rain: true.\n</think>\n\nYes, it is raining in Paris (11 °C).<|im_end|>',
    ]


def test_tool_conversation_mask_follows_the_rule(qwen3):
    out = tokenize_conversation(qwen3, TOOL_CONVERSATION, tools=TOOLS)
    assert out.input_ids == qwen3.apply_chat_template(TOOL_CONVERSATION[:2] + [
        {**TOOL_CONVERSATION[2], "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]}] + TOOL_CONVERSATION[3:],
        tools=TOOLS, tokenize=True, return_dict=True)["input_ids"]
    masked, unmasked = _masked_and_unmasked(qwen3, out)
    # Trained on: reasoning, the tool call with its markup, the answer, each end of turn.
    for trained in ("I should look the weather up.", "<tool_call>", '"name": "get_weather"', '{"city": "Paris"}',
                    "</tool_call>", "The tool says rain: true.", "Yes, it is raining in Paris (11 °C).", "</think>"):
        assert trained in masked, trained
    assert masked.count("<|im_end|>") == 2
    # Not trained on: the system prompt, the tool schemas, the question, the tool result, the headers.
    for context in ("You are a weather assistant.", "Current weather of a city", "Is it raining in Paris?",
                    '{"rain": true, "temp_c": 11}', "<tool_response>", "<|im_start|>"):
        assert context in unmasked and context not in masked, context


def test_reasoning_the_template_drops_is_not_trained_and_not_an_error(qwen3):
    """A Qwen3-style template renders reasoning only after the last user message: the earlier turn trains on
    its content alone, the last one on its reasoning and content."""
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4.", "reasoning_content": "Two plus two."},
                {"role": "user", "content": "And 3+3?"},
                {"role": "assistant", "content": "<think>\nThree plus three.\n</think>\n\n6."}]
    text = render_chat(qwen3, messages)
    assert "Two plus two." not in text
    spans = [text[a:b] for a, b in assistant_char_spans(text, messages, qwen3)]
    assert spans == ["4.<|im_end|>", "<think>\nThree plus three.\n</think>\n\n6.<|im_end|>"]
    out = tokenize_conversation(qwen3, messages)
    masked, unmasked = _masked_and_unmasked(qwen3, out)
    assert "Three plus three." in masked and "6." in masked and "4." in masked
    assert "2+2?" in unmasked and "And 3+3?" in unmasked


def test_inline_reasoning_is_kept_by_a_template_that_renders_content_verbatim(smollm2_tokenizer):
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "<think>\nlet me see\n</think>\n\nthe answer"}]
    out = tokenize_conversation(smollm2_tokenizer, messages)
    masked, _ = _masked_and_unmasked(smollm2_tokenizer, out)
    assert masked.strip() == "<think>\nlet me see\n</think>\n\nthe answer<|im_end|>"


def test_parallel_tool_calls_and_consecutive_tool_results(qwen3):
    messages = [{"role": "user", "content": "Weather in Paris and Rome?"},
                {"role": "assistant", "content": "Checking both.", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
                {"role": "tool", "content": "rain"}, {"role": "tool", "content": "sun"},
                {"role": "assistant", "content": "Rain in Paris, sun in Rome."}]
    text = render_chat(qwen3, messages, tools=TOOLS)
    first, last = [text[a:b] for a, b in assistant_char_spans(text, messages, qwen3, TOOLS)]
    assert first.startswith("Checking both.\n<tool_call>") and first.count("<tool_call>") == 2
    assert '{"city": "Rome"}' in first and first.endswith("</tool_call><|im_end|>")
    assert last == "<think>\n\n</think>\n\nRain in Paris, sun in Rome.<|im_end|>"
    masked, unmasked = _masked_and_unmasked(qwen3, tokenize_conversation(qwen3, messages, tools=TOOLS))
    assert "rain\n</tool_response>" in unmasked and "sun" not in masked.replace("sun in Rome", "")


def test_a_truncated_reply_does_not_train_an_end_of_turn(qwen3):
    messages = [{"role": "user", "content": "Count to ten."},
                {"role": "assistant", "content": "One, two, three", "truncated": True}]
    out = tokenize_conversation(qwen3, messages)
    masked, unmasked = _masked_and_unmasked(qwen3, out)
    assert masked.strip().endswith("One, two, three") and "<|im_end|>" not in masked


def test_a_template_that_drops_tool_calls_is_named(smollm2_tokenizer):
    """SmolLM2's template renders each message's content only: a tool call would vanish from the text."""
    with pytest.raises(TemplateError, match="does not render its tool call") as err:
        tokenize_conversation(smollm2_tokenizer, TOOL_CONVERSATION)
    assert err.value.reason == "template_drops_tool_calls"


def test_a_template_that_refuses_a_role_gives_a_template_error(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = STRICT_ROLES
    with pytest.raises(TemplateError, match="refused the conversation: Only user and assistant") as err:
        tokenize_conversation(tok, [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                    {"role": "assistant", "content": "a"}])
    assert err.value.reason == "template_refused"


def test_no_chat_template_is_one_clear_error_everywhere(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = None
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    for call in (lambda: render_chat(tok, messages), lambda: tokenize_conversation(tok, messages),
                 lambda: prompt_ids(tok, messages[:1]), lambda: encode_prompt(tok, messages[:1])):
        with pytest.raises(NoChatTemplateError) as err:
            call()
        assert isinstance(err.value, TemplateError) and isinstance(err.value, ValueError)
        assert err.value.reason == "no_chat_template"
        message = str(err.value)
        assert "has no chat template" in message and "chat_template" in message and "plain text" in message
        assert tok.name_or_path in message
    assert encode_prompt(tok, "plain text works") == tok("plain text works", add_special_tokens=False)["input_ids"]
