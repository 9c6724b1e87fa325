"""The default deployment on the real SmolLM2 with its shipped draft: a seed means one text under load.

A sampled answer must be a function of (prompt, sampling parameters, seed) alone. Here the Serve app runs
SmolLM2-135M-Instruct with the shipped draft and the default auto mode policy (re-measuring tree, chain and
plain every other round), and receives, all at once, three copies of a seeded chat request interleaved with
other requests that share its lane (same sampling settings, other seeds), sample differently, or are greedy.
Every copy must give the same text, and that text must be the plain loop's (no draft) for the same seed.
"""

import asyncio

import httpx

import pytest
import torch

from eagle_core.chat import encode_prompt
from eagle_core.generate import generate
from eagle_core.shipped import shipped_draft
from serve_helpers import metric, run_app

pytestmark = pytest.mark.slow

MODEL = "smollm2-eagle3"
HAIKU = {"messages": [{"role": "user", "content": "Write a haiku about a river."}],
         "max_tokens": 24, "temperature": 0.8, "top_p": 0.9, "seed": 123}
STORY = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.8, "seed": 7}


@pytest.fixture(scope="module")
def url(ray_cluster):
    from pipelines.serve.app import build_app

    app = build_app(dict(target="smollm2-135m", draft=str(shipped_draft()), model_name=MODEL, dtype="float32",
                         mode_policy="auto", explore_every=2, max_batch_size=8, max_waiting=16,
                         max_tokens_limit=64, torch_threads=2, num_cpus=0.5, num_gpus=0))
    return run_app(app, "eagle3-smollm2", "/smollm2")


async def post_all(url: str, bodies: list[tuple[str, dict]]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        responses = await asyncio.gather(*(client.post(route, json={"model": MODEL, **body})
                                           for route, body in bodies))
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json() for r in responses]


def plain_text(smollm2, prompt, body: dict) -> str:
    """The plain loop (no draft) with the request's sampling settings and seed."""
    model, tokenizer = smollm2
    torch.set_num_threads(2)
    out = generate(model, [encode_prompt(tokenizer, prompt)], max_new_tokens=body["max_tokens"],
                   temperature=body["temperature"], top_p=body.get("top_p", 1.0), seed=body["seed"],
                   eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out.tokens[0], skip_special_tokens=True)


def test_seed_gives_the_plain_loops_text_under_concurrent_load(url, smollm2):
    chat, text = "/v1/chat/completions", "/v1/completions"
    same_lane_other_seed = {**HAIKU, "messages": [{"role": "user", "content": "Name three rivers."}], "seed": 5}
    greedy = {"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}
    bodies = [(chat, HAIKU), (text, STORY), (chat, same_lane_other_seed), (chat, HAIKU), (text, greedy),
              (text, {**STORY, "seed": 8}), (chat, HAIKU), (text, STORY)]
    with httpx.Client(base_url=url) as c:
        before = c.get("/metrics").text
    answers = asyncio.run(post_all(url, bodies))
    with httpx.Client(base_url=url) as c:
        after = c.get("/metrics").text

    haikus = [a["choices"][0]["message"]["content"] for (_, b), a in zip(bodies, answers) if b is HAIKU]
    stories = [a["choices"][0]["text"] for (_, b), a in zip(bodies, answers) if b is STORY]
    assert len(set(haikus)) == 1 and len(set(stories)) == 1, (haikus, stories)
    assert haikus[0] == plain_text(smollm2, HAIKU["messages"], HAIKU)
    assert stories[0] == plain_text(smollm2, STORY["prompt"], STORY)
    # the load really mixed modes, and the draft was used
    modes = {m: metric(after, "eagle3_serve_rounds_total", mode=m) - metric(before, "eagle3_serve_rounds_total", mode=m)
             for m in ("tree", "chain", "plain")}
    assert sum(n > 0 for n in modes.values()) >= 2, modes
    assert modes["tree"] + modes["chain"] > 0, modes
