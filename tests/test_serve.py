"""The Serve deployment against a live local deployment (tiny target, echo draft from the MLflow registry).

Properties: greedy output over HTTP == the generator's speculative output == plain greedy (alone and
under concurrent load, where the engine batches and switches tree/chain/plain); streaming carries the
same text as the non-streamed answer; stop strings cut the text; seeded sampling is reproducible; the
speculative stats add up; /metrics shows the acceptance numbers; overload answers 503 and nothing breaks.
"""

import asyncio

import pytest
import torch

from eagle_core.chat import prompt_ids
from eagle_core.generate import generate
from decode_helpers import single_thread  # noqa: F401 (autouse: 1 torch thread in this process)
from serve_helpers import MODEL, live_deployment, metric, sse_events

PROMPTS = ["The quick brown fox", "Once upon a time there was", "1, 2, 3, 4,", "Hello"]


@pytest.fixture(scope="module")
def live(ray_cluster, tmp_path_factory, smollm2_tokenizer):
    return live_deployment(tmp_path_factory, smollm2_tokenizer)


def reference(live, ids: list[int], max_tokens: int) -> tuple[str, list[int]]:
    """Greedy text from the generator with the draft, asserting it equals plain greedy."""
    torch.set_num_threads(1)
    eos = live.tokenizer.eos_token_id
    spec = generate(live.target, [ids], draft=live.draft, tree=live.config.tree, max_new_tokens=max_tokens,
                    eos_token_id=eos)
    plain = generate(live.target, [ids], max_new_tokens=max_tokens, eos_token_id=eos)
    assert spec.tokens[0] == plain.tokens[0]
    return live.tokenizer.decode(spec.tokens[0], skip_special_tokens=True), spec.tokens[0]


def encode(live, prompt: str) -> list[int]:
    return live.tokenizer(prompt, add_special_tokens=False)["input_ids"]


def complete(client, **body):
    r = client.post("/v1/completions", json={"model": MODEL, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_models_and_health(live):
    with live.client() as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == MODEL
        health = c.get("/health").json()
    assert health["status"] == "ok" and health["speculative"] is True


def test_greedy_completion_equals_generator_and_plain(live):
    with live.client() as c:
        for prompt in PROMPTS[:2]:
            body = complete(c, prompt=prompt, max_tokens=24)
            text, tokens = reference(live, encode(live, prompt), 24)
            choice = body["choices"][0]
            assert choice["text"] == text
            assert body["usage"]["completion_tokens"] == len(tokens)
            assert body["usage"]["prompt_tokens"] == len(encode(live, prompt))
            assert choice["finish_reason"] == ("length" if len(tokens) == 24 else "stop")


def test_token_id_prompt_equals_text_prompt(live):
    with live.client() as c:
        by_text = complete(c, prompt=PROMPTS[0], max_tokens=12)
        by_ids = complete(c, prompt=encode(live, PROMPTS[0]), max_tokens=12)
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]


def test_concurrent_greedy_requests_each_equal_plain_greedy(live):
    """Batched together (and across the tree/chain/plain fallback), every request keeps its own answer."""

    async def run():
        async with live.async_client() as c:
            rs = await asyncio.gather(*[c.post("/v1/completions", json={"prompt": p, "max_tokens": 20 + 4 * i,
                                                                        "temperature": 0})
                                        for i, p in enumerate(PROMPTS)])
        return [r.json() for r in rs]

    bodies = asyncio.run(run())
    modes = set()
    for i, (prompt, body) in enumerate(zip(PROMPTS, bodies)):
        text, tokens = reference(live, encode(live, prompt), 20 + 4 * i)
        assert body["choices"][0]["text"] == text
        assert body["usage"]["completion_tokens"] == len(tokens)
        modes |= set(body["speculative"]["rounds_by_mode"])
    assert len(modes) >= 2  # the load fallback switched modes mid-flight and stayed lossless


def test_chat_completion_uses_the_chat_template(live):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    with live.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    text, tokens = reference(live, prompt_ids(live.tokenizer, messages), 16)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert body["usage"]["prompt_tokens"] == len(prompt_ids(live.tokenizer, messages))


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_matches_non_streaming(live, chat):
    route = "/v1/chat/completions" if chat else "/v1/completions"
    payload = {"messages": [{"role": "user", "content": "Tell me a story."}]} if chat else {"prompt": PROMPTS[1]}
    payload.update(max_tokens=20, temperature=0)
    with live.client() as c:
        whole = c.post(route, json=payload).json()
        r = c.post(route, json={**payload, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    with_choices = [c for c in chunks if c["choices"]]
    if chat:
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert with_choices[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in with_choices)
        assert text == whole["choices"][0]["message"]["content"]
    else:
        text = "".join(c["choices"][0]["text"] for c in with_choices)
        assert text == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in with_choices][-1] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in with_choices[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]  # include_usage chunk
    assert with_choices[-1]["speculative"]["rounds"] == whole["speculative"]["rounds"]


def test_stop_string_cuts_the_text(live):
    with live.client() as c:
        full = complete(c, prompt=PROMPTS[0], max_tokens=32)["choices"][0]["text"]
        stop = full[len(full) // 2: len(full) // 2 + 3]  # some text from the middle; it may occur earlier too
        cut = complete(c, prompt=PROMPTS[0], max_tokens=32, stop=[stop, "\u2603never"])
    assert cut["choices"][0]["text"] == full[: full.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_seeded_sampling_is_reproducible(live):
    body = {"prompt": PROMPTS[2], "max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 7}
    with live.client() as c:
        a, b = complete(c, **body), complete(c, **body)
        other = complete(c, **{**body, "seed": 8})
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["usage"]["completion_tokens"] >= 1 and other["usage"]["completion_tokens"] >= 1


def test_speculative_stats_add_up(live):
    """Each round commits accept_length + 1 tokens after the prefill's first: the stats must agree."""
    with live.client() as c:
        body = complete(c, prompt=PROMPTS[3], max_tokens=40)
    spec, n = body["speculative"], body["usage"]["completion_tokens"]
    assert spec["draft_rounds"] == len(spec["accept_lengths"]) <= spec["rounds"]
    assert spec["accepted_tokens"] == sum(spec["accept_lengths"])
    plain_rounds = spec["rounds"] - spec["draft_rounds"]
    committed = 1 + plain_rounds + spec["draft_rounds"] + spec["accepted_tokens"]
    assert 0 <= committed - n <= live.config.depth  # only the last round may be cut by max_tokens / eos
    assert spec["tau"] == pytest.approx(1 + spec["accepted_tokens"] / max(spec["draft_rounds"], 1), abs=1e-3)


def test_metrics_show_acceptance(live):
    with live.client() as c:
        complete(c, prompt=PROMPTS[1], max_tokens=24)
        text = c.get("/metrics").text
    p = "eagle3_serve_"
    rounds = metric(text, p + "draft_rounds_total")
    accepted = metric(text, p + "accepted_tokens_total")
    assert rounds > 0 and accepted > 0  # the echo draft gets tokens accepted on the tiny target
    assert metric(text, p + "accept_length_count") == rounds
    assert metric(text, p + "accept_length_sum") == accepted
    per_position = [metric(text, p + "accepted_at_position_total", position=d) for d in range(1, live.config.depth + 1)]
    assert sum(per_position) == accepted  # sum over depths of P(accept_length >= d) = tau - 1
    assert all(a >= b for a, b in zip(per_position, per_position[1:]))
    assert metric(text, p + "generated_tokens_total") > 0
    assert metric(text, p + "phase_seconds_total", phase="draft") > 0
    assert metric(text, p + "phase_seconds_total", phase="verify") > 0
    assert metric(text, p + "requests_total", route="completions", code="200") > 0


def test_overload_answers_503_fast_and_recovers(live):
    """More concurrent requests than the engine holds: the excess gets 503 + an error body, never a hang."""
    n = 3 * (live.config.max_batch_size + live.config.max_waiting)

    async def run():
        async with live.async_client(timeout=60) as c:
            return await asyncio.gather(*[c.post("/v1/completions", json={"prompt": PROMPTS[i % 4], "max_tokens": 64,
                                                                          "temperature": 0})
                                          for i in range(n)])

    responses = asyncio.run(run())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503}
    assert codes.count(503) > 0 and codes.count(200) > 0
    for r in responses:
        if r.status_code == 503:  # the engine's OpenAI body, or Serve's router when its own queue is full
            if r.headers["content-type"].startswith("application/json"):
                assert r.json()["error"]["message"]
            else:
                assert "backpressure" in r.text
    with live.client() as c:
        assert c.get("/health").json()["status"] == "ok"
        assert complete(c, prompt="after the storm", max_tokens=4)["usage"]["completion_tokens"] >= 1


def test_the_serve_job_checks_the_address_the_running_proxy_really_binds(live, monkeypatch):
    """Issue 54 (4): `serve.start` keeps the http options of a Serve instance already running, so `jobs/serve.py
    --host 127.0.0.1` proves nothing about where the proxy listens. Asking a running instance for another address
    changes (and binds) nothing, `proxy_bind` reads the one in force, and the job refuses to deploy keyless when
    that one is not loopback. (The suite binds loopback only, so the exposed instance -- one an earlier
    `serve start --http-host 0.0.0.0` made -- is its recorded address, not a real bind.)"""
    import importlib.util
    from pathlib import Path

    from ray import serve

    from pipelines.serve import app as serve_app
    from serve_helpers import _LIVE, free_port

    serve.start(http_options={"host": "0.0.0.0", "port": free_port()})  # running: a warning, nothing else
    assert serve_app.proxy_bind() == ("127.0.0.1", _LIVE["port"])
    for name in ("EAGLE3_SERVE_API_KEY", "EAGLE3_SERVE_API_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    spec = importlib.util.spec_from_file_location("job_serve", Path(__file__).resolve().parents[1] / "jobs" / "serve.py")
    serve_job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_job)
    monkeypatch.setattr(serve_app, "proxy_bind", lambda: ("0.0.0.0", _LIVE["port"]))
    try:
        with pytest.raises(SystemExit, match=rf"refusing to serve on 0\.0\.0\.0:{_LIVE['port']} without an API key"):
            serve_job.main(["--host", "127.0.0.1", "--port", str(_LIVE["port"]), "--target", str(live.config.target),
                            "--draft", "none", "--name", "exposure-test", "--no-block"])
        assert "exposure-test" not in serve.status().applications  # refused before anything was deployed
    finally:
        if "exposure-test" in serve.status().applications:
            serve.delete("exposure-test")
