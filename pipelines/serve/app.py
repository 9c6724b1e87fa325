"""The Ray Serve deployment: FastAPI ingress in front of one `Service` per replica.

  serve run pipelines.serve.app:build_app target=smollm2-135m draft=work/drafts/smollm2-quick
  serve deploy infra/serve.yaml          (or: python jobs/serve.py ...)

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream`), GET /v1/models,
GET /health (no auth: probes), GET /metrics (Prometheus text of this replica; no auth: scrapers).
"""

# No `from __future__ import annotations` here: FastAPI must see real types on the ingress methods
# (with string annotations, `request: Request` of a Serve ingress method turns into a query parameter).
import os
import time
from dataclasses import fields
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipelines.serve import protocol as P
from pipelines.serve.config import DeploymentOptions, ServeConfig

REPO_ROOT = Path(__file__).resolve().parents[2]

api = FastAPI(title="EAGLE-3 speculative decoding", docs_url=None, redoc_url=None, openapi_url=None)


@api.exception_handler(P.ApiError)
async def _api_error(_request, exc: P.ApiError):
    return JSONResponse(exc.body(), status_code=exc.status)


@api.exception_handler(StarletteHTTPException)
async def _http_error(_request, exc: StarletteHTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(P.error_body(str(exc.detail), kind), status_code=exc.status_code)


@api.exception_handler(RequestValidationError)
async def _validation_error(_request, exc: RequestValidationError):
    return JSONResponse(P.error_body(f"invalid request: {exc.errors()[:1]}"), status_code=400)


@api.exception_handler(Exception)
async def _unexpected(_request, exc: Exception):
    return JSONResponse(P.error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)


@serve.deployment(name="SpecDecode")
@serve.ingress(api)
class SpecDecodeServer:
    def __init__(self, config: dict):
        from pipelines.serve.service import Service

        self.service = Service(ServeConfig.from_dict(config), use_ray_metrics=True)

    async def _generate(self, request: Request, route: str, schema, chat: bool):
        t0 = time.perf_counter()
        metrics = self.service.metrics
        try:
            self.service.authorize(request.headers)
            req = P.parse_request(await request.body(), schema, self.service.config.max_body_bytes)
            if req.stream:
                end = lambda code: metrics.on_response(route, code, time.perf_counter() - t0)  # noqa: E731
                events = await self.service.stream(req, chat, on_end=end)
                return StreamingResponse(events, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            body = await self.service.complete(req, chat)
        except P.ApiError as exc:
            metrics.on_response(route, exc.status, time.perf_counter() - t0)
            return JSONResponse(exc.body(), status_code=exc.status)
        metrics.on_response(route, 200, time.perf_counter() - t0)
        return JSONResponse(body)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._generate(request, "completions", P.CompletionRequest, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._generate(request, "chat", P.ChatCompletionRequest, chat=True)

    @api.get("/v1/models")
    async def models(self, request: Request):
        self.service.authorize(request.headers)
        return self.service.models_body()

    @api.get("/health")
    async def health(self):
        body = self.service.health_body()
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @api.get("/metrics")
    async def metrics(self):
        return Response(self.service.metrics.exposition(), media_type="text/plain; version=0.0.4")

    def check_health(self):
        """Serve's replica health check: a dead engine thread means restart the replica."""
        if not self.service.engine.thread.is_alive():
            raise RuntimeError("decoding engine thread died")

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
    for name in ("MLFLOW_TRACKING_URI", "EAGLE3_WORK", "EAGLE3_SERVE_API_KEY"):
        if os.environ.get(name):
            env[name] = os.environ[name]  # the registry and the token live where the driver says
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
    return SpecDecodeServer.options(**deployment_options(options)).bind(config.to_dict())
