"""The ingress's error mapping, accounting and wire rules in-process (no Ray, no model): the routes' logic
(`pipelines.serve.app.Routes`) over a fake service, served by a FastAPI app wired like the deployment.

Properties: any exception raised while answering a request (inside the handler, by the service, mid-stream)
becomes an OpenAI error body with a fitting status and is counted once in the request metrics, and the
next request is answered; oversized and deeply nested bodies are refused before parsing; streams carry
usage once, only when asked; everyday OpenAI fields are accepted at their no-op values and the rest is
refused with a 400 naming the field.
"""

import asyncio
import json
import re

import pytest
from fastapi.testclient import TestClient

from pipelines.serve import app as serve_app
from pipelines.serve import protocol as P
from pipelines.serve import responses as R
from pipelines.serve.config import ServeConfig
from pipelines.serve.metrics import ServeMetrics
from serve_helpers import replica_app

MAX_BODY = 1 << 20
GOOD = {"prompt": "Hello", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


class FakeService:
    """Service's interface: `fail` (an exception) is raised by complete(), or mid-stream after one chunk;
    `usage_on_finish` streams usage as Service does today (on the finish chunk, and again in a chunk with
    no choices when asked); otherwise only in the chunk with no choices, always."""

    def __init__(self):
        self.config = ServeConfig(max_body_bytes=MAX_BODY)
        self.metrics = ServeMetrics(depth=4)
        self.fail: Exception | None = None
        self.usage_on_finish = True
        self.seen: list = []

    def authorize(self, headers):
        if headers.get("authorization") == "Bearer wrong":
            raise P.ApiError(401, "missing or invalid bearer token", type="authentication_error")

    def health_body(self):
        return {"status": "ok", "model": "fake", "speculative": True, "draft_version": "7", "running": 3,
                "waiting": 2}

    def models_body(self):
        if self.fail is not None:
            raise self.fail
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    async def complete(self, req, chat):
        self.seen.append(req)
        if self.fail is not None:
            raise self.fail
        return {"object": "chat.completion" if chat else "text_completion", "usage": R.usage(2, 3)}

    async def stream(self, req, chat, on_end=None):
        self.seen.append(req)
        return self._events(req, on_end)

    async def _events(self, req, on_end):
        chunk = lambda text, reason=None: R.completion_chunk("cmpl-1", 1, "fake", text, reason)  # noqa: E731
        try:
            yield R.sse(chunk("a"))
            if self.fail is not None:
                raise self.fail
            yield R.sse(chunk("b"))
            last = chunk("", "length")
            if self.usage_on_finish:
                last["usage"] = R.usage(2, 3)
            last["speculative"] = {"rounds": 2}
            yield R.sse(last)
            asked = req.stream_options is not None and req.stream_options.include_usage
            if asked or not self.usage_on_finish:
                tail = chunk("")
                tail["choices"], tail["usage"] = [], R.usage(2, 3)
                yield R.sse(tail)
            yield R.SSE_DONE
        finally:
            if on_end is not None:
                on_end(200)


@pytest.fixture
def fake(monkeypatch):
    service = FakeService()
    monkeypatch.setitem(serve_app._REPLICA, "metrics", service.metrics)
    app = replica_app(service)  # the routes and error handlers as on the deployment's `api`
    with TestClient(app, raise_server_exceptions=False) as client:
        yield service, client


def requests_counted(service, route: str, code: int) -> float:
    text = service.metrics.exposition().decode()
    m = re.search(rf'eagle3_serve_requests_total\{{code="{code}",route="{route}"\}} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def assert_openai_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and error["type"]
    return error


def assert_still_serving(service, client):
    service.fail = None
    r = client.post("/v1/completions", json=GOOD)
    assert r.status_code == 200, r.text


# ---- errors -----------------------------------------------------------------------------------------------

def test_health_says_only_the_status_and_metrics_need_the_key_without_it(fake, monkeypatch):
    """Issue 54 (6): without the key (where one is set) /health tells a probe the status and nothing else (no draft
    version, queue depth or model), and /metrics (the queue, the draft, the clients' own labels) answers 401; with
    the key both answer in full. The key check is Service's own."""
    from pipelines.serve.service import Service

    service, client = fake
    monkeypatch.setattr(service, "api_key", "k3y", raising=False)
    monkeypatch.setattr(service, "authorize", Service.authorize.__get__(service))
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = client.get("/health", headers=headers)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert_openai_error(client.get("/metrics", headers=headers), 401)
    key = {"Authorization": "Bearer k3y"}
    assert client.get("/health", headers=key).json() == service.health_body()
    r = client.get("/metrics", headers=key)
    assert r.status_code == 200 and "eagle3_serve_requests_total" in r.text


@pytest.mark.parametrize("exc", [RuntimeError("boom: /secret/path"), KeyError("x"), RecursionError(),
                                 ZeroDivisionError()])
def test_exception_inside_the_handler_is_an_openai_error_and_counted(fake, exc):
    service, client = fake
    service.fail = exc
    error = assert_openai_error(client.post("/v1/completions", json=GOOD), 500)
    assert error["type"] == "server_error"
    assert "secret" not in error["message"]  # internals stay in the log
    assert requests_counted(service, "completions", 500) == 1
    assert_still_serving(service, client)
    assert requests_counted(service, "completions", 200) == 1


def test_service_api_errors_keep_their_status_and_are_counted(fake):
    service, client = fake
    service.fail = P.ApiError(503, "server overloaded", type="server_overloaded", code="overloaded")
    error = assert_openai_error(client.post("/v1/chat/completions", json=CHAT), 503)
    assert error["code"] == "overloaded"
    assert requests_counted(service, "chat", 503) == 1
    assert_openai_error(client.post("/v1/completions", json=GOOD, headers={"Authorization": "Bearer wrong"}), 401)
    assert requests_counted(service, "completions", 401) == 1
    assert_still_serving(service, client)


def test_models_route_errors_are_mapped_and_counted(fake):
    service, client = fake
    assert client.get("/v1/models").status_code == 200
    service.fail = RuntimeError("models broke")
    assert_openai_error(client.get("/v1/models"), 500)
    assert requests_counted(service, "models", 200) == 1 and requests_counted(service, "models", 500) == 1


def test_failure_mid_stream_is_reported_in_the_stream_and_counted_500(fake):
    service, client = fake
    service.fail = RuntimeError("engine fell over")
    r = client.post("/v1/completions", json={**GOOD, "stream": True})
    assert r.status_code == 200  # the status line went out with the first chunk
    events = [json.loads(b[len("data: "):]) for b in r.text.split("\n\n") if b.strip()]
    assert events[0]["choices"][0]["text"] == "a"
    assert events[-1]["error"]["type"] == "server_error"
    assert requests_counted(service, "completions", 500) == 1
    assert requests_counted(service, "completions", 200) == 0
    assert_still_serving(service, client)


def test_deep_nesting_and_huge_bodies_are_refused_before_parsing(fake):
    service, client = fake
    deep = b'{"prompt": "hi", "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    error = assert_openai_error(client.post("/v1/completions", content=deep), 400)
    assert "nested" in error["message"]
    assert_openai_error(client.post("/v1/chat/completions", content=b"{" * 10_000), 400)
    huge = json.dumps({**GOOD, "prompt": "x" * (10 << 20)}).encode()
    error = assert_openai_error(client.post("/v1/completions", content=huge), 413)
    assert error["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit is enforced while reading
        for _ in range(11):
            yield b" " * (1 << 20)

    assert_openai_error(client.post("/v1/completions", content=chunked()), 413)
    assert requests_counted(service, "completions", 400) == 1 and requests_counted(service, "chat", 400) == 1
    assert requests_counted(service, "completions", 413) == 2
    assert service.seen == []  # none of them reached the service
    assert_still_serving(service, client)


def test_unknown_route_and_method_are_openai_errors_and_counted(fake):
    service, client = fake
    assert assert_openai_error(client.post("/v1/embeddings", json={}), 404)["type"] == "not_found_error"
    assert_openai_error(client.get("/v1/completions"), 405)
    assert requests_counted(service, "other", 404) == 1
    assert requests_counted(service, "completions", 405) == 1


# ---- usage in streams -------------------------------------------------------------------------------------

def stream_usage(client, body: dict) -> tuple[list, list]:
    r = client.post("/v1/completions", json={**body, "stream": True})
    assert r.status_code == 200
    blocks = [b[len("data: "):] for b in r.text.split("\n\n") if b.strip()]
    assert blocks[-1] == "[DONE]"
    chunks = [json.loads(b) for b in blocks[:-1]]
    return chunks, [c for c in chunks if c.get("usage") is not None]


@pytest.mark.parametrize("usage_on_finish", [True, False])
def test_stream_usage_once_and_only_when_asked(fake, usage_on_finish):
    service, client = fake
    service.usage_on_finish = usage_on_finish
    for options in (None, {"include_usage": False}):
        body = GOOD if options is None else {**GOOD, "stream_options": options}
        chunks, with_usage = stream_usage(client, body)
        assert with_usage == []
        assert "".join(c["choices"][0]["text"] for c in chunks) == "ab"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["speculative"] == {"rounds": 2}  # the extension stays on the finish chunk
    chunks, with_usage = stream_usage(client, {**GOOD, "stream_options": {"include_usage": True}})
    assert with_usage == [chunks[-1]]  # exactly once, in the last chunk ...
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == R.usage(2, 3)  # ... with no choices
    assert chunks[-1]["id"] == chunks[0]["id"] and chunks[-1]["object"] == "text_completion"
    assert all(c["choices"] for c in chunks[:-1])


def test_usage_once_is_a_plain_event_filter():
    async def run(events, include_usage):
        async def source():
            for e in events:
                yield e
        return [e async for e in R.usage_once(source(), include_usage)]

    text = R.sse(R.completion_chunk("c", 1, "m", "usage"))  # generated text that reads "usage"
    assert asyncio.run(run([text, R.SSE_DONE], True)) == [text, R.SSE_DONE]
    assert asyncio.run(run([R.sse(P.error_body("x")), R.SSE_DONE], False))[-1] == R.SSE_DONE


# ---- everyday OpenAI fields ---------------------------------------------------------------------------------

def chat_request(**changes):
    return P.parse_request(json.dumps({**CHAT, **changes}).encode(), P.ChatCompletionRequest, MAX_BODY)


def refused(param: str, **changes) -> P.ApiError:
    with pytest.raises(P.ApiError) as info:
        chat_request(**changes)
    assert info.value.status == 400 and info.value.param == param, (info.value.param, info.value.message)
    return info.value


def test_no_op_openai_fields_are_accepted():
    req = chat_request(response_format={"type": "text"}, tool_choice="none", tools=[], parallel_tool_calls=False,
                       logit_bias={}, top_logprobs=0, store=False, metadata={"a": "b"}, modalities=["text"])
    assert req.message_dicts == [{"role": "user", "content": "Hi"}]
    assert chat_request(tool_choice="auto").message_dicts == req.message_dicts  # "auto" without tools


def test_content_parts_are_joined_and_developer_is_system():
    req = chat_request(messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}])
    assert req.message_dicts == [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Hi\nthere"}]


def test_what_a_text_model_cannot_do_is_refused_naming_the_field():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    error = refused("messages.0.content.1.type",
                    messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
    assert "image_url" in error.message and "text only" in error.message
    refused("messages.0.content.0.type", messages=[{"role": "user", "content": [{"type": "input_audio"}]}])
    refused("messages.0.content.0.type", messages=[{"role": "user", "content": [{"type": "video"}]}])
    refused("messages.0.content.0.text", messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}])
    refused("messages.0.content.0.extra",
            messages=[{"role": "user", "content": [{"type": "text", "text": "a", "extra": 1}]}])
    refused("messages.0.content.0", messages=[{"role": "user", "content": ["hi"]}])
    refused("messages.0.content", messages=[{"role": "user", "content": []}])
    for kind in ("json_object", "json_schema"):
        error = refused("response_format.type", response_format={"type": kind, "json_schema": {"name": "x"}})
        assert kind in error.message
    refused("response_format.type", response_format={"type": "xml"})
    refused("response_format.extra", response_format={"type": "text", "extra": 1})
    refused("tools", tools=[{"type": "function", "function": {"name": "f"}}])
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        refused("tool_choice", tool_choice=choice)
    refused("logit_bias", logit_bias={"50256": -100})
    refused("store", store=True)
    refused("modalities", modalities=["text", "audio"])
    refused("messages.0.role", messages=[{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_a_non_finite_sampling_number_is_refused_as_such(field, value):
    """NaN and ±Infinity (which JSON parsers accept) are named as not finite, not as out of a bound."""
    body = json.dumps({**CHAT, field: value}).encode()  # json.dumps writes NaN / Infinity literals
    with pytest.raises(P.ApiError) as info:
        P.parse_request(body, P.ChatCompletionRequest, MAX_BODY)
    assert info.value.status == 400 and info.value.param == field
    assert info.value.message == f"invalid value for {field}: must be a finite number"


def test_the_overload_reason_agrees_in_number():
    from pipelines.serve.rows import describe_load

    assert describe_load(1, 31) == "1 request decoding and 31 waiting"
    assert describe_load(2, 0) == "2 requests decoding and 0 waiting"
    assert describe_load(0, 1) == "0 requests decoding and 1 waiting"
