"""The OpenAI-compatible wire format: request schemas with strict validation, error bodies, responses, SSE.

Requests are validated strictly (no type coercion, unknown fields refused) so a client bug shows up as a
400 that names the field (`param`) instead of as a silently different generation. Fields OpenAI defines
that we do not implement are accepted only at their no-op value (n=1, penalties 0, no logprobs, no echo,
response_format {"type": "text"}, no tools, tool_choice "none", empty logit_bias, store false); any other
value is a 400 naming the field. Chat content may be a string or a list of text parts (joined with "\n",
as vLLM does); image, audio and file parts are refused (a text-only model). The `developer` role is
OpenAI's newer name for `system` and is treated as one. Extensions: `top_k` (as vLLM) and `category`, the
acceptance label (also the header `x-eagle3-category`; `pipelines.serve.acceptance.check_label` says what a
label may be, anything else is a 400).

Bodies are bounded (`max_body_bytes`, 413) and their nesting too (`MAX_JSON_DEPTH`, 400).
Streams follow OpenAI's usage rule: usage comes only when `stream_options.include_usage` is true, and
then only in one final chunk whose `choices` is empty (`usage_once`).
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from pipelines.serve.acceptance import check_label

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_JSON_DEPTH = 64  # nesting of a request body; real requests need < 10 (json.loads recurses: ~1000 crashes)


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


def _unsupported(message: str, subpath: str = "") -> PydanticCustomError:
    """A refused value; `subpath` (e.g. "1.type") is appended to the field's location to make `param`."""
    return PydanticCustomError("unsupported", message, {"subpath": subpath} if subpath else None)


NON_TEXT_PARTS = ("image_url", "input_image", "input_audio", "audio", "file", "image")


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str  # a list of text parts arrives joined (see _content)
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v):
        """Content parts -> one string; only text parts: anything else is answered with its index."""
        if not isinstance(v, list):
            return v  # strict str validation follows
        if not v:
            raise _unsupported("content must be a string or a non-empty list of content parts")
        texts = []
        for i, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else None
            if not isinstance(kind, str):
                raise _unsupported(f"content part {i} must be an object with a string `type`", str(i))
            if kind in NON_TEXT_PARTS:
                raise _unsupported(f"content part {i} has type {kind!r}: this model reads text only "
                                   f"(only 'text' parts are supported)", f"{i}.type")
            if kind != "text":
                raise _unsupported(f"content part {i} has unknown type {kind!r} (only 'text' is supported)",
                                   f"{i}.type")
            extra = sorted(set(part) - {"type", "text"})
            if extra:
                raise _unsupported(f"unknown field in content part {i}: {extra[0]}", f"{i}.{extra[0]}")
            if not isinstance(part.get("text"), str):
                raise _unsupported(f"content part {i} needs a string `text`", f"{i}.text")
            texts.append(part["text"])
        return "\n".join(texts)

    @property
    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role


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
    logit_bias: dict[str, float] | None = None
    # Extension: the route/category label the replica's acceptance metrics are kept under (docs/serving.md); the
    # header `responses.CATEGORY_HEADER` says the same for clients that cannot add a body field. None: the header,
    # or "default".
    category: str | None = None

    @field_validator("category")
    @classmethod
    def _category(cls, v):
        # a label becomes a Prometheus label value and an MLflow metric key: only a short safe alphabet
        return v if v is None else check_label(v)

    @field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty", mode="before")
    @classmethod
    def _finite(cls, v):
        # JSON parsers here accept NaN and Infinity; without this a NaN temperature is refused as "less than or
        # equal to 2", which sends the caller looking at the wrong bound.
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v):
        if v:
            raise _unsupported("logit_bias is not supported (only null or {})")
        return v

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
    top_logprobs: int | None = None
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # no-op without tools
    store: bool | None = None
    metadata: dict[str, str] | None = None  # tags for stored completions: nothing is stored, nothing to tag
    modalities: list[str] | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v):
        if v:
            raise _unsupported("top_logprobs is not supported (only null or 0)")
        return v

    @field_validator("response_format", mode="before")
    @classmethod
    def _response_format(cls, v):
        if v is None:
            return v
        kind = v.get("type") if isinstance(v, dict) else None
        if kind in ("json_object", "json_schema"):
            raise _unsupported(f"response_format {kind!r} is not supported: this server generates free text "
                               f"(only {{\"type\": \"text\"}})", "type")
        if kind != "text":
            raise _unsupported("response_format must be {\"type\": \"text\"}", "type")
        if set(v) != {"type"}:
            extra = sorted(set(v) - {"type"})[0]
            raise _unsupported(f"unknown field in response_format: {extra}", extra)
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v):
        if v:
            raise _unsupported("tools are not supported (function calling is not implemented); send no tools")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if v not in (None, "none", "auto"):  # "auto" without tools means "none"
            raise _unsupported("tool_choice must be \"none\": function calling is not implemented")
        return v

    @field_validator("store")
    @classmethod
    def _no_store(cls, v):
        if v:
            raise _unsupported("store is not supported (only false): completions are not stored")
        return v

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v):
        if v is not None and v != ["text"]:
            raise _unsupported("only the \"text\" modality is supported")
        return v

    @property
    def message_dicts(self) -> list[dict]:
        return [{"role": m.template_role, "content": m.content} for m in self.messages]


def body_too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"request body is larger than {max_bytes} bytes", code="request_too_large")


def json_depth(raw: bytes) -> int:
    """The deepest nesting of [ and { in a JSON text (brackets inside strings do not count); C-speed."""
    # Without escaped characters no string holds a quote, so removing "..." leaves only structure.
    structure = _STRINGS.sub(b"", _ESCAPES.sub(b"", raw)).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_BRACKET_STEP.__getitem__, structure)), default=0)


_ESCAPES = re.compile(rb"\\.", re.DOTALL)
_STRINGS = re.compile(rb'"[^"]*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def parse_request(raw: bytes, schema: type[_Strict], max_bytes: int):
    """Body bytes -> a validated request, or ApiError(400/413) saying what is wrong."""
    if len(raw) > max_bytes:
        raise body_too_large(max_bytes)
    if not raw.strip():
        raise ApiError(400, "request body is empty; expected a JSON object")
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise ApiError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        obj = json.loads(raw)
    except RecursionError:  # json_depth bounds this; kept as a second line
        raise ApiError(400, "request body is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer over Python's digit limit
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(obj).__name__}")
    try:
        return schema.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        subpath = (first.get("ctx") or {}).get("subpath")
        if subpath:
            param = f"{param}.{subpath}"
        kind = {"missing": "missing required field", "extra_forbidden": "unknown field"}.get(first["type"])
        if kind:
            message = f"{kind}: {param}"
        elif first["type"] == "unsupported":
            message = f"{param}: {first['msg']}"
        else:
            message = f"invalid value for {param}: {first['msg'].removeprefix('Value error, ')}"
        if exc.error_count() > 1:
            message += f" (and {exc.error_count() - 1} more error(s))"
        raise ApiError(400, message, param=param) from None
