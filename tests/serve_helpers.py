"""One live local Serve deployment shared by tests/test_serve.py and tests/test_serve_validation.py.

The target is a tiny random Llama with SmolLM2's tokenizer whose blocks are damped (it repeats tokens in
runs and switches now and then); the draft is the hand-set echo draft, which proposes "repeat": so
acceptance is neither all nor nothing. The draft is saved as a checkpoint and registered in a temporary
MLflow registry, so the replica loads it through `models:/<name>@<alias>`.
Started once per session (module-scoped fixtures in both files call `live_deployment`); the session's
`ray_cluster` teardown stops it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from fastapi import Request  # a module global: the routes of `replica_app` name it in (string) annotations
from process_helpers import free_port  # noqa: F401 (re-exported for the serve tests)

API_KEY = "test-token-123"
MODEL = "tiny-eagle3"
_LIVE: dict = {}


@dataclass
class Live:
    url: str
    target: object
    tokenizer: object
    draft: object
    config: object  # ServeConfig

    def client(self, auth: bool = True, timeout: float = 120.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {API_KEY}"} if auth else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def async_client(self, timeout: float = 120.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=timeout, limits=httpx.Limits(max_connections=100))


@contextlib.contextmanager
def env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def register_draft(folder, name: str) -> str:
    """Log the draft folder as a run artifact, register it, alias it 'serve': returns models:/name@serve."""
    from mlflow import MlflowClient

    from pipelines import tracking

    mlflow = tracking.configure()
    with tracking.start_run("serve-tests", run_name="tiny-echo-draft") as run:
        mlflow.log_artifacts(str(folder), artifact_path="draft")
        source = mlflow.get_artifact_uri("draft")
    client = MlflowClient()
    client.create_registered_model(name)
    version = client.create_model_version(name, source=source, run_id=run.info.run_id)
    client.set_registered_model_alias(name, "serve", version.version)
    return f"models:/{name}@serve"


def save_target(folder, tokenizer):
    """A damped tiny Llama (tied embeddings: it tends to repeat its input) as an HF folder."""
    from decode_helpers import damped_tiny_llama

    model = damped_tiny_llama(1.5, vocab_size=len(tokenizer), num_hidden_layers=4, seed=3)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, name, getattr(tokenizer, name))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def api_key_file(tmp_path_factory) -> Path:
    """API_KEY in a file the replicas read (a key in the app's args is refused: the dashboard shows them)."""
    path = tmp_path_factory.mktemp("serve-key") / "api-key"
    path.write_text(API_KEY + "\n")
    return path


def run_app(app, name: str, route_prefix: str) -> str:
    """Deploy `app` on this session's Serve instance (started once, on 127.0.0.1 at a free port) and wait until
    healthy (`pipelines.serve.app.run_local`)."""
    from pipelines.serve.app import run_local

    _LIVE.setdefault("port", free_port())
    return run_local(app, name, _LIVE["port"], route_prefix=route_prefix, timeout_s=180.0)


def live_deployment(tmp_path_factory, tokenizer) -> Live:
    if "live" in _LIVE:
        return _LIVE["live"]
    import torch

    from decode_helpers import echo_draft
    from eagle_core.checkpoint import load_draft, save_draft
    from eagle_core.target import load_target
    from pipelines.serve.app import build_app, split_args

    target_dir = save_target(tmp_path_factory.mktemp("serve-target"), tokenizer)
    target, tokenizer = load_target(str(target_dir), device="cpu", dtype=torch.float32)
    folder = tmp_path_factory.mktemp("echo-draft")
    save_draft(echo_draft(target), folder)
    args = dict(target=str(target_dir), model_name=MODEL, dtype="float32", top_k=4, depth=4, total_tokens=12,
                max_batch_size=4, max_waiting=4, mode_policy="static", tree_max_batch=1, chain_max_batch=2,
                max_context=256,
                max_tokens_limit=64, api_key_file=str(api_key_file(tmp_path_factory)), torch_threads=1,
                num_cpus=0.5, num_gpus=0)
    with env(EAGLE3_WORK=str(tmp_path_factory.mktemp("serve-work"))):
        args["draft"] = register_draft(folder, "tiny-echo-draft")
        app = build_app(args)  # the replica inherits EAGLE3_WORK: it resolves the registry URI itself
    url = run_app(app, "eagle3-test", "/")
    config, _ = split_args(args)
    _LIVE["live"] = Live(url, target, tokenizer, load_draft(folder, target=target).eval(), config)
    return _LIVE["live"]


def sse_events(text: str) -> list:
    """Parse an SSE body into JSON chunks (and the final '[DONE]' string)."""
    events = []
    for block in text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            payload = block[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def metric(text: str, name: str, **labels) -> float:
    """A sample's value from Prometheus text (0 when absent); label order does not matter."""
    want = {k: str(v) for k, v in labels.items()}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$", line)
        if m and m.group(1) == name and dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")) == want:
            return float(m.group(3))
    return 0.0


def replica_app(service):
    """One replica's routes without Ray: `Routes` over `service` (a `Service`, or a fake with its interface),
    wired as SpecDecodeServer wires them."""
    from fastapi import FastAPI

    from pipelines.serve import app as serve_app
    from pipelines.serve import protocol as P

    routes = serve_app.Routes(service)
    api = FastAPI()
    serve_app.add_error_handlers(api)

    @api.post("/v1/completions")
    async def completions(request: Request):
        return await routes.generate(request, "completions", P.CompletionRequest, chat=False)

    @api.post("/v1/chat/completions")
    async def chat(request: Request):
        return await routes.generate(request, "chat", P.ChatCompletionRequest, chat=True)

    @api.get("/v1/models")
    async def models(request: Request):
        return await routes.models(request)

    @api.get("/health")
    async def health(request: Request):
        return await routes.health(request)

    @api.get("/metrics")
    async def metrics(request: Request):
        return await routes.metrics(request)

    return api


@contextlib.contextmanager
def uvicorn_thread(api):
    """Serve a FastAPI app on 127.0.0.1 (a free port) from a thread of this process; yields its URL."""
    import threading

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert time.time() < deadline, "uvicorn did not start"
        time.sleep(0.1)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
