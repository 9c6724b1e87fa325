"""One champion everywhere (issue 42): replicas follow the registry's `@champion` alias, and a huge body does not
stall the other streams of its replica.

Properties:
- Two Serve replicas (one local deployment, the tiny target and the echo draft registered twice, alias
  `champion` on version 1, each replica polling the alias every POLL_S): under continuous traffic (plain and
  streamed requests), after the alias moves to version 2 every request sent later than POLL_S + SWAP_SLACK_S
  is decoded by version 2 on both replicas, no request fails, every answer is the target's own greedy text
  (a swap is lossless), and each response names its draft version (header and `speculative.draft_version`),
  as `/v1/models` does.
- In the engine, a request in flight when the draft changes finishes on its own draft, the next one takes the
  new draft, and both give plain greedy's tokens.
- A 1 MiB chat body (templated and tokenised in about a second on this CPU) does not delay another stream's
  next event by more than about a round: one replica's routes (`Routes` over `Service`, as the deployment wires
  them) on uvicorn on 127.0.0.1, the gaps between a running stream's events while the big body is being
  answered compared with the same stream's gaps before it.
"""

import asyncio
import json
import statistics
import time

import httpx
import pytest
import torch

from decode_helpers import echo_draft, single_thread  # noqa: F401 (autouse: 1 torch thread in this process)
from eagle_core.decoding import DecodingState
from serve_helpers import API_KEY, api_key_file, env, replica_app, run_app, save_target, sse_events, uvicorn_thread

NAME = "champion-draft"
MODEL = "tiny-champion"
POLL_S = 1.0
# After one poll interval the replica has seen the new version; loading it (an MLflow download of the tiny draft
# and a safetensors read) and the request's own round trip come on top, on a shared 2-core machine.
SWAP_SLACK_S = 4.0
PROMPTS = ["The quick brown fox", "Once upon a time there was", "1, 2, 3, 4,"]
MAX_TOKENS = 8
HEADER = "x-eagle3-draft-version"
ROUND_WAIT_S = 0.05


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_tokenizer):
    """The damped tiny target (HF folder) and the echo draft (checkpoint folder), loaded here too."""
    from eagle_core.checkpoint import save_draft
    from eagle_core.target import load_target

    target_dir = save_target(tmp_path_factory.mktemp("champion-target"), smollm2_tokenizer)
    target, tokenizer = load_target(str(target_dir), device="cpu", dtype=torch.float32)
    draft_dir = tmp_path_factory.mktemp("champion-draft")
    save_draft(echo_draft(target), draft_dir)
    return target_dir, draft_dir, target, tokenizer


@pytest.fixture(scope="module")
def deployment(ray_cluster, tmp_path_factory, models):
    """Two replicas serving models:/champion-draft@champion (version 1 of two registered copies of the draft)."""
    from mlflow import MlflowClient

    from pipelines import tracking
    from pipelines.serve.app import build_app

    target_dir, draft_dir, _, _ = models
    work = tmp_path_factory.mktemp("champion-work")
    uri = f"sqlite:///{work / 'mlflow.db'}"
    with env(EAGLE3_WORK=str(work), MLFLOW_TRACKING_URI=uri):
        mlflow = tracking.configure()
        with tracking.start_run("serve-champion-tests", run_name="echo-draft") as run:
            mlflow.log_artifacts(str(draft_dir), artifact_path="draft")
            source = mlflow.get_artifact_uri("draft")
        client = MlflowClient(uri)
        client.create_registered_model(NAME)
        for _ in range(2):
            client.create_model_version(NAME, source=source, run_id=run.info.run_id)
        client.set_registered_model_alias(NAME, "champion", "1")
        app = build_app(dict(target=str(target_dir), draft=f"models:/{NAME}@champion", draft_poll_s=POLL_S,
                             model_name=MODEL, dtype="float32", top_k=4, depth=4, total_tokens=12,
                             max_batch_size=4, max_waiting=8, mode_policy="static", tree_max_batch=1,
                             chain_max_batch=2, max_context=256, max_tokens_limit=64,
                             api_key_file=str(api_key_file(tmp_path_factory)),
                             torch_threads=1, num_cpus=0.5, num_gpus=0, num_replicas=2))
    url = run_app(app, "eagle3-champion", "/champion")
    yield url, client
    from ray import serve

    serve.delete("eagle3-champion")


def greedy_texts(target, tokenizer) -> dict[str, str]:
    """Each prompt's plain greedy text from the target alone: what every draft must reproduce."""
    from eagle_core.generate import generate

    out = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        tokens = generate(target, [ids], max_new_tokens=MAX_TOKENS, eos_token_id=tokenizer.eos_token_id).tokens[0]
        out[prompt] = tokenizer.decode(tokens, skip_special_tokens=True)
    return out


async def one_request(client: httpx.AsyncClient, prompt: str, stream: bool) -> dict:
    """One greedy completion; what the test needs from it (or what went wrong)."""
    sent = time.monotonic()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    try:
        r = await client.post("/v1/completions", json=body)
    except httpx.HTTPError as exc:
        return {"sent": sent, "status": None, "error": repr(exc), "prompt": prompt}
    out = {"sent": sent, "status": r.status_code, "prompt": prompt, "version": r.headers.get(HEADER),
           "replica": r.headers.get("x-eagle3-replica"), "stream": stream}
    if r.status_code != 200:
        out["error"] = r.text
    elif stream:
        events = sse_events(r.text)
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        out["text"] = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))
        out["body_version"] = next(e["speculative"]["draft_version"] for e in events
                                   if isinstance(e, dict) and "speculative" in e)
        if errors or events[-1] != "[DONE]":
            out["error"] = str(errors or events[-1])
    else:
        data = r.json()
        out["text"], out["body_version"] = data["choices"][0]["text"], data["speculative"]["draft_version"]
    return out


def test_both_replicas_follow_the_champion_without_failing_a_request(deployment, models):
    url, client = deployment
    _, _, target, tokenizer = models
    expected = greedy_texts(target, tokenizer)
    headers = {"Authorization": f"Bearer {API_KEY}"}

    async def traffic():
        results: list[dict] = []
        state = {"moved_at": None, "stop": False}

        async def worker(i: int, http: httpx.AsyncClient):
            n = 0
            while not state["stop"]:
                results.append(await one_request(http, PROMPTS[(i + n) % len(PROMPTS)], stream=i % 2 == 1))
                n += 1

        def both_replicas_on(version: str, after: float) -> bool:
            return len({r["replica"] for r in results
                        if r.get("version") == version and r["sent"] >= after and r["replica"]}) == 2

        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60,
                                     limits=httpx.Limits(max_connections=16)) as http:
            workers = [asyncio.create_task(worker(i, http)) for i in range(4)]
            deadline = time.monotonic() + 120
            while not both_replicas_on("1", 0.0):  # traffic reaches both replicas before the move
                assert time.monotonic() < deadline, f"both replicas never answered: {results[-5:]}"
                await asyncio.sleep(0.2)
            # a promotion (here without the lease: the replicas only read the alias)
            await asyncio.to_thread(client.set_registered_model_alias, NAME, "champion", "2")
            state["moved_at"] = moved = time.monotonic()
            settled = moved + POLL_S + SWAP_SLACK_S
            while time.monotonic() < settled + 1.0 or not both_replicas_on("2", settled):
                assert time.monotonic() < moved + 120, "the replicas did not both move to version 2"
                await asyncio.sleep(0.2)
            state["stop"] = True
            await asyncio.gather(*workers)
            models_body = (await http.get("/v1/models")).json()
        return results, moved, models_body

    results, moved, models_body = asyncio.run(traffic())
    failed = [r for r in results if r["status"] != 200 or "error" in r]
    assert not failed, failed[:3]
    for r in results:
        assert r["text"] == expected[r["prompt"]], r  # lossless on either draft, during the swap too
        assert r["version"] == r["body_version"] and r["version"] in ("1", "2"), r
    late = [r for r in results if r["sent"] > moved + POLL_S + SWAP_SLACK_S]
    assert late and all(r["version"] == "2" for r in late), [r for r in late if r["version"] != "2"][:3]
    assert len({r["replica"] for r in late}) == 2
    assert any(r["stream"] for r in late) and any(not r["stream"] for r in late)
    before = [r for r in results if r["sent"] < moved]
    assert before and all(r["version"] == "1" for r in before)
    assert models_body["data"][0]["draft_version"] == "2"
    first_new = min(r["sent"] for r in results if r["version"] == "2") - moved
    print(f"first version-2 answer sent {first_new:.2f} s after the move; {len(results)} requests, "
          f"{len(late)} after the swap window")


def test_a_request_in_flight_keeps_its_draft_and_the_next_takes_the_new_one(models):
    """`Engine.set_draft` mid-request: the running request finishes on the draft it started with, the next one
    decodes with the new draft, both give plain greedy's tokens, and the old draft's lane is gone at the end."""
    import threading

    from eagle_core.checkpoint import load_draft
    from eagle_core.generate import generate
    from eagle_core.tree import TreeConfig
    from eagle_core.verify import SamplingConfig
    from pipelines.serve.engine import Engine, EngineConfig
    from pipelines.serve.rows import GenerationRequest

    _, draft_dir, target, tokenizer = models
    old, new = (load_draft(draft_dir, target=target).eval() for _ in range(2))
    engine = Engine(target, tokenizer, old, EngineConfig(TreeConfig(2, 2, 4), mode_policy="static"),
                    draft_version="1")
    ids = tokenizer("Once upon a time there was", add_special_tokens=False)["input_ids"]
    plain = generate(target, [ids], max_new_tokens=160, eos_token_id=tokenizer.eos_token_id).tokens[0]
    events = {"a": [], "b": []}
    started, done = threading.Event(), {k: threading.Event() for k in events}

    def collect(key):
        def on_event(event):
            events[key].append(event)
            started.set()
            if event.kind != "delta":
                done[key].set()
        return on_event

    try:
        a = GenerationRequest(ids, 160, SamplingConfig(temperature=0.0), collect("a"))
        engine.submit(a)
        assert started.wait(60)
        at_swap = len(events["a"])
        engine.set_draft(new, "2")
        b = GenerationRequest(ids, 160, SamplingConfig(temperature=0.0), collect("b"))
        engine.submit(b)
        assert done["a"].wait(120) and done["b"].wait(120)
    finally:
        engine.close(1.0)
    assert (a.draft.model, a.draft.version, b.draft.model, b.draft.version) == (old, "1", new, "2")
    # a was decoding when the draft changed, and went on after
    assert all(e.kind == "delta" for e in events["a"][:at_swap]) and len(events["a"]) > at_swap
    for key in events:
        assert events[key][-1].kind == "done" and events[key][-1].token_ids == plain, key
    assert not engine.lanes


# ---- a 1 MiB body and another stream, on one replica's routes ---------------------------------------------

@pytest.fixture(scope="module")
def replica(models):
    """One replica's Service behind the deployment's routes, on uvicorn on 127.0.0.1 (no Ray: one event loop,
    as a Serve replica has)."""
    from pipelines.serve.config import ServeConfig
    from pipelines.serve.service import Service

    target_dir, draft_dir, _, _ = models
    service = Service(ServeConfig(target=str(target_dir), draft=str(draft_dir), model_name=MODEL, dtype="float32",
                                  device="cpu", top_k=2, depth=2, total_tokens=4, mode_policy="static",
                                  tree_max_batch=1, chain_max_batch=4, max_batch_size=4, max_context=4096,
                                  max_tokens_limit=4000, torch_threads=1))
    try:
        with uvicorn_thread(replica_app(service)) as url:
            yield url, service
    finally:
        service.close()


def big_chat_body(max_bytes: int) -> bytes:
    """A chat request just under max_bytes: one user message of ordinary text (far past the context, so it is
    refused with a 400 once tokenised, and never decoded)."""
    filler = "The quick brown fox jumps over the lazy dog, 12345. "
    head = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": ""}]}
    room = max_bytes - len(json.dumps(head).encode()) - 16
    head["messages"][0]["content"] = (filler * (room // len(filler) + 1))[:room]
    raw = json.dumps(head).encode()
    assert max_bytes - 64 < len(raw) <= max_bytes
    return raw


def test_a_1_mib_body_does_not_stall_another_stream(replica, monkeypatch):
    """Each round here also waits ROUND_WAIT_S without using the CPU, as a GPU replica's host does while its GPU
    computes: the tiny target's ~10 ms rounds would otherwise be finer than this shared machine's scheduling
    noise. Tokenising the body still costs the CPU its ~1 s."""
    url, service = replica
    raw = big_chat_body(service.config.max_body_bytes)
    real_step = DecodingState.step

    def step(self, mode):
        time.sleep(ROUND_WAIT_S)
        return real_step(self, mode)

    monkeypatch.setattr(DecodingState, "step", step)

    async def run():
        arrivals: list[float] = []
        big: dict = {}
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            async def stream():
                body = {"model": MODEL, "prompt": "Once upon a time there was", "max_tokens": 4000,
                        "temperature": 0, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            arrivals.append(time.monotonic())
                        if "end" in big and arrivals[-1] > big["end"] + 0.2:
                            break  # seen past the big body's answer; leaving cancels the rest

            async def post_big():
                while len(arrivals) < 20:  # the stream runs at its steady pace first
                    await asyncio.sleep(0.01)
                big["start"] = time.monotonic()
                r = await http.post("/v1/chat/completions", content=raw,
                                    headers={"Content-Type": "application/json"})
                big["end"], big["status"], big["error"] = time.monotonic(), r.status_code, r.json()["error"]

            await asyncio.gather(stream(), post_big())
        return arrivals, big

    arrivals, big = asyncio.run(run())
    assert big["status"] == 400 and big["error"]["code"] == "context_length_exceeded", big
    gaps = [(b - a, a, b) for a, b in zip(arrivals, arrivals[1:])]
    baseline = [g for g, _, b in gaps[1:] if b < big["start"]]  # the first gap holds the prefill
    during = [g for g, a, b in gaps if b > big["start"] and a < big["end"]]
    assert arrivals[-1] > big["end"] and during, "the stream ended before the big body was answered"
    round_s = statistics.median(baseline)
    p90 = sorted(baseline)[int(0.9 * (len(baseline) - 1))]
    # a gap is one round when nothing else runs: the next event may come at most one (p90) round late, plus 50 ms
    # for this shared machine's scheduling (the body's thread takes a CPU for its ~1 s)
    bound = 2 * p90 + 0.05
    busy = big["end"] - big["start"]
    if busy <= bound:  # a machine this fast tokenises 1 MiB within a round: a stalled loop would pass too
        pytest.skip(f"the 1 MiB body took only {busy:.2f} s, under the bound {bound:.2f} s")
    assert max(during) <= bound, (f"a stream event waited {max(during):.3f} s while the 1 MiB body was answered "
                                  f"({busy:.2f} s); a round takes {round_s:.3f} s (p90 {p90:.3f} s)")
    print(f"1 MiB body answered in {busy:.2f} s; stream gaps meanwhile max {max(during):.3f} s, "
          f"round {round_s:.3f} s (p90 {p90:.3f})")


# ---- a replica starts without the registry (issue 54, item 11) ----------------------------------------------

def test_a_replica_starts_from_its_record_while_the_registry_is_down_and_catches_up(models, tmp_path):
    """A real `mlflow server` on 127.0.0.1, the echo draft registered twice, `champion` on version 1.

    - A replica that resolves the alias records the draft (a copy of version 1 and a pointer) at draft_record.
    - With the server stopped, a new replica over the same record starts (before: `pin_draft` raised in
      `__init__`), serves version 1 (a completion answers 200, decoded by draft version 1), and after
      draft_stale_polls failed polls says so: /health's detail `stale` with the error, status still "ok", and
      /metrics' draft_stale 1, draft_failed_polls, draft_version 1.
    - A replica with an empty record refuses to start, naming the record.
    - The server back (same port, same data) with `champion` moved to 2: the replica catches up (version 2,
      failed polls 0, stale 0)."""
    from mlflow import MlflowClient
    from mlflow_helpers import MlflowServer

    from pipelines import tracking
    from pipelines.serve.config import ServeConfig
    from pipelines.serve.service import Service
    from serve_helpers import metric

    target_dir, draft_dir, _, _ = models
    server = MlflowServer(tmp_path)
    server.start()
    record = tmp_path / "record"
    settings = dict(target=str(target_dir), draft=f"models:/{NAME}-rec@champion", draft_poll_s=0.3,
                    draft_record=str(record), registry_timeout_s=5.0, draft_stale_polls=2, model_name=MODEL,
                    dtype="float32", device="cpu", top_k=2, depth=2, total_tokens=4, mode_policy="static",
                    tree_max_batch=1, chain_max_batch=4, max_batch_size=4, torch_threads=1)
    try:
        with env(MLFLOW_TRACKING_URI=server.uri, MLFLOW_HTTP_REQUEST_MAX_RETRIES="0",
                 MLFLOW_HTTP_REQUEST_TIMEOUT="5", EAGLE3_WORK=str(tmp_path / "work")):
            mlflow = tracking.configure()
            with tracking.start_run("serve-record-tests", run_name="echo-draft") as run:
                mlflow.log_artifacts(str(draft_dir), artifact_path="draft")
                source = mlflow.get_artifact_uri("draft")
            client = MlflowClient(server.uri)
            client.create_registered_model(f"{NAME}-rec")
            for _ in range(2):
                client.create_model_version(f"{NAME}-rec", source=source, run_id=run.info.run_id)
            client.set_registered_model_alias(f"{NAME}-rec", "champion", "1")

            first = Service(ServeConfig(**settings))
            try:
                assert first.health_body()["draft"]["version"] == "1"
            finally:
                first.close()
            pointer = json.loads((record / "last.json").read_text())
            assert pointer["version"] == "1" and (record / "v1" / "config.json").is_file(), pointer

            server.stop()
            with pytest.raises(RuntimeError, match="no draft was recorded at"):
                Service(ServeConfig(**{**settings, "draft_record": str(tmp_path / "empty-record")}))
            service = Service(ServeConfig(**settings))
            try:
                health = service.health_body()
                assert health["draft"]["version"] == "1" and health["draft"]["started_from_record"], health
                with uvicorn_thread(replica_app(service)) as url:
                    r = httpx.post(f"{url}/v1/completions", timeout=60,
                                   json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4})
                    assert r.status_code == 200 and r.headers[HEADER] == "1", r.text
                    deadline = time.monotonic() + 60
                    while not service.health_body()["draft"]["stale"]:
                        assert time.monotonic() < deadline, service.health_body()
                        time.sleep(0.2)
                    health = httpx.get(f"{url}/health").json()
                    assert health["status"] == "ok" and health["draft"]["failed_polls"] >= 2, health
                    assert health["draft"]["last_error"], health
                    text = httpx.get(f"{url}/metrics").text
                    assert metric(text, "eagle3_serve_draft_stale") == 1.0
                    assert metric(text, "eagle3_serve_draft_failed_polls") >= 2
                    assert metric(text, "eagle3_serve_draft_version") == 1.0

                    server.start()
                    MlflowClient(server.uri).set_registered_model_alias(f"{NAME}-rec", "champion", "2")
                    deadline = time.monotonic() + 60
                    while service.health_body()["draft"]["version"] != "2":
                        assert time.monotonic() < deadline, service.health_body()
                        time.sleep(0.2)
                    draft = service.health_body()["draft"]
                    assert draft["failed_polls"] == 0 and not draft["stale"], draft
                    text = httpx.get(f"{url}/metrics").text
                    assert metric(text, "eagle3_serve_draft_stale") == 0.0
                    assert metric(text, "eagle3_serve_draft_version") == 2.0
                    assert 0 <= metric(text, "eagle3_serve_draft_confirmed_age_seconds") < 30
            finally:
                service.close()
            assert json.loads((record / "last.json").read_text())["version"] == "2"
    finally:
        server.stop()
