"""One corpus record to the normalised conversation format, or a quarantine reason (`pipelines.data` ingests with it).

Normalised: OpenAI's chat format, roles system / user / assistant / tool; an assistant turn may carry `tool_calls`
([{id, type, function: {name, arguments as JSON text}}]) and `reasoning_content`; a tool turn `tool_call_id` and
`name`. ShareGPT's roles map onto it (`human`/`gpt`, `function_call` -> an assistant tool call, `observation` -> a
tool result). A record that cannot be read so raises `QuarantineError`, whose message is the reason.
"""

from __future__ import annotations

import hashlib
import json

ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
    "system": "system", "developer": "system",
    # Tool results: OpenAI's `tool` (and its older `function`), Llama 3.1's `ipython`, ShareGPT's `observation`.
    "tool": "tool", "function": "tool", "ipython": "tool", "observation": "tool",
    # ShareGPT's tool-use variant writes the assistant's call as its own turn, its value the call's JSON.
    "function_call": "assistant",
}
class QuarantineError(ValueError):
    """A row that cannot be used; its message is the quarantine reason."""


def _text_content(content, allow_missing: bool = False) -> str:
    if content is None and allow_missing:
        return ""
    if isinstance(content, str):
        return content
    # OpenAI's multi-part content: a list of {"type": "text", "text": ...} parts.
    if isinstance(content, list) and content and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise QuarantineError("non_string_content")


def _has_bad_utf8(text: str) -> bool:
    return any("\udc80" <= ch <= "\udcff" for ch in text)  # surrogate-escaped bytes from an invalid UTF-8 file


def _tool_call(call) -> dict:
    """One tool call in OpenAI's form, arguments as JSON text (what OpenAI sends; Arrow-safe for any schema)."""
    if not isinstance(call, dict):
        raise QuarantineError("bad_tool_call")
    function = call.get("function", call)  # {"name", "arguments"} alone: ShareGPT and legacy function_call
    if not isinstance(function, dict):
        raise QuarantineError("bad_tool_call")
    name = function.get("name")
    arguments = function.get("arguments", function.get("parameters", {}))
    if not isinstance(name, str) or not name.strip():
        raise QuarantineError("bad_tool_call")
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    elif not isinstance(arguments, str):
        raise QuarantineError("bad_tool_call")
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if isinstance(call.get("id"), str) and call["id"]:
        out = {"id": call["id"], **out}
    return out


def _tool_calls(turn: dict, role: str, content: str) -> tuple[list[dict], str]:
    """(tool calls of an assistant turn, its remaining content)."""
    if role == "function_call":  # ShareGPT: the turn's value is the call (or a list of calls) as JSON
        try:
            parsed = json.loads(content)
        except ValueError:
            raise QuarantineError("bad_tool_call") from None
        return [_tool_call(c) for c in (parsed if isinstance(parsed, list) else [parsed])], ""
    calls = turn.get("tool_calls")
    if calls is None and turn.get("function_call") is not None:  # OpenAI's legacy single call
        calls = [turn["function_call"]]
    if calls is None:
        return [], content
    if not isinstance(calls, list):
        raise QuarantineError("bad_tool_call")
    return [_tool_call(c) for c in calls], content


def _message(turn: dict, role_key: str, content_key: str) -> dict:
    raw_role = turn.get(role_key, turn.get("role", turn.get("from")))
    if not isinstance(raw_role, str) or raw_role.strip().lower() not in ROLE_ALIASES:
        raise QuarantineError("unknown_role")
    source_role = raw_role.strip().lower()
    role = ROLE_ALIASES[source_role]
    raw_content = turn.get(content_key, turn.get("content", turn.get("value")))
    # An assistant turn that only calls tools has no content (OpenAI sends null); a tool may return nothing.
    content = _text_content(raw_content, allow_missing=role in ("assistant", "tool"))
    message = {"role": role, "content": content}
    if role == "assistant":
        calls, content = _tool_calls(turn, source_role, content)
        message["content"] = content
        if calls:
            message["tool_calls"] = calls
        reasoning = turn.get("reasoning_content", turn.get("reasoning"))
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise QuarantineError("non_string_reasoning")
            if reasoning.strip():
                message["reasoning_content"] = reasoning
    elif role == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(turn.get(key), str) and turn[key]:
                message[key] = turn[key]
    texts = [message["content"], message.get("reasoning_content", "")]
    texts += [c["function"]["arguments"] for c in message.get("tool_calls", [])]
    if any(_has_bad_utf8(t) for t in texts):
        raise QuarantineError("bad_utf8")
    said = message["content"].strip() or message.get("tool_calls") or message.get("reasoning_content")
    if role != "tool" and not said:
        raise QuarantineError("empty_turn")
    return message


def normalize_record(record) -> tuple[list[dict], int]:
    """Return (messages, leading assistant/tool turns dropped) or raise QuarantineError(reason)."""
    if not isinstance(record, dict):
        raise QuarantineError("not_an_object")
    if "conversations" in record:
        turns, role_key, content_key = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, role_key, content_key = record["messages"], "role", "content"
    else:
        raise QuarantineError("no_messages")
    if not isinstance(turns, list):
        raise QuarantineError("messages_not_a_list")
    if not turns:
        raise QuarantineError("empty")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise QuarantineError("turn_not_an_object")
        messages.append(_message(turn, role_key, content_key))
    # ShareGPT splits long chats, so a row may begin mid-dialogue with the assistant (or a tool's result for a
    # call made before the cut): drop those turns.
    system = [m for m in messages[:1] if m["role"] == "system"]
    rest = messages[len(system):]
    trimmed = 0
    while rest and rest[0]["role"] in ("assistant", "tool"):
        rest.pop(0)
        trimmed += 1
    if not any(m["role"] == "assistant" for m in rest):
        raise QuarantineError("no_assistant_turn")
    if any(m["role"] == "system" for m in rest):
        raise QuarantineError("system_turn_not_first")
    for before, message in zip(rest, rest[1:]):
        # A tool result answers a call: it follows an assistant turn that made calls, or another result.
        if message["role"] == "tool" and not (before["role"] == "tool" or before.get("tool_calls")):
            raise QuarantineError("tool_result_without_call")
    return system + rest, trimmed


def record_tools(record) -> str:
    """The record's tool schemas (OpenAI `tools`) as JSON text, "" when it has none; bad ones quarantine it."""
    tools = record.get("tools") if isinstance(record, dict) else None
    if tools in (None, "", []):
        return ""
    if isinstance(tools, str):  # some exports keep the schemas as JSON text
        try:
            tools = json.loads(tools)
        except ValueError:
            raise QuarantineError("bad_tools") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise QuarantineError("bad_tools")
    return json.dumps(tools, ensure_ascii=False) if tools else ""


def conversation_hash(messages: list[dict], tools: str = "") -> str:
    """Identity of a kept conversation for deduplication; tool schemas count when the record has them."""
    payload = messages if not tools else {"messages": messages, "tools": tools}
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False, sort_keys=True).encode()).hexdigest()
