"""Chat template + loss mask, for any tokenizer's own template: what the assistant generates is trained on.

Messages follow OpenAI's chat format: roles system / user / assistant / tool; an assistant message may carry
`tool_calls` ([{id, type: "function", function: {name, arguments}}]) and reasoning (`reasoning_content`, or
`<think>...</think>` at the start of its content); a tool message carries a tool's result (`tool_call_id`,
`name`). The conversation is rendered once, by the tokenizer's template, to text. The mask rule
(docs/data-and-exports.md):

  loss 1  everything an assistant turn adds after its generation prompt, through the end-of-turn token:
          reasoning (as the template renders it), content, and tool calls with the template's markup
  loss 0  system, user and tool-result turns, tool schemas, role headers and generation prompts, and
          whatever the template itself leaves out (e.g. Qwen3 drops the reasoning of turns before the last
          user message: those turns train on their content and tool calls only)

An assistant turn is found in the text by its pieces in order (reasoning, content, each tool call's name and
arguments; templates may trim, so stripped text is searched too). It starts where the generation prompt
(`add_generation_prompt`'s text for the history before it) ends, when that prompt appears just before its
pieces, else at its first piece; it ends with the template's end-of-turn token (found by rendering a probe
conversation), unless the turn is marked `truncated` (a reply cut at max_tokens never ended its turn).
This works without `{% generation %}` markers, which few templates carry.

A template that loses what an assistant said (its content or a tool call) raises `TemplateError`, which
callers quarantine row by row; a tokenizer without any template raises `NoChatTemplateError` (a
`TemplateError` too) with a message that says what to do.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass

Message = dict  # {"role": "system" | "user" | "assistant" | "tool", "content": str, ...} (OpenAI chat format)

_PROBE_QUESTION = "eagle3-probe-question"
_PROBE_ANSWER = "eagle3-probe-answer"


@dataclass
class TokenizedConversation:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on what assistant turns generate (reasoning, content, tool calls, end of turn)
    truncated: bool  # the rendered conversation was longer than max_length


class TemplateError(ValueError):
    """The chat template cannot render this conversation faithfully, so its loss mask cannot be built.

    `reason` is the short quarantine reason callers record for the row."""

    reason = "template_mismatch"

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class NoChatTemplateError(TemplateError):
    """The tokenizer has no chat template at all: no conversation can be rendered with it."""

    reason = "no_chat_template"


def tokenizer_name(tokenizer) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def require_chat_template(tokenizer) -> None:
    """Raise `NoChatTemplateError` when `tokenizer` cannot render chat messages (a base model's tokenizer)."""
    if getattr(tokenizer, "chat_template", None):
        return
    raise NoChatTemplateError(
        f"tokenizer {tokenizer_name(tokenizer)!r} has no chat template, so chat messages cannot be turned into "
        "tokens. Use the instruct model's tokenizer (its tokenizer_config.json or chat_template.jinja carries the "
        "template), or set tokenizer.chat_template to a Jinja template; a base model takes plain text or token "
        "ids as prompts instead of messages")


def _arguments(arguments):
    """Tool-call arguments as templates expect them: a mapping when the JSON text is an object.

    OpenAI sends `arguments` as JSON text; transformers' templates (Llama 3.1, Hermes, Qwen3) render a mapping
    with `tojson` and text verbatim, so text that is not a JSON object is passed on as it is."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def template_messages(messages: list[Message]) -> list[Message]:
    """Messages as handed to a template: keys without a value dropped (Arrow fills absent struct fields with
    None, and templates test `'tool_calls' in message`), tool-call arguments as mappings, and reasoning also
    under `thinking`, the key gpt-oss's template reads."""
    out = []
    for message in messages:
        m = {k: v for k, v in message.items()
             if v is not None and k != "truncated" and not (k == "tool_calls" and not v)}
        m.setdefault("content", "")  # OpenAI's null content of a tool-calling turn: templates concatenate it
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                function = dict(call.get("function") or {})
                function["arguments"] = _arguments(function.get("arguments", {}))
                calls.append({**{k: v for k, v in call.items() if v is not None}, "function": function})
            m["tool_calls"] = calls
        if isinstance(m.get("reasoning_content"), str):
            m.setdefault("thinking", m["reasoning_content"])
        out.append(m)
    return out


def _tools(tools):
    if isinstance(tools, str):
        tools = json.loads(tools) if tools.strip() else None
    return tools or None


def render_chat(tokenizer, messages: list[Message], add_generation_prompt: bool = False, tools=None) -> str:
    """The conversation as text under the tokenizer's chat template (`tools`: JSON schemas, a list or its JSON text)."""
    import jinja2

    require_chat_template(tokenizer)
    try:
        text = tokenizer.apply_chat_template(template_messages(messages), tools=_tools(tools), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as err:  # the template's own raise_exception, or a template that does not parse
        raise TemplateError(f"the chat template of {tokenizer_name(tokenizer)!r} refused the conversation: {err}",
                            reason="template_refused") from err
    if not isinstance(text, str):
        raise TemplateError(f"apply_chat_template returned {type(text).__name__}, expected str")
    return text


# ---------------------------------------------------------------------------------------------------
# locating what each message contributed to the rendered text


def _locate(text: str, content: str, start: int, end: int | None = None) -> tuple[int, int] | None:
    for candidate in (content, content.strip()):
        if candidate:
            at = text.find(candidate, start, end if end is not None else len(text))
            if at >= 0:
                return at, at + len(candidate)
    return None


_PER_TOKENIZER = weakref.WeakKeyDictionary()  # tokenizer -> (its chat template, `_special_strings`, `end_of_turn_text`)


def _template_facts(tokenizer) -> tuple[list[str], str | None]:
    """(`_special_strings`, `end_of_turn_text`) of a tokenizer, worked out once per tokenizer and chat template:
    every conversation of a corpus needs them, and the end of turn costs a render."""
    facts = _PER_TOKENIZER.get(tokenizer)
    if facts is None or facts[0] != tokenizer.chat_template:
        specials = _special_strings(tokenizer)
        facts = _PER_TOKENIZER[tokenizer] = (tokenizer.chat_template, specials, _end_of_turn(tokenizer, specials))
    return facts[1], facts[2]


def _special_strings(tokenizer) -> list[str]:
    strings = set(tokenizer.all_special_tokens)
    strings.update(tok.content for tok in tokenizer.added_tokens_decoder.values() if tok.special)
    return sorted((s for s in strings if s), key=len, reverse=True)


def _special_token_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    return ids


def end_of_turn_text(tokenizer) -> str | None:
    """The special token the template writes right after an assistant reply (`<|im_end|>`, `<|eot_id|>`, ...),
    found by rendering a probe conversation; None when the template closes a turn with no special token."""
    return _template_facts(tokenizer)[1]


def _end_of_turn(tokenizer, specials: list[str]) -> str | None:
    text = render_chat(tokenizer, [{"role": "user", "content": _PROBE_QUESTION},
                                   {"role": "assistant", "content": _PROBE_ANSWER}])
    at = text.find(_PROBE_ANSWER)
    if at < 0:
        return None
    after = text[at + len(_PROBE_ANSWER):]
    stripped = after.lstrip()
    for special in specials:
        if stripped.startswith(special):
            return special
    return None


def generation_prompt_text(tokenizer, history: list[Message], tools=None) -> str:
    """What `add_generation_prompt` appends to `history` (the assistant header), or "" when it cannot tell."""
    try:
        plain = render_chat(tokenizer, history, tools=tools)
        prompted = render_chat(tokenizer, history, add_generation_prompt=True, tools=tools)
    except TemplateError:
        return ""  # some templates refuse a history that does not end where they expect; the pieces still tell
    return prompted[len(plain):] if prompted.startswith(plain) else ""


def _split_inline_reasoning(content: str) -> tuple[str, str] | None:
    """(reasoning, answer) of content that carries `<think>...</think>` itself, else None."""
    if "</think>" not in content:
        return None
    before, _, after = content.partition("</think>")
    return before.split("<think>")[-1].strip("\n"), after.lstrip("\n")


def _tool_call_texts(call: dict) -> tuple[str, list[str]]:
    """A tool call's name, and the forms its arguments may take in rendered text."""
    function = call.get("function") or {}
    name = str(function.get("name") or "")
    arguments = function.get("arguments")
    forms = []
    if isinstance(arguments, str):
        forms.append(arguments)
    parsed = _arguments(arguments) if arguments is not None else None
    if isinstance(parsed, dict):
        forms += [json.dumps(parsed, ensure_ascii=False), json.dumps(parsed)]
    return name, [f for f in forms if f]


def _assistant_pieces(text: str, message: Message, start: int, index: int,
                      limit: int | None) -> list[tuple[int, int]] | None:
    """Spans of an assistant message's pieces, in order, searched in text[start:limit]; None when its content
    is not there. Raises TemplateError when a tool call is missing (the template does not render tool calls)."""
    spans, cursor = [], start
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning.strip():
        found = _locate(text, reasoning, cursor, limit)
        if found:  # templates may leave reasoning out (Qwen3 does, before the last user message)
            spans.append(found)
            cursor = found[1]
    if content.strip():
        found = _locate(text, content, cursor, limit)
        if found is None and (split := _split_inline_reasoning(content)) is not None:
            inline_reasoning, answer = split
            think = _locate(text, inline_reasoning, cursor, limit) if inline_reasoning.strip() else None
            if think:
                spans.append(think)
                cursor = think[1]
            if answer.strip():
                found = _locate(text, answer, cursor, limit)
            elif think:
                found = (cursor, cursor)  # the content was reasoning only, found above
        if found is None:
            return None
        if found[1] > found[0]:
            spans.append(found)
        cursor = found[1]
    for call in message.get("tool_calls") or []:
        name, argument_forms = _tool_call_texts(call)
        found = _locate(text, name, cursor, limit) if name else None
        if found is None:
            raise TemplateError(f"assistant message {index}: the chat template does not render its tool call "
                                f"{name!r}", reason="template_drops_tool_calls")
        spans.append(found)
        cursor = found[1]
        for form in argument_forms:
            args = _locate(text, form, cursor, limit)
            if args:
                spans.append(args)
                cursor = args[1]
                break
    return spans


def _turn_spans(text: str, messages: list[Message], tokenizer, tools, end_of_turn: str | None) -> list[tuple[int, int]]:
    specials = _template_facts(tokenizer)[0]
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            found = _locate(text, message.get("content") or "", cursor)
            if found is not None:
                cursor = found[1]
            continue  # a template may drop or rewrite a system/user/tool message; that is not ours to mask
        header = generation_prompt_text(tokenizer, messages[:i], tools)
        header_at = text.find(header, cursor) if header else -1
        pieces = None
        if header_at >= 0:
            body = header_at + len(header)
            # After its header, a turn's pieces lie before its end of turn: no search strays into a later turn.
            limit = text.find(end_of_turn, body) if end_of_turn else -1
            pieces = _assistant_pieces(text, message, body, i, limit if limit >= 0 else None)
        if pieces is None:  # no header before it (the template renders history its own way): pieces alone
            header_at = -1
            pieces = _assistant_pieces(text, message, cursor, i, None)
        if not pieces:
            raise TemplateError(f"assistant message {i} does not appear verbatim in the rendered template")
        start = header_at + len(header) if header_at >= 0 else pieces[0][0]
        end = pieces[-1][1]
        if end_of_turn and not message.get("truncated"):
            at = text.find(end_of_turn, end)
            # The end of turn closes this turn only if no other special token (a next header) comes first.
            if at >= 0 and not any(s in text[end:at] for s in specials):
                end = at + len(end_of_turn)
        spans.append((start, end))
        cursor = end
    return spans


def assistant_char_spans(text: str, messages: list[Message], tokenizer, tools=None) -> list[tuple[int, int]]:
    """Character spans of what each assistant turn generates inside the rendered `text`, in order."""
    return _turn_spans(text, messages, tokenizer, tools, end_of_turn_text(tokenizer))


def tokenize_conversation(tokenizer, messages: list[Message], max_length: int | None = None,
                          tools=None) -> TokenizedConversation:
    """Token ids of the whole conversation under the tokenizer's chat template, with the loss mask."""
    text = render_chat(tokenizer, messages, tools=tools)
    end_of_turn = end_of_turn_text(tokenizer)
    spans = _turn_spans(text, messages, tokenizer, tools, end_of_turn)
    # The template already carries BOS and friends: tokenise it as apply_chat_template(tokenize=True) does.
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids, offsets = enc["input_ids"], enc["offset_mapping"]
    special = _special_token_ids(tokenizer)
    loss_mask = [0] * len(input_ids)
    token, n = 0, len(input_ids)
    for (span_start, span_end), message in zip(spans, [m for m in messages if m["role"] == "assistant"]):
        while token < n and offsets[token][1] <= span_start:
            token += 1
        while token < n and offsets[token][0] < span_end:
            loss_mask[token] = 1
            token += 1
        # A template whose end of turn the probe could not name: the special token right after the reply.
        if end_of_turn is None and not message.get("truncated") and token < n and input_ids[token] in special:
            loss_mask[token] = 1
            token += 1
    truncated = max_length is not None and n > max_length
    if truncated:
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    return TokenizedConversation(input_ids=list(input_ids), loss_mask=loss_mask, truncated=truncated)


def prompt_ids(tokenizer, messages: list[Message], tools=None) -> list[int]:
    """Token ids of `messages` followed by the assistant generation prompt (for decoding a reply)."""
    text = render_chat(tokenizer, messages, add_generation_prompt=True, tools=tools)
    return text_ids(tokenizer, text)


def text_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a text, no special tokens added. Only the ids are asked for: turning the other per-token
    lists (attention mask, token types) into Python holds the GIL (8.5 vs 6.6 ms for the 330 k tokens of a 1 MiB
    body, all lists vs ids only), time a server tokenising a huge body in a worker thread makes its other
    threads wait for."""
    return tokenizer(text, add_special_tokens=False, return_attention_mask=False,
                     return_token_type_ids=False)["input_ids"]


def encode_prompt(tokenizer, prompt) -> list[int]:
    """A prompt as token ids: text (no special tokens added), chat messages (with the generation prompt),
    or token ids already."""
    if isinstance(prompt, str):
        return text_ids(tokenizer, prompt)
    if prompt and isinstance(prompt[0], dict):
        return prompt_ids(tokenizer, prompt)
    return list(prompt)


def served_loss_mask(tokenizer, messages: list[Message] | None, prompt: list[int], answer_length: int,
                     tools=None) -> list[int]:
    """The loss mask of a served conversation, laid over the ids as served: `prompt` (the messages with the
    generation prompt, `prompt_ids`) followed by the `answer_length` tokens the target generated.

    The answer is what the assistant turn generates after its generation prompt, through its end-of-turn token
    when it ended: 1 on every answer token, as `tokenize_conversation` masks an assistant turn. In the prompt, the
    earlier assistant turns of `messages` get `tokenize_conversation`'s mask where its ids are the prompt's first
    ids (the template renders the history the same way with or without the generation prompt); 0 elsewhere (system,
    user and tool turns, the generation prompt, and the whole prompt when there are no messages or the history
    does not render as its prefix)."""
    mask = [0] * len(prompt) + [1] * answer_length
    if tokenizer is not None and messages and any(m.get("role") == "assistant" for m in messages):
        try:
            history = tokenize_conversation(tokenizer, messages, tools=tools)
        except TemplateError:
            return mask
        if prompt[:len(history.input_ids)] == history.input_ids:
            mask[:len(history.loss_mask)] = history.loss_mask
    return mask
