"""The OpenAI-compatible wire format: request schemas with strict validation, error bodies, responses, SSE.

Requests are validated strictly (no type coercion, unknown fields refused) so a client bug shows up as a
400 that names the field instead of as a silently different generation. Fields OpenAI defines that we do
not implement are accepted only at their no-op value (n=1, penalties 0, no logprobs, no echo).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_STOP = 4  # OpenAI's limit on stop sequences


class ApiError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---- schemas -------------------------------------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class _SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # extension (as vLLM): 0 = off
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v):
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v):
        if v != 0:
            raise ValueError("penalties are not supported (only 0)")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list):
            if len(v) > MAX_STOP:
                raise ValueError(f"at most {MAX_STOP} stop sequences")
            if any(not s for s in v):
                raise ValueError("stop sequences must be non-empty")
        elif v == "":
            raise ValueError("stop sequences must be non-empty")
        return v

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = None
    best_of: int = 1
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str) and len(v) != 1:
            raise ValueError("exactly one prompt per request is supported")
        if len(v) == 0 or (isinstance(v, list) and isinstance(v[0], str) and not v[0]):
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v is not None:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        if v != 1:
            raise ValueError("only best_of=1 is supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
        return v

    @property
    def prompt_input(self) -> str | list[int]:
        return self.prompt[0] if isinstance(self.prompt, list) and isinstance(self.prompt[0], str) else self.prompt


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @property
    def message_dicts(self) -> list[dict]:
        return [{"role": m.role, "content": m.content} for m in self.messages]


def parse_request(raw: bytes, schema: type[_Strict], max_bytes: int):
    """Body bytes -> a validated request, or ApiError(400/413) saying what is wrong."""
    if len(raw) > max_bytes:
        raise ApiError(413, f"request body is larger than {max_bytes} bytes")
    if not raw.strip():
        raise ApiError(400, "request body is empty; expected a JSON object")
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(obj).__name__}")
    try:
        return schema.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        kind = {"missing": "missing required field", "extra_forbidden": "unknown field"}.get(first["type"])
        message = f"{kind}: {param}" if kind else f"invalid value for {param}: {first['msg']}"
        if exc.error_count() > 1:
            message += f" (and {exc.error_count() - 1} more error(s))"
        raise ApiError(400, message, param=param) from None


# ---- responses -------------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def speculative_info(stats, modes: dict[str, int]) -> dict:
    """The extra `speculative` field: RequestStats' numbers (definitions in pipelines/serve/metrics.py)."""
    return {"rounds": stats.rounds, "draft_rounds": len(stats.accept_lengths),
            "accepted_tokens": sum(stats.accept_lengths), "accept_lengths": list(stats.accept_lengths),
            "tau": round(stats.tau, 4), "acceptance_rate": round(stats.acceptance_rate, 4),
            "rounds_by_mode": {k: v for k, v in modes.items() if v},
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
