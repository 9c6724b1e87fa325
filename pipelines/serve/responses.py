"""The OpenAI-compatible API's responses: ids, usage, response bodies and stream chunks, Server-Sent Events, the
project's response headers and the category label read from a request (request parsing and validation are in
`pipelines.serve.protocol`)."""

from __future__ import annotations

import json
import time
import uuid

from pipelines.serve.acceptance import DEFAULT_LABEL, check_label
from pipelines.serve.protocol import ApiError


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# Response headers: the draft version that decoded the request ("7": registry version 7 of the served model;
# "local": a draft folder; "none": plain decoding), and the Serve replica that answered.
DRAFT_VERSION_HEADER = "x-eagle3-draft-version"
REPLICA_HEADER = "x-eagle3-replica"
# Request header: the acceptance label (`category`), when the body does not name one.
CATEGORY_HEADER = "x-eagle3-category"


def header_category(headers) -> str | None:
    """The CATEGORY_HEADER label, or None when absent; a malformed one is a 400 naming the header."""
    value = headers.get(CATEGORY_HEADER)
    if value is None:
        return None
    try:
        return check_label(value)
    except ValueError as exc:
        raise ApiError(400, f"invalid {CATEGORY_HEADER} header: {exc}", code="invalid_category") from None


def request_category(req, header: str | None) -> str:
    """A request's label: its body field `category`, else the header's, else "default"."""
    return getattr(req, "category", None) or header or DEFAULT_LABEL


def speculative_info(stats) -> dict:
    """The extra `speculative` field: RequestStats' numbers (definitions in pipelines/serve/metrics.py)."""
    return {"rounds": stats.rounds, "draft_rounds": len(stats.accept_lengths),
            "accepted_tokens": sum(stats.accept_lengths), "accept_lengths": list(stats.accept_lengths),
            "tau": round(stats.tau, 4), "acceptance_rate": round(stats.acceptance_rate, 4),
            "rounds_by_mode": {k: v for k, v in stats.modes.items() if v},
            "prefill_s": round(stats.prefill_s, 6), "draft_s": round(stats.draft_s, 6),
            "verify_s": round(stats.verify_s, 6)}


def completion_body(rid: str, created: int, model: str, text: str, finish_reason: str, usage_: dict,
                    spec: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage_, "speculative": spec}


def chat_body(rid: str, created: int, model: str, text: str, finish_reason: str, usage_: dict, spec: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": usage_, "speculative": spec}


def completion_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason: str | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


SSE_DONE = sse("[DONE]")


def _sse_json(event: str) -> dict | None:
    if not event.startswith("data: {"):
        return None
    try:
        obj = json.loads(event[len("data: "):])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


async def usage_once(events, include_usage: bool):
    """SSE events -> the same events under OpenAI's usage rule: no chunk with choices carries `usage`; when
    `include_usage`, exactly one final chunk with `choices: []` does (just before [DONE]); otherwise none.

    A client that sums `usage` over chunks thus counts it once, and only when it asked. Whatever chunk
    the producer put usage on, it is moved (or dropped) here; other fields (`speculative`) stay."""
    usage_chunk = None
    async for event in events:
        obj = _sse_json(event) if '"usage"' in event else None
        if obj is not None and "usage" in obj:
            if obj.get("choices"):  # usage on a chunk with choices: move it to the final usage chunk
                usage_chunk = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
                usage_chunk.update(choices=[], usage=obj.pop("usage"))
                event = sse(obj)
            else:  # the producer's own usage chunk: held back and sent last
                usage_chunk = obj
                continue
        if event == SSE_DONE and usage_chunk is not None and include_usage:
            yield sse(usage_chunk)
            usage_chunk = None
        yield event
