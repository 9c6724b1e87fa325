"""Regeneration: tool-calling turns kept, truncated replies marked or dropped as documented, and a server that
does not serve the target refused before any work (by name, else by a probe of the target's token ids)."""

import json

import httpx
import pytest

from eagle_core.chat import prompt_ids, tokenize_conversation
from eagle_core.features import Reply, generate_ids, generate_replies, regenerate_conversations
from eagle_core.target import load_target, make_tiny_llama
from pipelines.regenerate import OpenAIReplies, ServerError, parse_regenerate_with

QUESTION = [{"role": "user", "content": "Tell me about rain."}]
ANSWERED = QUESTION + [{"role": "assistant", "content": "Rain is water falling from clouds."}]


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target(str(tiny_target_dir), device="cpu", dtype="float32")


class Scripted:
    """`replies` that answers from a script and records the prompts it was given."""

    def __init__(self, *answers):
        self.answers, self.prompts = list(answers), []

    def __call__(self, prompts, seed):
        self.prompts += prompts
        return [self.answers.pop(0) for _ in prompts]


def test_tool_calling_turns_are_kept_and_the_rest_regenerated(target):
    model, tok = target
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}
    conversation = {"id": "t", "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "snowfall"},
        {"role": "assistant", "content": "It snows."}]}
    replies = Scripted(Reply("Snow in Oslo today.", False))
    rows, quarantined = regenerate_conversations(model, tok, [conversation], replies=replies)
    assert quarantined == {}
    assert rows[0]["messages"][:3] == conversation["messages"][:3]
    assert rows[0]["messages"][3] == {"role": "assistant", "content": "Snow in Oslo today."}
    assert replies.prompts == [prompt_ids(tok, conversation["messages"][:3])]  # answers the real tool result


@pytest.mark.parametrize("policy", ["mark", "drop"])
def test_a_truncated_reply_is_marked_or_dropped(target, policy):
    model, tok = target
    conversation = {"id": "c", "messages": QUESTION + [{"role": "assistant", "content": "a"},
                                                       {"role": "user", "content": "More?"},
                                                       {"role": "assistant", "content": "b"}]}
    replies = Scripted(Reply("Rain is water", True))
    rows, quarantined = regenerate_conversations(model, tok, [conversation], replies=replies, truncated=policy)
    assert len(replies.prompts) == 1  # nothing answers a reply the target never finished
    if policy == "drop":
        assert rows == [] and quarantined == {"c": "empty_regeneration"}
        return
    assert quarantined == {}
    assert rows[0]["messages"] == QUESTION + [{"role": "assistant", "content": "Rain is water", "truncated": True}]
    out = tokenize_conversation(tok, rows[0]["messages"])
    masked = tok.decode([t for t, m in zip(out.input_ids, out.loss_mask) if m])
    assert masked.strip() == "Rain is water"  # trained on, without an end of turn the target never wrote
    # A finished reply keeps its end of turn and the conversation goes on.
    finished, _ = regenerate_conversations(model, tok, [conversation], replies=Scripted(Reply("x", False),
                                                                                        Reply("y", False)))
    assert [m["content"] for m in finished[0]["messages"] if m["role"] == "assistant"] == ["x", "y"]
    with pytest.raises(ValueError, match="truncated must be one of"):
        regenerate_conversations(model, tok, [conversation], replies=replies, truncated="keep")


def test_in_process_replies_say_whether_they_ended(target):
    import copy

    model, tok = target
    prompt = prompt_ids(tok, QUESTION)
    first = generate_ids(model, tok, [prompt], 1, 0.0, 0)[0][0]
    assert generate_replies(model, tok, [prompt], 3, 0.0, 0)[0].truncated  # a random model never says EOS
    ends = copy.deepcopy(tok)
    ends.eos_token = tok.convert_ids_to_tokens(first)  # now its first greedy token ends the reply
    reply = generate_replies(model, ends, [prompt], 3, 0.0, 0)[0]
    assert not reply.truncated


# ---------------------------------------------------------------------------------------------------
# an OpenAI-compatible server, simulated in process


def fake_server(model, tok, served_name, listed=None, finish_reason=None):
    """httpx transport answering /models and /completions (token-id prompts, greedy) with `model`."""
    calls = []

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": m} for m in (listed or [served_name])]})
        body = json.loads(request.content)
        if body["model"] != served_name:
            return httpx.Response(404, json={"error": {"message": "no such model"}})
        ids = generate_ids(model, tok, [body["prompt"]], body["max_tokens"], 0.0, 0)[0]
        finish = finish_reason or ("stop" if tok.eos_token_id in ids else "length")
        return httpx.Response(200, json={"choices": [{"text": tok.decode(ids, skip_special_tokens=True),
                                                      "finish_reason": finish}]})

    return httpx.MockTransport(handle), calls


def client(transport, url="http://server/v1", **kw):
    replies = OpenAIReplies(url, max_tokens=4, retries=0, **kw)
    replies._client = httpx.Client(base_url=replies.base_url, transport=transport)
    return replies


def test_a_server_named_like_the_target_is_taken_without_a_probe(target, tiny_target_dir):
    model, tok = target
    transport, calls = fake_server(model, tok, served_name=tiny_target_dir.name, listed=["other", tiny_target_dir.name])
    replies = client(transport)
    replies.check_target(model, tok)
    assert replies.model == tiny_target_dir.name and calls == ["/v1/models"]


def test_a_server_of_the_same_model_under_another_name_passes_the_probe(target):
    model, tok = target
    transport, calls = fake_server(model, tok, served_name="my-deployment")
    replies = client(transport)
    rows, _ = regenerate_conversations(model, tok, [{"id": "a", "messages": ANSWERED}], max_new_tokens=4,
                                       replies=replies)
    assert replies.model == "my-deployment" and calls.count("/v1/completions") == 3 + 1  # probes, then the reply
    local = generate_replies(model, tok, [prompt_ids(tok, QUESTION)], 4, 0.0, 0)[0]
    assert rows[0]["messages"][-1] == {"role": "assistant", "content": local.text, "truncated": True}


def test_a_server_of_another_model_is_refused_before_any_work(target, tiny_target_dir):
    model, tok = target
    other = make_tiny_llama(vocab_size=len(tok), num_hidden_layers=4, seed=11, tie_word_embeddings=False)
    transport, calls = fake_server(other, tok, served_name="some-other-model")
    replies = client(transport)
    with pytest.raises(ServerError, match="does not continue the target's token ids") as err:
        regenerate_conversations(model, tok, [{"id": "a", "messages": ANSWERED}], replies=replies)
    assert "some-other-model" in str(err.value) and "served-model-name" in str(err.value)
    assert calls.count("/v1/completions") == 3  # the probes only


def test_the_served_model_must_be_chosen_and_listed(target):
    model, tok = target
    transport, _ = fake_server(model, tok, served_name="a", listed=["a", "b"])
    with pytest.raises(ServerError, match="none named like the target"):
        client(transport).check_target(model, tok)
    with pytest.raises(ServerError, match="does not serve 'c'"):
        client(transport, url=parse_regenerate_with("openai:http://server#c")).check_target(model, tok)
    named = client(transport, url=parse_regenerate_with("openai:http://server:8000#a"))
    assert named.base_url == "http://server/v1" or named.base_url.endswith("/v1")
    named.check_target(model, tok)  # "a" serves the target: the probe agrees
    assert named.model == "a"


def test_parse_keeps_the_served_model_after_a_hash():
    assert parse_regenerate_with("openai:http://h:8000#org/model") == "http://h:8000/v1#org/model"
    assert parse_regenerate_with("openai:https://h/v1/") == "https://h/v1"
    assert parse_regenerate_with("hf") is None


# ---------------------------------------------------------------------------------------------------
# extraction's use of the chat template: a row the template refuses is quarantined, no template stops


def test_extraction_quarantines_rows_the_template_refuses_and_stops_without_a_template(target):
    import copy

    from eagle_core.chat import NoChatTemplateError
    from eagle_core.features import tokenize_for_training

    model, tok = target
    call = {"type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    rows = [{"id": "plain", "messages": ANSWERED},
            {"id": "calls", "messages": QUESTION + [{"role": "assistant", "content": "", "tool_calls": [call]}]}]
    kept, quarantined = tokenize_for_training(tok, rows, 256)  # SmolLM2's template renders no tool calls
    assert [r[0] for r in kept] == ["plain"] and quarantined == {"calls": "template_drops_tool_calls"}

    bare = copy.deepcopy(tok)
    bare.chat_template = None
    for work in (lambda: tokenize_for_training(bare, rows, 256),
                 lambda: regenerate_conversations(model, bare, rows, max_new_tokens=2)):
        with pytest.raises(NoChatTemplateError, match="has no chat template"):
            work()
