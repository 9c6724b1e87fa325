"""Ray Serve on vLLM (issue 53): `--engine vllm` replicas run vLLM's async engine on SmolLM2-135M-Instruct (fp32)
with the shipped EAGLE-3 draft as its speculator, behind the same routes as our decoder.

One live deployment (a local Ray cluster, a real Serve app on 127.0.0.1, a bearer key from a file, the draft
registered twice in an MLflow registry and served as `models:/<name>@champion`, polled every second):

- the official `openai` SDK gets chat, completions and a streamed chat; every greedy answer equals the plain greedy
  answer for the same prompt ids (fp32: transformers', which vLLM's plain greedy equals): the speculator changes
  nothing in the text;
- malformed requests get 4xx, never 500;
- /metrics reports vLLM's acceptance: its engine-wide spec-decode counters (drafts, drafted, accepted, accepted per
  position) and our per-label acceptance histograms, which agree (accepted tokens summed over requests = vLLM's
  counter);
- the alias moved to version 2: the replica starts a second vLLM engine with it and new requests decode with
  version 2 (header and /v1/models), giving the same greedy text.
"""

import importlib.util
import json
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
if importlib.util.find_spec("vllm") is None:  # (found, not imported: this process never runs an engine)
    pytest.skip("vLLM is not installed", allow_module_level=True)

from serve_helpers import API_KEY, api_key_file, env, metric, run_app  # noqa: E402

NAME = "smollm2-vllm-draft"
MODEL = "smollm2-vllm"
APP = "eagle3-vllm"
MAX_TOKENS = 24
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "Name three colours."}]
HEADER = "x-eagle3-draft-version"


@pytest.fixture(scope="module")
def deployment(ray_cluster, tmp_path_factory):
    from mlflow import MlflowClient

    from eagle_core.shipped import shipped_draft
    from pipelines import tracking
    from pipelines.serve.app import build_app

    work = tmp_path_factory.mktemp("vllm-serve-work")
    uri = f"sqlite:///{work / 'mlflow.db'}"
    with env(EAGLE3_WORK=str(work), MLFLOW_TRACKING_URI=uri):
        mlflow = tracking.configure()
        with tracking.start_run("serve-vllm-tests", run_name="shipped-draft") as run:
            mlflow.log_artifacts(str(shipped_draft("smollm2-135m")), artifact_path="draft")
            source = mlflow.get_artifact_uri("draft")
        client = MlflowClient(uri)
        client.create_registered_model(NAME)
        for _ in range(2):
            client.create_model_version(NAME, source=source, run_id=run.info.run_id)
        client.set_registered_model_alias(NAME, "champion", "1")
        app = build_app(dict(target="smollm2-135m", draft=f"models:/{NAME}@champion", engine_name="vllm",
                             num_speculative_tokens=3, draft_poll_s=1.0, model_name=MODEL, dtype="float32",
                             max_batch_size=4, max_waiting=8, max_context=512, max_tokens_limit=64,
                             api_key_file=str(api_key_file(tmp_path_factory)), torch_threads=1, num_cpus=1,
                             num_gpus=0))
    url = run_app(app, APP, "/vllm")
    try:
        yield url, client
    finally:
        from ray import serve

        serve.delete(APP)


@pytest.fixture(scope="module")
def sdk(deployment):
    with openai.OpenAI(base_url=f"{deployment[0]}/v1", api_key=API_KEY, max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def plain_greedy(smollm2):
    """The plain greedy continuation of each prompt's ids (completions: the text's ids; chat: the template's) in fp32:
    our plain loop's, which is transformers' greedy (the decoder's exactness tests) and which vLLM's plain greedy
    equals on SmolLM2 (`tests/test_engines.py`; 16 of 16 MT-bench prompts in bench/results/cpu-speed/decode.md).
    (An offline vLLM engine computed it here until the suite had to fit 15 minutes: ~15 CPU-s, its import included.)"""
    from eagle_core.chat import encode_prompt
    from eagle_core.generate import generate

    model, tokenizer = smollm2
    prompts = {p: encode_prompt(tokenizer, p) for p in PROMPTS}
    prompts["chat"] = encode_prompt(tokenizer, CHAT)
    eos = model.generation_config.eos_token_id
    out = generate(model, list(prompts.values()), max_new_tokens=MAX_TOKENS, eos_token_id=eos)
    return {key: tokenizer.decode(tokens, skip_special_tokens=True) for key, tokens in zip(prompts, out.tokens)}


def test_the_openai_sdk_gets_vllms_plain_greedy_text(deployment, sdk, plain_greedy):
    for prompt in PROMPTS:
        r = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == plain_greedy[prompt], (prompt, r.choices[0].text, plain_greedy[prompt])
    r = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == plain_greedy["chat"]
    assert r.usage.completion_tokens > 0
    stream = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == plain_greedy["chat"]
    assert [m.id for m in sdk.models.list().data] == [MODEL]


def test_malformed_requests_get_4xx_never_500(deployment):
    url = deployment[0]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    cases = [
        ({}, {"prompt": "x", "max_tokens": 4}, 401),  # no key
        (auth, b"{not json", 400),
        (auth, {"model": "other", "prompt": "x", "max_tokens": 4}, 404),
        (auth, {"prompt": "x", "max_tokens": 10_000}, 400),
        (auth, {"prompt": "x", "max_tokens": "four"}, 400),
        (auth, {"prompt": [10 ** 9], "max_tokens": 4}, 400),
        (auth, {"prompt": "x", "max_tokens": 4, "temperature": -1}, 400),
    ]
    with httpx.Client(base_url=url, timeout=120) as c:
        for headers, body, expected in cases:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = c.post("/v1/completions", content=content, headers={**headers, "content-type": "application/json"})
            assert r.status_code == expected, (body, r.status_code, r.text)
            assert "error" in r.json(), r.text


def test_metrics_report_vllms_acceptance(deployment, sdk):
    url = deployment[0]
    headers = {"Authorization": f"Bearer {API_KEY}", "x-eagle3-category": "code"}
    with httpx.Client(base_url=url, timeout=300, headers=headers) as c:
        for prompt in PROMPTS:
            assert c.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS}).status_code == 200
        text = c.get("/metrics").text
    drafts = metric(text, "eagle3_serve_vllm_spec_decode_drafts_total")
    accepted = metric(text, "eagle3_serve_vllm_spec_decode_accepted_tokens_total")
    drafted = metric(text, "eagle3_serve_vllm_spec_decode_draft_tokens_total")
    assert drafts > 0 and drafted == 3 * drafts and 0 < accepted <= drafted, text
    per_pos = [metric(text, "eagle3_serve_vllm_spec_decode_accepted_tokens_per_pos_total", position=str(i))
               for i in range(3)]
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1] >= per_pos[2], per_pos
    # our per-request accounting, from vLLM's per-request metrics: the label's rounds are vLLM's steps
    assert metric(text, "eagle3_serve_category_rounds_total", category="code", mode="vllm") > 0
    assert metric(text, "eagle3_serve_accepted_tokens_total") == accepted  # every request finished: same count


def test_a_new_champion_reaches_the_replica(deployment, plain_greedy):
    url, client = deployment
    client.set_registered_model_alias(NAME, "champion", "2")
    auth = {"Authorization": f"Bearer {API_KEY}"}
    deadline = time.monotonic() + 240  # one poll, then a second vLLM engine starts beside the first
    with httpx.Client(base_url=url, timeout=300, headers=auth) as c:
        while c.get("/v1/models").json()["data"][0]["draft_version"] != "2":
            assert time.monotonic() < deadline, c.get("/health").json()
            time.sleep(1.0)
        r = c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200 and r.headers[HEADER] == "2", r.text
    assert r.json()["choices"][0]["text"] == plain_greedy[PROMPTS[0]]
