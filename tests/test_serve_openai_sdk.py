"""The official `openai` Python SDK against the live deployment (tiny target, echo draft; see serve_helpers):
what an OpenAI client does every day works, and what this text-only server cannot do fails cleanly.

Properties: models.list, chat and completions answer like the raw HTTP API; a stream carries the same
text, and usage exactly once (a final chunk with no choices) only with stream_options.include_usage;
stop strings cut; a seed reproduces a sampled answer (the plain loop's); response_format {"type": "text"},
content parts and the developer role are accepted (parts = their text joined, developer = system); an image part is a 400 BadRequestError naming the field.
"""

import pytest

openai = pytest.importorskip("openai")

from serve_helpers import API_KEY, MODEL, live_deployment  # noqa: E402

MAX_TOKENS = 8
PROMPT = "Once upon a time there was"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def live(ray_cluster, tmp_path_factory, smollm2_tokenizer):
    return live_deployment(tmp_path_factory, smollm2_tokenizer)


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def raw(live):
    """Non-streamed greedy answers over plain HTTP: what the SDK's results must equal."""
    with live.client() as c:
        chat = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0})
        text = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert chat.status_code == 200 and text.status_code == 200
    return {"chat": chat.json(), "completions": text.json()}


def chat(client, messages=MESSAGES, **kw):
    kw = {"max_tokens": MAX_TOKENS, "temperature": 0, **kw}
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def test_models_list(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_and_completions(client, raw):
    r = chat(client)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == raw["chat"]["choices"][0]["message"]["content"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) == raw["chat"]["usage"]
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert c.choices[0].text == raw["completions"]["choices"][0]["text"]
    assert c.usage.completion_tokens == raw["completions"]["usage"]["completion_tokens"]


@pytest.mark.parametrize("include_usage", [None, False, True])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_streaming_usage_exactly_once_only_when_asked(client, raw, route, include_usage):
    kw = {} if include_usage is None else {"stream_options": {"include_usage": include_usage}}
    if route == "chat":
        chunks = list(chat(client, stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == raw["chat"]["choices"][0]["message"]["content"]
    else:
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == raw["completions"]["choices"][0]["text"]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [raw[route]["choices"][0]["finish_reason"]]
    with_usage = [c for c in chunks if c.usage is not None]
    if include_usage:
        assert with_usage == [chunks[-1]] and chunks[-1].choices == []  # once, last, with no choices
        summed = sum(c.usage.completion_tokens for c in with_usage)  # what a client adding chunks up gets
        assert summed == raw[route]["usage"]["completion_tokens"]
        assert chunks[-1].usage.prompt_tokens == raw[route]["usage"]["prompt_tokens"]
    else:
        assert with_usage == []


def test_stop_strings(client, raw):
    full = raw["completions"]["choices"][0]["text"]
    stop = full[len(full) // 2: len(full) // 2 + 2] or full[:1]
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                  stop=[stop, "\u2603never"])
    assert c.choices[0].text == full[: full.index(stop)] and c.choices[0].finish_reason == "stop"
    full_chat = raw["chat"]["choices"][0]["message"]["content"]
    stop = full_chat[len(full_chat) // 2: len(full_chat) // 2 + 2] or full_chat[:1]
    r = chat(client, stop=stop)
    assert r.choices[0].message.content == full_chat[: full_chat.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_seed_reproduces_a_sampled_answer(client, live):
    """The SDK's `seed`: the same sampled text every time, equal to the plain loop's for that seed."""
    import torch

    from eagle_core.chat import encode_prompt
    from eagle_core.generate import generate

    sampled = dict(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.95)
    answers = {seed: [chat(client, seed=seed, **sampled).choices[0].message.content for _ in range(2)]
               for seed in (11, 12)}
    texts = {seed: a[0] for seed, a in answers.items()}
    assert all(len(set(a)) == 1 for a in answers.values()), answers
    torch.set_num_threads(1)
    plain = generate(live.target, [encode_prompt(live.tokenizer, MESSAGES)], max_new_tokens=MAX_TOKENS,
                     temperature=1.0, top_p=0.95, seed=11, eos_token_id=live.tokenizer.eos_token_id)
    assert texts[11] == live.tokenizer.decode(plain.tokens[0], skip_special_tokens=True)


def test_response_format_text_content_parts_and_developer_role(client, raw):
    expected = raw["chat"]["choices"][0]["message"]["content"]
    assert chat(client, response_format={"type": "text"}).choices[0].message.content == expected
    as_parts = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    r = chat(client, messages=as_parts)  # developer = system, one text part = the string
    assert r.choices[0].message.content == expected
    assert r.usage.prompt_tokens == raw["chat"]["usage"]["prompt_tokens"]
    split = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "Name"},
                                                        {"type": "text", "text": "a colour."}]}]
    joined = [MESSAGES[0], {"role": "user", "content": "Name\na colour."}]
    assert chat(client, messages=split).choices[0].message.content == \
        chat(client, messages=joined).choices[0].message.content


def test_image_part_is_a_clean_400(client):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in this image?"}, image]}]
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, messages=messages)
    assert info.value.status_code == 400
    assert info.value.param == "messages.0.content.1.type"
    assert "text only" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, response_format={"type": "json_object"})
    assert info.value.param == "response_format.type"
    assert chat(client).choices[0].finish_reason in ("stop", "length")  # still serving
