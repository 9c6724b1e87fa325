"""The server under faults, without Ray: the engine on its thread, and a replica's `Service` behind the
deployment's routes (`pipelines.serve.app.Routes`) served by uvicorn on 127.0.0.1.

Properties: a merge that fails leaves the running rows' caches as they were (only the joining request fails,
the others' tokens are unchanged); a client that leaves before or during its stream, or before a plain
response, frees its row within a round (seen in /metrics); a hung step turns /health to 503 within its
deadline; a request past its timeout gets 504 with an OpenAI error body and leaves the batch; a drain on
shutdown ends every request with a final event; clients never see exception text.
"""

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import torch

from decode_helpers import echo_draft
from eagle_core.decoding import DecodingState
from eagle_core.target import load_target
from eagle_core.verify import SamplingConfig
from pipelines.serve.engine import Engine, EngineConfig
from pipelines.serve.rows import GenerationRequest, Overloaded
from process_helpers import free_port
from serve_helpers import metric, replica_app, uvicorn_thread

GREEDY = SamplingConfig(temperature=0.0)
PROMPT = [1, 17, 300, 42, 9, 1200, 77]


class Faults:
    """What the test injects into every `DecodingState.step` of this process: a delay, or a hang."""

    def __init__(self):
        self.delay = 0.0
        self.hang = threading.Event()  # set: steps block until `release` is set
        self.release = threading.Event()
        self.hung = threading.Event()  # set by a step that blocked

    def reset(self):
        self.delay = 0.0
        self.hang.clear()
        self.release.set()
        self.release = threading.Event()
        self.hung.clear()


@pytest.fixture
def faults(monkeypatch):
    f = Faults()
    real = DecodingState.step

    def step(self, mode):
        if f.hang.is_set():
            f.hung.set()
            f.release.wait(60)
        if f.delay:
            time.sleep(f.delay)
        return real(self, mode)

    monkeypatch.setattr(DecodingState, "step", step)
    yield f
    f.reset()


@pytest.fixture(scope="module")
def models(tiny_target_dir, tmp_path_factory):
    from eagle_core.checkpoint import load_draft, save_draft

    target, tokenizer = load_target(str(tiny_target_dir), device="cpu", dtype=torch.float32)
    folder = tmp_path_factory.mktemp("faults-draft")
    save_draft(echo_draft(target), folder)
    return target, tokenizer, load_draft(folder, target=target).eval(), folder


class Collector:
    def __init__(self):
        self.events, self.final = [], threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if event.kind != "delta":
            self.final.set()

    @property
    def last(self):
        return self.events[-1]

    def tokens(self):
        return self.last.token_ids


def engine_for(models, **config) -> Engine:
    from eagle_core.tree import TreeConfig

    target, tokenizer, draft, _ = models
    return Engine(target, tokenizer, draft, EngineConfig(TreeConfig(2, 2, 4), mode_policy="static",
                                                         tree_max_batch=1, chain_max_batch=4, **config))


# ---- merges ------------------------------------------------------------------------------------------------

def test_a_failed_cache_merge_leaves_both_caches_unchanged(models):
    import eagle_core.kv as kv

    target, _, draft, _ = models
    a, _ = DecodingState.prefill(target, draft, [PROMPT, PROMPT[:4]], GREEDY)
    b, _ = DecodingState.prefill(target, draft, [PROMPT[:5]], GREEDY)
    before = [(layer.keys, layer.values) for layer in a.kv.cache.layers], a.kv.lengths, a.dkv.k, a.dkv.lengths
    real, calls = kv.pad_cat, []

    def failing(x, y):
        calls.append(1)
        if len(calls) == 3:  # the second layer of the target cache: the first one would be merged already
            raise RuntimeError("out of memory (injected)")
        return real(x, y)

    kv.pad_cat = failing
    try:
        with pytest.raises(RuntimeError, match="injected"):
            a.kv.merge_(b.kv)
        calls.clear()
        calls.extend([1, 1])  # next call is the third: the draft cache's values
        with pytest.raises(RuntimeError, match="injected"):
            a.dkv.merge_(b.dkv)
    finally:
        kv.pad_cat = real
    layers, lengths, dk, dlengths = before
    assert all(layer.keys is k and layer.values is v for layer, (k, v) in zip(a.kv.cache.layers, layers))
    assert a.kv.lengths is lengths and a.dkv.lengths is dlengths and torch.equal(a.dkv.k, dk)


def test_an_exception_in_one_admission_fails_only_that_request(models, faults, monkeypatch):
    """Request A decodes; B's merge into A's lane fails half-way (after the draft cache merged, inside the
    target cache's layers). B gets an error without the exception's text; A's tokens equal an undisturbed run's
    and a later request C is served."""
    import eagle_core.kv as kv

    engine = engine_for(models)
    try:
        ref = Collector()
        engine.submit(GenerationRequest(PROMPT, 40, GREEDY, ref))
        assert ref.final.wait(120) and ref.last.kind == "done"

        faults.delay = 0.05  # A is still decoding when B arrives
        a, b = Collector(), Collector()
        engine.submit(GenerationRequest(PROMPT, 40, GREEDY, a))
        deadline = time.time() + 60
        while not any(e.kind == "delta" for e in a.events):
            assert time.time() < deadline
            time.sleep(0.01)
        real, calls = kv.pad_cat, []

        def failing(x, y):
            calls.append(1)
            if len(calls) == 5:  # 2 draft-cache calls, then the target cache's second layer
                raise RuntimeError("secret internal detail")
            return real(x, y)

        monkeypatch.setattr(kv, "pad_cat", failing)
        engine.submit(GenerationRequest(PROMPT[:5], 40, GREEDY, b))
        assert b.final.wait(60) and b.last.kind == "error"
        assert "secret" not in b.last.text and "internal error" in b.last.text
        monkeypatch.setattr(kv, "pad_cat", real)
        assert a.final.wait(120) and a.last.kind == "done", a.last.text
        assert a.tokens() == ref.tokens()
        c = Collector()
        engine.submit(GenerationRequest(PROMPT, 40, GREEDY, c))
        assert c.final.wait(120) and c.tokens() == ref.tokens()
    finally:
        engine.close(drain_s=0)


# ---- drain ---------------------------------------------------------------------------------------------------

def test_close_drains_every_request_with_a_final_event(models, faults):
    """Requests decoding and waiting when close() starts all end with "done" or an "error" event; a short drain
    fails the unfinished ones, a long one lets them finish; nothing is accepted meanwhile."""
    for drain_s, finished in ((0.3, False), (60.0, True)):
        engine = engine_for(models, max_batch_size=2, max_waiting=4)
        faults.delay = 0.05
        collectors = [Collector() for _ in range(4)]
        for c in collectors:  # two decode, two wait
            engine.submit(GenerationRequest(PROMPT, 48, GREEDY, c))
        time.sleep(0.3)
        closer = threading.Thread(target=engine.close, args=(drain_s,))
        closer.start()
        time.sleep(0.05)
        with pytest.raises(Overloaded, match="shutting down"):
            engine.submit(GenerationRequest(PROMPT, 4, GREEDY, Collector()))
        closer.join(120)
        assert not engine.thread.is_alive()
        assert all(c.final.is_set() for c in collectors)
        kinds = [c.last.kind for c in collectors]
        if finished:
            assert kinds == ["done"] * 4
        else:
            assert "error" in kinds
            assert all(c.last.text == "the server is shutting down" for c in collectors if c.last.kind == "error")


# ---- HTTP: a replica's routes on uvicorn ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(models, tiny_target_dir):
    from pipelines.serve.config import ServeConfig
    from pipelines.serve.service import Service

    config = ServeConfig(target=str(tiny_target_dir), draft=str(models[3]), model_name="tiny", dtype="float32",
                         device="cpu", top_k=2, depth=2, total_tokens=4, mode_policy="static", tree_max_batch=1,
                         chain_max_batch=4, max_batch_size=4, max_waiting=4, max_context=256, max_tokens_limit=200,
                         torch_threads=1, stall_timeout_s=1.0, drain_s=1.0)
    service = Service(config)
    try:
        with uvicorn_thread(replica_app(service)) as url:  # the routes as SpecDecodeServer wires them
            yield url, service
    finally:
        service.close()


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def body(max_tokens=200, stream=False) -> bytes:
    return json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": stream}).encode()


def raw_request(url: str, payload: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


def wait_for(check, what: str, timeout: float = 60.0):
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, what
        time.sleep(0.02)


@pytest.mark.parametrize("when", ["before-stream", "mid-stream", "plain-response"])
def test_a_client_that_leaves_frees_its_row_within_one_round(server, faults, when):
    """Rounds take >= 0.25 s here, and a request asks for 200 tokens (plain or speculative, hundreds of rounds'
    worth). After the client closes its connection, the replica's /metrics show the row gone (running 0,
    cancelled + 1) after at most the round in flight and the next one, and the request never finished."""
    url, service = server
    faults.delay = 0.25
    text = scrape(url)
    cancelled = metric(text, "eagle3_serve_cancelled_total")
    generated = metric(text, "eagle3_serve_generated_tokens_total")
    sock = raw_request(url, body(stream=when != "plain-response"))
    if when == "mid-stream":
        sock.settimeout(60)
        received = b""
        while b"data: " not in received:  # the stream started
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
    else:
        wait_for(lambda: metric(scrape(url), "eagle3_serve_running") == 1, "the request is decoding")
    rounds_at_close = sum(metric(scrape(url), "eagle3_serve_rounds_total", mode=m) for m in ("tree", "chain", "plain"))
    sock.close()
    wait_for(lambda: metric(scrape(url), "eagle3_serve_cancelled_total") == cancelled + 1, "the row was cancelled")
    text = scrape(url)
    rounds = sum(metric(text, "eagle3_serve_rounds_total", mode=m) for m in ("tree", "chain", "plain"))
    assert rounds - rounds_at_close <= 2
    assert metric(text, "eagle3_serve_running") == 0
    assert metric(text, "eagle3_serve_generated_tokens_total") == generated  # it never finished


def test_a_hung_step_fails_health_within_its_deadline_and_recovers(server, faults):
    url, service = server
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    faults.hang.set()
    client = threading.Thread(target=lambda: httpx.post(f"{url}/v1/completions", content=body(max_tokens=8),
                                                        timeout=120), daemon=True)
    client.start()
    assert faults.hung.wait(60)
    hung_at = time.monotonic()
    wait_for(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 503, "health turns 503", timeout=30)
    took = time.monotonic() - hung_at
    assert took <= service.config.stall_timeout_s + 2.0, took
    reply = httpx.get(f"{url}/health", timeout=10).json()
    assert reply["status"] == "stalled" and reply["seconds_without_progress"] >= service.config.stall_timeout_s
    faults.hang.clear()
    faults.release.set()
    client.join(120)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_a_request_past_its_timeout_gets_504_and_leaves_the_batch(server, faults):
    url, service = server
    faults.delay = 0.25
    service.config.request_timeout_s = 1.0
    try:
        cancelled = metric(scrape(url), "eagle3_serve_cancelled_total")
        r = httpx.post(f"{url}/v1/completions", content=body(), timeout=60)
        assert r.status_code == 504
        assert r.json()["error"]["type"] == "timeout_error" and "1 s" in r.json()["error"]["message"]
        with httpx.stream("POST", f"{url}/v1/completions", content=body(stream=True), timeout=60) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[-2][6:])["error"]["type"] == "timeout_error" and events[-1] == "data: [DONE]"
        wait_for(lambda: metric(scrape(url), "eagle3_serve_cancelled_total") == cancelled + 2, "rows cancelled")
        assert metric(scrape(url), "eagle3_serve_timeouts_total") >= 2
    finally:
        service.config.request_timeout_s = 600.0


def test_an_event_stream_closed_before_it_started_cancels_its_row(models):
    """`EventStream.aclose()` frees the row even when no chunk was ever asked for (an async generator that
    never started would run no cleanup)."""
    from pipelines.serve.rows import GenerationRequest as G
    from pipelines.serve.service import EventStream

    async def chunks():
        yield "never"

    gen = G(PROMPT, 4, GREEDY, lambda e: None)
    asyncio.run(EventStream(gen, chunks()).aclose())
    assert gen.cancelled


def test_the_api_key_comes_from_a_file_and_a_missing_one_stops_the_replica(tmp_path, monkeypatch):
    from pipelines.serve.config import ServeConfig
    from pipelines.serve.config import resolve_api_key

    for name in ("EAGLE3_SERVE_API_KEY", "EAGLE3_SERVE_API_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    key = tmp_path / "api-key"
    key.write_text("k3y-from-a-secret\n")
    assert resolve_api_key(ServeConfig(api_key_file=str(key))) == "k3y-from-a-secret"
    monkeypatch.setenv("EAGLE3_SERVE_API_KEY_FILE", str(key))
    assert resolve_api_key(ServeConfig()) == "k3y-from-a-secret"
    monkeypatch.delenv("EAGLE3_SERVE_API_KEY_FILE")
    with pytest.raises(RuntimeError, match="cannot read"):
        resolve_api_key(ServeConfig(api_key_file=str(tmp_path / "absent")))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(RuntimeError, match="empty"):
        resolve_api_key(ServeConfig(api_key_file=str(tmp_path / "empty")))
    assert resolve_api_key(ServeConfig()) is None  # no key anywhere: no auth (a loopback server)
    with pytest.raises(RuntimeError, match="requires an API key"):
        resolve_api_key(ServeConfig(require_api_key=True))


def test_the_deployment_never_puts_the_key_into_runtime_env(monkeypatch):
    from pipelines.serve.app import build_app, deployment_options
    from pipelines.serve.config import DeploymentOptions

    monkeypatch.setenv("EAGLE3_SERVE_API_KEY", "do-not-leak")
    monkeypatch.setenv("EAGLE3_SERVE_API_KEY_FILE", "/etc/eagle3/serve/api-key")
    env = deployment_options(DeploymentOptions(num_gpus=0))["ray_actor_options"]["runtime_env"]["env_vars"]
    assert "do-not-leak" not in env.values() and env["EAGLE3_SERVE_API_KEY_FILE"] == "/etc/eagle3/serve/api-key"
    monkeypatch.delenv("EAGLE3_SERVE_API_KEY_FILE")
    app = build_app({"target": "t", "num_gpus": 0})  # the driver has a key the replicas may not: they must find one
    assert app._bound_deployment.init_args[0]["require_api_key"] is True


def test_a_key_in_the_apps_arguments_is_refused_naming_the_file_and_the_environment(monkeypatch):
    """Issue 54 (5): the app's args are shown by the Ray dashboard and kept in the RayService object, so a key there
    (`--set api_key=...`, `api_key:` in a Serve config) is refused, by the builder and by jobs/serve.py, with an
    error that says where a key may come from."""
    import importlib.util
    from pathlib import Path

    from pipelines.serve.app import build_app

    for name in ("EAGLE3_SERVE_API_KEY", "EAGLE3_SERVE_API_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"api_key_file=PATH.*EAGLE3_SERVE_API_KEY_FILE.*EAGLE3_SERVE_API_KEY"):
        build_app({"target": "t", "api_key": "s3cret", "num_gpus": 0})
    spec = importlib.util.spec_from_file_location("job_serve", Path(__file__).resolve().parents[1] / "jobs" / "serve.py")
    serve_job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_job)
    with pytest.raises(SystemExit, match=r"refused: they are shown by the Ray dashboard"):
        serve_job.main(["--host", "127.0.0.1", "--set", "api_key=s3cret", "--no-block"])
    assert build_app({"target": "t", "api_key_file": "/etc/eagle3/serve/api-key", "num_gpus": 0})


def test_sigterm_ends_every_in_flight_request_with_a_final_event(models, tiny_target_dir, tmp_path):
    """A server process with three streams in flight (200 tokens each, 0.1 s a round: ~20 s of work) gets SIGTERM:
    within its 1 s drain every stream ends with a final event (a finish chunk, or the shutdown error) and [DONE],
    and the process exits."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen([sys.executable, str(repo / "tests" / "serve_sigterm_server.py"), str(tiny_target_dir),
                               str(models[3]), str(port), "1.0"], cwd=repo, stdout=log, stderr=log,
                              env={**os.environ, "PYTHONPATH": str(repo)})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: server.poll() is None and _up(url), "the server", timeout=180)
        results, started = {}, threading.Barrier(4)

        def stream(i):
            lines = []
            with httpx.stream("POST", f"{url}/v1/completions", content=body(stream=True), timeout=120) as s:
                first = True
                for line in s.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        if first:
                            started.wait(60)
                            first = False
            results[i] = lines

        clients = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for c in clients:
            c.start()
        started.wait(120)  # every stream has its first chunk
        signalled = time.monotonic()
        server.send_signal(signal.SIGTERM)
        for c in clients:
            c.join(60)
        # uvicorn re-raises the signal once its graceful shutdown is over: a clean stop ends "killed" by SIGTERM
        assert server.wait(timeout=60) in (0, -signal.SIGTERM)
        assert time.monotonic() - signalled < 30
    finally:
        if server.poll() is None:
            server.kill()
    assert sorted(results) == [0, 1, 2], (tmp_path / "server.log").read_text()[-3000:]
    for lines in results.values():
        assert lines[-1] == "[DONE]"
        final = json.loads(lines[-2])
        finished = "choices" in final and final["choices"] and final["choices"][0].get("finish_reason")
        assert finished or final["error"]["message"] == "generation failed: the server is shutting down", final
    assert any("error" in json.loads(lines[-2]) for lines in results.values())  # the drain cut some short


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
