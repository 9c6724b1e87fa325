"""The Ray Serve deployment: FastAPI ingress in front of one `Service` per replica.

  serve run pipelines.serve.app:build_app target=smollm2-135m draft=eagle_core/drafts/smollm2-135m-instruct
  serve deploy infra/serve.yaml          (or: python jobs/serve.py ...)

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream`), GET /v1/models,
GET /health (no auth: probes; without the key, where one is set, only the status), GET /metrics (Prometheus
text of this replica; behind the key when one is set: scrapers send it as a bearer token).
"""

# No `from __future__ import annotations` here: FastAPI must see real types on the ingress methods
# (with string annotations, `request: Request` of a Serve ingress method turns into a query parameter).
import asyncio
import contextlib
import logging
import os
import time
from dataclasses import fields
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pipelines.serve import protocol as P

from pipelines.serve import responses as R
from pipelines.serve.config import API_KEY_IN_ARGS, DeploymentOptions, ServeConfig, keyless_exposure

REPO_ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger(__name__)

# The `route` label of the request metrics; any other path counts as "other" (bounded label values).
ROUTE_LABELS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/models": "models"}
# This process's replica metrics, for errors answered outside a route (404, 405, ...): one replica per process.
_REPLICA: dict = {}


# ---- errors: every exception becomes an OpenAI error body with a fitting status ------------------------

def error_response(exc: BaseException) -> JSONResponse:
    """Any exception -> {"error": {"message", "type", "param", "code"}} and its status; unexpected ones are
    logged and answered 500 without internals."""
    if isinstance(exc, P.ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)
    if isinstance(exc, StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(P.error_body(str(exc.detail), kind), status_code=exc.status_code)
    if isinstance(exc, RequestValidationError):
        return JSONResponse(P.error_body(f"invalid request: {exc.errors()[:1]}"), status_code=400)
    if isinstance(exc, ClientDisconnect):
        return JSONResponse(P.error_body("the client disconnected before sending the whole body"), status_code=400)
    log.error("unexpected error answering a request", exc_info=exc)
    return JSONResponse(P.error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)


def add_error_handlers(app: FastAPI) -> None:
    """Errors raised outside the routes' own handling (unknown route, wrong method, ...) get the same body
    and are counted in the replica's request metrics too."""

    async def handler(request: Request, exc: Exception):
        response = error_response(exc)
        metrics = _REPLICA.get("metrics")
        if metrics is not None:
            metrics.on_response(ROUTE_LABELS.get(request.url.path, "other"), response.status_code)
        return response

    for kind in (P.ApiError, StarletteHTTPException, RequestValidationError, Exception):
        app.add_exception_handler(kind, handler)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed max_bytes (never buffered beyond)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise P.body_too_large(max_bytes)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise P.body_too_large(max_bytes)
        parts.append(chunk)
    return b"".join(parts)


class EngineStreamResponse(StreamingResponse):
    """A streaming response that notices a client leaving at any point, before the first chunk included, and
    then runs `on_close` (which cancels the request's engine row). Starlette watches for the disconnect only
    below ASGI 2.4; at 2.4 it learns of it from a failed send, i.e. not before the next chunk, and never while
    the request waits to be admitted. Here the stream and the disconnect watch always race, and `on_close`
    runs however the response ends (finished, client gone, task cancelled)."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        import anyio

        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-send
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.on_close()


async def until_disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body is read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Routes:
    """What the OpenAI routes do, over a `Service` (or anything with its interface): plain Python, so the
    error mapping and the accounting are tested without Ray. Every request is counted once in the request
    metrics, with the status it got (a stream: 200, or 500 when it failed mid-way)."""

    def __init__(self, service):
        self.service = service

    def _done(self, route: str, t0: float):
        return lambda code: self.service.metrics.on_response(route, code, time.perf_counter() - t0)

    async def generate(self, request: Request, route: str, schema, chat: bool) -> Response:
        done = self._done(route, time.perf_counter())
        try:
            self.service.authorize(request.headers)
            header_category = R.header_category(request.headers)  # a malformed label: 400 before the body is read
            max_bytes = self.service.config.max_body_bytes
            # parsing and validating up to max_body_bytes of JSON: off the event loop, as tokenisation is
            req = await asyncio.to_thread(P.parse_request, await read_body(request, max_bytes), schema, max_bytes)
            req.category = R.request_category(req, header_category)  # the service reads the label off the request
            if req.stream:
                outcome = {"code": 200}
                events = await self.service.stream(req, chat, on_end=lambda code: outcome.update(code=code))
                include_usage = req.stream_options is not None and req.stream_options.include_usage
                headers = {"Cache-Control": "no-cache", **self._headers(getattr(events, "draft_version", None))}
                return EngineStreamResponse(self._stream(events, include_usage, outcome, done), events.aclose,
                                            media_type="text/event-stream", headers=headers)
            body = await self._unless_disconnected(request, self.service.complete(req, chat))
        except Exception as exc:
            response = error_response(exc)
            done(response.status_code)
            return response
        if body is None:  # the client left; its row was cancelled (499: nginx's "client closed request")
            done(499)
            return Response(status_code=499)
        done(200)
        return JSONResponse(body, headers=self._headers((body.get("speculative") or {}).get("draft_version")))

    def _headers(self, draft_version: str | None) -> dict:
        """Which draft version decoded this request, and which replica answered (when known)."""
        headers = {R.DRAFT_VERSION_HEADER: draft_version} if draft_version else {}
        replica = getattr(self.service, "replica", None)
        if replica:
            headers[R.REPLICA_HEADER] = replica
        return headers

    @staticmethod
    async def _unless_disconnected(request: Request, work):
        """`await work`, or None as soon as the client disconnects; cancelling `work` (also when this handler is
        itself cancelled) ends its `Service.events`, which cancels the engine row."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(until_disconnected(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            return None
        finally:
            for t in (task, watcher):
                t.cancel()
            with contextlib.suppress(BaseException):
                await task

    @staticmethod
    async def _stream(events, include_usage: bool, outcome: dict, done):
        """The service's events under OpenAI's usage rule; a failure after the 200 went out is reported in
        the stream (an error event) and counted as 500."""
        try:
            async for event in R.usage_once(events, include_usage):
                yield event
        except Exception as exc:
            log.error("stream failed", exc_info=exc)
            outcome["code"] = 500
            yield R.sse(P.error_body(f"internal error: {type(exc).__name__}", "server_error"))
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()  # runs the service's own cleanup now (cancels the engine row)
            done(outcome["code"])

    async def models(self, request: Request) -> Response:
        done = self._done("models", time.perf_counter())
        try:
            self.service.authorize(request.headers)
            body = self.service.models_body()
        except Exception as exc:
            response = error_response(exc)
            done(response.status_code)
            return response
        done(200)
        return JSONResponse(body)

    async def health(self, request: Request) -> Response:
        """Probes need only the status: without the key (where one is set) that is all the body says; the
        detail (model, draft version, queue depth) is for those who hold the key."""
        body = self.service.health_body()
        code = 200 if body["status"] == "ok" else 503
        try:
            self.service.authorize(request.headers)
        except P.ApiError:
            body = {"status": body["status"]}
        return JSONResponse(body, status_code=code)

    async def metrics(self, request: Request) -> Response:
        """The replica's Prometheus text, behind the key when one is set (its labels are the clients' own)."""
        try:
            self.service.authorize(request.headers)
        except Exception as exc:
            return error_response(exc)
        return Response(self.service.metrics.exposition(), media_type="text/plain; version=0.0.4")


api = FastAPI(title="EAGLE-3 speculative decoding", docs_url=None, redoc_url=None, openapi_url=None)
add_error_handlers(api)


@serve.deployment(name="SpecDecode")
@serve.ingress(api)
class SpecDecodeServer:
    def __init__(self, config: dict):
        from pipelines.serve.service import Service

        config = ServeConfig.from_dict(config)
        self.service = Service(config, use_ray_metrics=True)
        if self.service.api_key is None:  # whatever started Serve: no keyless replica behind an exposed proxy
            # imported here: Serve ships this class by value, without the module-level names defined after it
            from pipelines.serve.app import proxy_bind

            problem = keyless_exposure(*proxy_bind(), has_key=False, insecure=config.insecure_no_auth)
            if problem:
                self.service.close()
                raise RuntimeError(problem)
        self.service.replica = serve.get_replica_context().replica_id.unique_id
        self.routes = Routes(self.service)
        _REPLICA["metrics"] = self.service.metrics

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self.routes.generate(request, "completions", P.CompletionRequest, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self.routes.generate(request, "chat", P.ChatCompletionRequest, chat=True)

    @api.get("/v1/models")
    async def models(self, request: Request):
        return await self.routes.models(request)

    @api.get("/health")
    async def health(self, request: Request):
        return await self.routes.health(request)

    @api.get("/metrics")
    async def metrics(self, request: Request):
        return await self.routes.metrics(request)

    def check_health(self):
        """Serve's replica health check: a dead engine thread, or requests pending with no progress for
        stall_timeout_s (a hung step), means restart the replica."""
        body = self.service.health_body()
        if body["status"] != "ok":
            raise RuntimeError(f"decoding engine {body['status']}: {body}")

    def __del__(self):
        service = getattr(self, "service", None)
        if service is not None:
            service.close()


# ---- building the application -------------------------------------------------------------------------------

def _coerce(value, annotation: str):
    """CLI args of `serve run module:build_app key=value` arrive as strings; YAML args keep their types."""
    if not isinstance(value, str):
        return value
    if value.lower() in ("none", "null") and "None" in annotation:
        return None
    head = annotation.split("|")[0].strip()
    if head == "bool":
        return value.lower() in ("1", "true", "yes")
    if head in ("int", "float"):
        try:
            return {"int": int, "float": float}[head](value)
        except ValueError:
            if "str" in annotation:  # e.g. num_replicas=auto
                return value
            raise
    return value


def split_args(args: dict | None) -> tuple[ServeConfig, DeploymentOptions]:
    """Flat args -> (what the replica does, how Serve places it); unknown keys are an error."""
    args = dict(args or {})
    parts = []
    for cls in (ServeConfig, DeploymentOptions):
        types = {f.name: str(f.type) for f in fields(cls)}
        parts.append({k: _coerce(args.pop(k), types[k]) for k in list(args) if k in types})
    if args:
        raise ValueError(f"unknown serve arguments: {sorted(args)}")
    return ServeConfig.from_dict(parts[0]), DeploymentOptions(**parts[1])


def _has_gpus() -> bool:
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()


def deployment_options(options: DeploymentOptions) -> dict:
    num_gpus = options.num_gpus if options.num_gpus is not None else (1 if _has_gpus() else 0)
    pythonpath = os.pathsep.join(p for p in (options.pythonpath or str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": pythonpath, "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
           "MLFLOW_DISABLE_TELEMETRY": "true"}
    # The registry and where the token file lies travel as the driver says. The token itself never does:
    # runtime_env is shown by the Ray dashboard (a replica reads it from a file, ServeConfig.api_key_file).
    for name in ("MLFLOW_TRACKING_URI", "EAGLE3_WORK", "EAGLE3_SERVE_API_KEY_FILE"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    out = dict(max_ongoing_requests=options.max_ongoing_requests, max_queued_requests=options.max_queued_requests,
               ray_actor_options={"num_cpus": options.num_cpus, "num_gpus": num_gpus,
                                  "runtime_env": {"env_vars": env}})
    if options.autoscaling_config:
        out["autoscaling_config"] = options.autoscaling_config
    else:
        out["num_replicas"] = options.num_replicas
    return out


def build_app(args: dict | None = None):
    """Application builder for `serve run` / `serve deploy` (import path `pipelines.serve.app:build_app`)."""
    config, options = split_args(args)
    if config.api_key:
        raise ValueError(API_KEY_IN_ARGS)
    if os.environ.get("EAGLE3_SERVE_API_KEY") and not config.api_key_file:
        # the driver has a token the replicas may not see (they run elsewhere, runtime_env does not carry it):
        # make a replica without one refuse to start rather than serve without auth
        log.warning("EAGLE3_SERVE_API_KEY is set but not copied to the replicas; they use EAGLE3_SERVE_API_KEY "
                    "from their own environment or api_key_file, and refuse to start without one")
        config.require_api_key = True
    placement = deployment_options(options)
    # Serve waits this long for a stopping replica's requests before killing it; they end by then on their own
    # (finished, or 504 at request_timeout_s), so each gets its final event; then __del__ drains the rest.
    placement.setdefault("graceful_shutdown_timeout_s", config.request_timeout_s + config.drain_s)
    return SpecDecodeServer.options(**placement).bind(config.to_dict())


def proxy_bind() -> tuple[str, int]:
    """(host, port) the running Serve instance's HTTP proxy binds: the options it started with, which a later
    `serve.start(http_options=...)` does not change (Serve only logs that they differ)."""
    from ray.serve.context import _get_global_client

    options = _get_global_client().http_config
    return options.host, options.port


def run_local(app, name: str, port: int, host: str = "127.0.0.1", route_prefix: str = "/",
              timeout_s: float = 300.0) -> str:
    """Deploy `app` (`build_app(...)`) on this Ray cluster's Serve instance, starting Serve on host:port if it is not
    running, and wait until its /health answers 200; returns the app's base URL. Raises TimeoutError after
    `timeout_s` (a replica still loading its target, or one that failed to start)."""
    import httpx

    serve.start(http_options={"host": host, "port": port})  # a running instance keeps its own options
    host, port = proxy_bind()
    serve.run(app, name=name, route_prefix=route_prefix, blocking=False)
    url = f"http://{host}:{port}{route_prefix.rstrip('/')}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return url
        time.sleep(0.5)
    raise TimeoutError(f"the Serve app {name!r} at {url}/health did not answer 200 within {timeout_s:.0f} s")
