"""Chat template + assistant-only loss mask, for any tokenizer's own template.

The template is rendered once to text; every message's content is then located in that text in order
(templates may trim content, so the stripped content is searched too), and the tokens overlapping an
assistant content span get loss 1, together with the end-of-turn token that closes the span (the first
token after the content when it is one of the tokenizer's special/added tokens). System and user tokens
and the template's scaffolding (role headers, BOS, generation prompts, `<think>` blocks) get 0.

This works without `{% generation %}` markers, which few templates carry (SmolLM2's does not).
"""

from __future__ import annotations

from dataclasses import dataclass

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}


@dataclass
class TokenizedConversation:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant content and its end-of-turn token
    truncated: bool  # the rendered conversation was longer than max_length


class TemplateError(ValueError):
    """The chat template does not reproduce a message's content, so its span cannot be masked."""


def render_chat(tokenizer, messages: list[Message], add_generation_prompt: bool = False) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    if not isinstance(text, str):
        raise TemplateError(f"apply_chat_template returned {type(text).__name__}, expected str")
    return text


def _locate(text: str, content: str, start: int) -> tuple[int, int] | None:
    for candidate in (content, content.strip()):
        if candidate:
            at = text.find(candidate, start)
            if at >= 0:
                return at, at + len(candidate)
    return None


def assistant_char_spans(text: str, messages: list[Message]) -> list[tuple[int, int]]:
    """Character spans of each assistant message's content inside the rendered `text`, in order."""
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        found = _locate(text, message["content"], cursor)
        if found is None:
            if message["role"] == "assistant":
                raise TemplateError(f"assistant message {i} does not appear verbatim in the rendered template")
            continue  # a template may drop or rewrite a system/user message; that is not ours to mask
        if message["role"] == "assistant":
            spans.append(found)
        cursor = found[1]
    return spans


def _special_token_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    return ids


def tokenize_conversation(tokenizer, messages: list[Message], max_length: int | None = None) -> TokenizedConversation:
    """Token ids of the whole conversation under the tokenizer's chat template, with the loss mask."""
    text = render_chat(tokenizer, messages)
    spans = assistant_char_spans(text, messages)
    # The template already carries BOS and friends: tokenise it as apply_chat_template(tokenize=True) does.
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids, offsets = enc["input_ids"], enc["offset_mapping"]
    special = _special_token_ids(tokenizer)
    loss_mask = [0] * len(input_ids)
    token, n = 0, len(input_ids)
    for span_start, span_end in spans:
        while token < n and offsets[token][1] <= span_start:
            token += 1
        while token < n and offsets[token][0] < span_end:
            loss_mask[token] = 1
            token += 1
        if token < n and input_ids[token] in special:
            loss_mask[token] = 1  # end of turn: the draft must learn to predict it too
            token += 1
    truncated = max_length is not None and n > max_length
    if truncated:
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    return TokenizedConversation(input_ids=list(input_ids), loss_mask=loss_mask, truncated=truncated)


def prompt_ids(tokenizer, messages: list[Message]) -> list[int]:
    """Token ids of `messages` followed by the assistant generation prompt (for decoding a reply)."""
    text = render_chat(tokenizer, messages, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_prompt(tokenizer, prompt) -> list[int]:
    """A prompt as token ids: text (no special tokens added), chat messages (with the generation prompt),
    or token ids already."""
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if prompt and isinstance(prompt[0], dict):
        return prompt_ids(tokenizer, prompt)
    return list(prompt)
