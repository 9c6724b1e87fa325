"""Malformed and refused requests against the live deployment: every one gets a 4xx with an OpenAI-style
error body that says what is wrong, and a valid request right after each still succeeds (the server
stays up and is not left in a bad state)."""

import json
import re

import pytest

from serve_helpers import API_KEY, MODEL, live_deployment

GOOD = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
LONG_PROMPT = "word " * 400  # > max_context (256 tokens) of the test deployment


def completions(**changes):
    body = {**GOOD, **changes}
    return {k: v for k, v in body.items() if v is not DROP}


def chat(**changes):
    body = {**CHAT, **changes}
    return {k: v for k, v in body.items() if v is not DROP}


DROP = object()

# (name, route, raw body or JSON-able object, expected status)
CASES = [
    ("not json", "/v1/completions", b"{prompt: hello", 400),
    ("truncated json", "/v1/completions", b'{"prompt": "hi"', 400),
    ("empty body", "/v1/completions", b"", 400),
    ("json array", "/v1/completions", b"[1, 2]", 400),
    ("json string", "/v1/completions", b'"hello"', 400),
    ("json null", "/v1/completions", b"null", 400),
    ("invalid utf-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400),
    ("missing prompt", "/v1/completions", completions(prompt=DROP), 400),
    ("prompt null", "/v1/completions", completions(prompt=None), 400),
    ("prompt int", "/v1/completions", completions(prompt=5), 400),
    ("prompt dict", "/v1/completions", completions(prompt={"text": "hi"}), 400),
    ("prompt empty", "/v1/completions", completions(prompt=""), 400),
    ("prompt empty list", "/v1/completions", completions(prompt=[]), 400),
    ("two prompts", "/v1/completions", completions(prompt=["a", "b"]), 400),
    ("mixed token list", "/v1/completions", completions(prompt=[1, "a"]), 400),
    ("token id out of vocab", "/v1/completions", completions(prompt=[1, 10 ** 9]), 400),
    ("negative token id", "/v1/completions", completions(prompt=[-1]), 400),
    ("unknown field", "/v1/completions", completions(foo=1), 400),
    ("max_tokens 0", "/v1/completions", completions(max_tokens=0), 400),
    ("max_tokens negative", "/v1/completions", completions(max_tokens=-3), 400),
    ("max_tokens string", "/v1/completions", completions(max_tokens="4"), 400),
    ("max_tokens float", "/v1/completions", completions(max_tokens=4.5), 400),
    ("max_tokens bool", "/v1/completions", completions(max_tokens=True), 400),
    ("max_tokens over limit", "/v1/completions", completions(max_tokens=65), 400),
    ("prompt longer than context", "/v1/completions", completions(prompt=LONG_PROMPT), 400),
    ("prompt + max_tokens over context", "/v1/completions", completions(prompt="word " * 220, max_tokens=64), 400),
    ("temperature negative", "/v1/completions", completions(temperature=-0.1), 400),
    ("temperature too high", "/v1/completions", completions(temperature=2.5), 400),
    ("temperature string", "/v1/completions", completions(temperature="hot"), 400),
    ("top_p zero", "/v1/completions", completions(top_p=0), 400),
    ("top_p above one", "/v1/completions", completions(top_p=1.5), 400),
    ("top_k negative", "/v1/completions", completions(top_k=-1), 400),
    ("top_k float", "/v1/completions", completions(top_k=2.5), 400),
    ("seed string", "/v1/completions", completions(seed="7"), 400),
    ("seed negative", "/v1/completions", completions(seed=-1), 400),
    ("stop int", "/v1/completions", completions(stop=3), 400),
    ("stop five", "/v1/completions", completions(stop=["a", "b", "c", "d", "e"]), 400),
    ("stop list with int", "/v1/completions", completions(stop=["a", 1]), 400),
    ("stop empty string", "/v1/completions", completions(stop=""), 400),
    ("n = 2", "/v1/completions", completions(n=2), 400),
    ("n = 0", "/v1/completions", completions(n=0), 400),
    ("stream string", "/v1/completions", completions(stream="yes"), 400),
    ("stream_options unknown key", "/v1/completions", completions(stream=True, stream_options={"x": 1}), 400),
    ("logprobs", "/v1/completions", completions(logprobs=3), 400),
    ("echo", "/v1/completions", completions(echo=True), 400),
    ("best_of", "/v1/completions", completions(best_of=3), 400),
    ("presence penalty", "/v1/completions", completions(presence_penalty=0.5), 400),
    ("unknown model", "/v1/completions", completions(model="gpt-4"), 404),
    ("chat: missing messages", "/v1/chat/completions", chat(messages=DROP), 400),
    ("chat: prompt instead of messages", "/v1/chat/completions", {"prompt": "hi", "max_tokens": 4}, 400),
    ("chat: messages empty", "/v1/chat/completions", chat(messages=[]), 400),
    ("chat: messages not a list", "/v1/chat/completions", chat(messages="hi"), 400),
    ("chat: message not an object", "/v1/chat/completions", chat(messages=["hi"]), 400),
    ("chat: missing role", "/v1/chat/completions", chat(messages=[{"content": "hi"}]), 400),
    ("chat: unknown role", "/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "hi"}]), 400),
    ("chat: content not a string", "/v1/chat/completions", chat(messages=[{"role": "user", "content": 5}]), 400),
    ("chat: missing content", "/v1/chat/completions", chat(messages=[{"role": "user"}]), 400),
    ("chat: extra message key", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": "hi", "tool_calls": []}]), 400),
    ("chat: too long", "/v1/chat/completions", chat(messages=[{"role": "user", "content": LONG_PROMPT}]), 400),
    ("chat: max_completion_tokens 0", "/v1/chat/completions", chat(max_completion_tokens=0), 400),
    ("chat: logprobs", "/v1/chat/completions", chat(logprobs=True), 400),
    ("chat: n = 3", "/v1/chat/completions", chat(n=3), 400),
    ("chat: image part", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
     400),
    ("chat: empty content parts", "/v1/chat/completions", chat(messages=[{"role": "user", "content": []}]), 400),
    ("chat: response_format json_object", "/v1/chat/completions", chat(response_format={"type": "json_object"}),
     400),
    ("chat: tools", "/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400),
    ("chat: tool_choice required", "/v1/chat/completions", chat(tool_choice="required"), 400),
    ("nested 10 000 deep", "/v1/completions", b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", 400),
    ("huge integer", "/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400),
    ("body over size limit", "/v1/completions", json.dumps(completions(prompt="x" * (1 << 20))).encode(), 413),
]


@pytest.fixture(scope="module")
def live(ray_cluster, tmp_path_factory, smollm2_tokenizer):
    return live_deployment(tmp_path_factory, smollm2_tokenizer)


def assert_error(r, status: int):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"]


def assert_still_serving(client):
    r = client.post("/v1/completions", json=GOOD)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_battery_of_malformed_requests(live):
    assert len(CASES) >= 50
    with live.client() as c:
        for name, route, body, status in CASES:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = c.post(route, content=content, headers={"Content-Type": "application/json"})
            try:
                assert_error(r, status)
            except AssertionError as exc:
                raise AssertionError(f"case {name!r}: {exc}") from None
            assert_still_serving(c)


def requests_counted(client, route: str) -> dict[str, float]:
    """requests_total of one route from /metrics, by status code."""
    text = client.get("/metrics").text
    out = {}
    for labels, value in re.findall(r'^eagle3_serve_requests_total\{([^}]*)\} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if labels.get("route") == route:
            out[labels["code"]] = float(value)
    return out


def test_deep_nesting_and_huge_bodies_get_openai_errors_and_are_counted(live):
    """Issue 17: depth 10 000 used to crash json.loads (a 500 outside the metrics); a 10 MB body must be
    refused without being parsed. Each gets a 4xx OpenAI error, is counted in /metrics, and the server
    answers the next request."""
    deep = b'{"prompt": "hi", "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    huge = json.dumps(completions(prompt="x" * (10 << 20))).encode()
    with live.client() as c:
        for body, status in ((deep, 400), (b"{" * 10_000, 400), (huge, 413)):
            before = requests_counted(c, "completions")
            r = c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
            assert_error(r, status)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            after = requests_counted(c, "completions")
            assert after.get(str(status), 0) == before.get(str(status), 0) + 1
            assert after.get("500", 0) == before.get("500", 0)
            assert_still_serving(c)
        deep_chat = json.dumps(chat(messages=[{"role": "user", "content": "hi", "name": None}])).encode()
        deep_chat = deep_chat[:-1] + b', "metadata": ' + b"{\"a\": " * 5_000 + b"1" + b"}" * 5_000 + b"}"
        before = requests_counted(c, "chat").get("400", 0)
        assert_error(c.post("/v1/chat/completions", content=deep_chat), 400)
        assert requests_counted(c, "chat")["400"] == before + 1


def test_error_names_the_field(live):
    with live.client() as c:
        r = c.post("/v1/completions", json=completions(temperature="hot"))
        assert r.json()["error"]["param"] == "temperature"
        r = c.post("/v1/completions", json=completions(bogus=True))
        assert "bogus" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json=completions(prompt=LONG_PROMPT))
        assert r.json()["error"]["code"] == "context_length_exceeded"
        image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
        r = c.post("/v1/chat/completions", json=chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, image]}]))
        assert r.json()["error"]["param"] == "messages.0.content.1.type"
        r = c.post("/v1/chat/completions", json=chat(response_format={"type": "json_schema", "json_schema": {}}))
        assert r.json()["error"]["param"] == "response_format.type"
        r = c.post("/v1/chat/completions", json=chat(tools=[{"type": "function"}]))
        assert r.json()["error"]["param"] == "tools"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"}])
def test_bearer_token_required(live, headers):
    with live.client(auth=False) as c:
        for route, body in (("/v1/completions", GOOD), ("/v1/chat/completions", CHAT)):
            assert_error(c.post(route, json=body, headers=headers), 401)
        assert_error(c.get("/v1/models", headers=headers), 401)
        assert c.get("/health").status_code == 200  # probes need no token (they get the status alone)
        assert c.get("/metrics").status_code == 401  # the metrics' labels are the clients' own: behind the key
    with live.client() as c:
        assert_still_serving(c)


def test_unknown_route_and_wrong_method(live):
    with live.client() as c:
        assert_error(c.get("/v1/completions"), 405)
        assert_error(c.post("/v1/models"), 405)
        before = requests_counted(c, "other").get("404", 0)
        assert_error(c.post("/v1/embeddings", json={"input": "hi", "model": MODEL}), 404)
        assert requests_counted(c, "other")["404"] == before + 1  # answered outside a route, still counted
        assert_still_serving(c)


def test_valid_openai_client_fields_are_accepted(live):
    """What OpenAI clients send at their no-op values must not be refused."""
    body = completions(model=MODEL, n=1, user="me", presence_penalty=0, frequency_penalty=0, logprobs=None,
                       echo=False, best_of=1, stop=None, seed=1, stream=False, prompt=["Hello"])
    with live.client() as c:
        assert c.post("/v1/completions", json=body).status_code == 200
        r = c.post("/v1/chat/completions", json=chat(model=MODEL, max_tokens=DROP, max_completion_tokens=3,
                                                     logprobs=False, user="me"))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        r = c.post("/v1/chat/completions", json=chat(
            messages=[{"role": "developer", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            response_format={"type": "text"}, tools=[], tool_choice="none", parallel_tool_calls=False,
            logit_bias={}, top_logprobs=0, store=False, metadata={"k": "v"}, modalities=["text"]))
        assert r.status_code == 200, r.text


def test_every_tree_field_is_a_serve_argument():
    """The demo serves the tree its evaluation tuned (`TreeConfig` as a dict): every field must reach the engine."""
    from dataclasses import asdict

    from eagle_core.tree import TreeConfig
    from pipelines.serve.app import split_args

    tuned = TreeConfig(8, 2, 8, path_logits=True, context_chain=6)
    config, _ = split_args({"target": "smollm2-135m", **asdict(tuned)})
    assert config.tree == tuned and config.engine.tree == tuned
