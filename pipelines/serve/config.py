"""The deployment's settings: one plain dataclass, filled from the CLI, a Serve config YAML or a test.

Every field is a plain value so the whole config travels as a dict through `serve run` / `serve deploy`
(`applications[].args`) and into the replica's constructor. The tree and batching fields are flat for that
reason; their defaults are `TreeConfig`'s and `EngineConfig`'s, which own them (`tree`, `engine`).
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from eagle_core.tree import TreeConfig
from pipelines.cli import config_from_fields
from pipelines.serve.engine import EngineConfig


@dataclass
class ServeConfig:
    # ---- models --------------------------------------------------------------------------------------------
    target: str = "smollm2-135m"  # short name, HF folder, .gguf, or models:/<name>@<alias>
    draft: str | None = None  # draft folder or models:/<name>@<alias>; None = plain decoding
    # With draft = models:/<name>@<alias>: every this many seconds each replica looks the alias up again and, when
    # it names another version, loads that draft and decodes new requests with it (requests in flight finish on
    # theirs), so replicas under one model name converge on one champion. 0 = resolve once, at start.
    draft_poll_s: float = 60.0
    # Where each replica records the last draft it resolved from the registry (a copy per version and a pointer):
    # a replica whose registry lookup fails starts from it and catches up later (pipelines/serve/champion.py).
    # A folder or URL the serving identity reads and writes, e.g. s3://<serving-bucket>/last-draft for replicas
    # that move between nodes; None = this node's cache.
    draft_record: str | None = None
    registry_timeout_s: float = 30.0  # a registry lookup that takes longer counts as failed
    draft_stale_polls: int = 3  # this many failed polls in a row: /health's detail and /metrics say `stale`
    model_name: str = ""  # the id clients send as `model`; default: derived from target/draft
    # what decodes (pipelines/serve/engines.py): "eagle3", this project's decoder (EAGLE-2 dynamic trees; the tree
    # and batching fields below), or "vllm", vLLM's engine with the draft as its EAGLE-3 speculator
    engine_name: str = "eagle3"
    num_speculative_tokens: int | None = None  # vllm: draft tokens per step (k); None: the draft's TTT depth
    device: str | None = None  # None = cuda when available, else cpu
    # "auto": one target copy spread over every GPU the replica holds (give it num_gpus > 1); None = "auto"
    # exactly when the replica sees more than one GPU.
    device_map: str | None = None
    dtype: str = "auto"  # bf16 where native (GPUs, CPUs with avx512_bf16/AMX), else fp32; float32 = bit-exact
    # ---- tree (EAGLE-2): TreeConfig -------------------------------------------------------------------------
    top_k: int = TreeConfig.top_k
    depth: int = TreeConfig.depth
    total_tokens: int = TreeConfig.total_tokens
    path_logits: bool = TreeConfig.path_logits  # lm_head on the accepted path only: pays for fp32 on CPUs
    context_chain: int = TreeConfig.context_chain  # prompt-lookup tokens grafted beside the tree (0 = off)
    # ---- batching and load fallback: EngineConfig (its docstring; engine.choose_mode, eagle_core.policy.ModeChooser) ----
    max_batch_size: int = EngineConfig.max_batch_size
    max_waiting: int = EngineConfig.max_waiting
    mode_policy: str = EngineConfig.mode_policy
    explore_every: int = EngineConfig.explore_every
    tree_max_batch: int = EngineConfig.tree_max_batch
    chain_max_batch: int = EngineConfig.chain_max_batch
    # ---- limits ----------------------------------------------------------------------------------------
    max_context: int = 2048  # prompt + completion tokens, capped by the target's max_position_embeddings
    max_tokens_limit: int = 512  # the largest max_tokens a request may ask for
    default_max_tokens: int = 16  # OpenAI's default for /v1/completions; chat uses the same
    max_body_bytes: int = 1 << 20
    # ---- faults ------------------------------------------------------------------------------------------
    request_timeout_s: float = 600.0  # a request still decoding after this gets 504 (streams: an error event)
    # /health answers 503 and Serve's health check fails (the replica is restarted) when requests are pending
    # and the engine made no progress (no round, no prefill) for this long: a hung step
    stall_timeout_s: float = 120.0
    drain_s: float = 30.0  # on shutdown, running requests may finish for this long; then they get an error event
    # ---- HTTP ------------------------------------------------------------------------------------------
    # bearer token, for a Service built in this process only: the Serve app refuses it in its args, which the Ray
    # dashboard and the RayService object show (API_KEY_IN_ARGS); None = the file or environment below, else no auth
    api_key: str | None = None
    # a file holding the bearer token (a mounted Secret): the token never travels in the app's args or in
    # runtime_env, both of which the Ray dashboard shows; EAGLE3_SERVE_API_KEY_FILE names one too
    api_key_file: str | None = None
    require_api_key: bool = False  # refuse to start a replica that found no token (set by a driver that has one)
    # serve without a token although Serve's proxy binds a non-loopback address (anyone who reaches it may use it);
    # without it such a replica refuses to start, whatever started Serve (`keyless_exposure`)
    insecure_no_auth: bool = False
    torch_threads: int = 0  # 0 = the whole CPUs Ray assigned to the replica (outside Ray: torch's default)
    # ---- acceptance as a live signal (pipelines/serve/acceptance.py; docs/serving.md) -------------------------
    acceptance: bool = True  # per-label tau / accept-length histograms, windows, drift; False = none of it
    acceptance_max_labels: int = 16  # distinct labels kept per replica ("default" included); later ones -> "other"
    acceptance_window: int = 64  # requests per label in the drift window and in each MLflow summary
    # MLflow experiment of the replica's serving run (window summaries, drift events), logged only when the draft
    # comes from the registry (there is a version to log against); "" = no MLflow
    acceptance_experiment: str = "eagle3-serving"
    drift: bool = True  # the drift rule (needs a reference tau)
    drift_margin: float = 0.3  # alert when the window's tree tau < reference tau - drift_margin
    # the reference: None = the served registry version's `tau` tag (set by the retraining's promotion decision);
    # none known (a draft folder, an untagged version) = no drift rule
    drift_reference_tau: float | None = None
    # called once per alert: "package.module:function" (called with the event dict) or a command (run without a
    # shell, the event as JSON on stdin and in $EAGLE3_DRIFT_EVENT), e.g. one that submits the retraining job
    drift_hook: str | None = None
    drift_hook_timeout_s: float = 60.0  # a hook command still running after this is killed
    drift_hook_cooldown_s: float = 3600.0  # at most one hook call per this many seconds (all labels together)
    # each label raises at most one alert per this many seconds, across served versions (0 = no limit): a client
    # flooding one label cannot raise alert after alert, nor re-raise it on the draft retrained from its traffic
    drift_alert_interval_s: float = 86400.0
    # ---- the traffic sink (pipelines/traffic.py; docs/serving.md): off unless traffic_url is set ------------------
    # served conversations (prompt + answer token ids, the template's loss mask, optionally the answer's features
    # captured while decoding) appended to feature shards at this fsspec URL; None = off (no capture, no sink)
    traffic_url: str | None = None
    traffic_sample_rate: float = 1.0  # fraction of finished requests recorded (a seeded draw per request)
    traffic_features: bool = True  # capture the features while decoding (rows train as they are; eager caches only)
    traffic_rows_per_shard: int = 64  # a shard is committed when this many rows are buffered...
    traffic_flush_after_s: float = 300.0  # ... or when the oldest buffered row has waited this long
    traffic_max_bytes: int | None = None  # size cap of the committed shards; records beyond it are dropped (counted)
    traffic_max_shards: int | None = None  # retention: the oldest shards beyond this many are removed
    traffic_max_age_s: float | None = None  # retention: shards older than this are removed
    # retention: a retired shard leaves the store this long after it left the manifests (longer than a training read)
    traffic_retention_grace_s: float = 86400.0
    traffic_max_pending: int = 1024  # records queued for the sink's writer thread; beyond it new ones are dropped
    # bytes of records not yet committed (features, ids) the sink may hold in host memory; beyond it new ones are dropped
    traffic_max_pending_bytes: int = 1 << 30
    traffic_redact: str | None = None  # "package.module:function" applied to each conversation before it is written
    traffic_close_s: float = 30.0  # on shutdown, what is buffered is written for at most this long

    def __post_init__(self):
        self.engine  # validates the tree (top_k / depth / total_tokens) and the batching fields
        if not 0 < self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError("default_max_tokens must be in 1..max_tokens_limit")
        if self.draft_poll_s < 0:
            raise ValueError("draft_poll_s must be >= 0 (0 = no polling)")
        from pipelines.serve.engines import ENGINE_NAMES

        if self.engine_name not in ENGINE_NAMES:
            raise ValueError(f"engine_name must be one of {ENGINE_NAMES}, got {self.engine_name!r}")
        if self.engine_name == "vllm" and self.traffic_url is not None:
            raise ValueError("the traffic sink needs features captured while decoding, which vLLM does not hand "
                             "out: serve with engine_name 'eagle3' to record traffic")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1 (or None: the draft's TTT depth)")
        if self.registry_timeout_s <= 0 or self.draft_stale_polls < 1:
            raise ValueError("registry_timeout_s must be > 0 and draft_stale_polls >= 1")
        if min(self.request_timeout_s, self.stall_timeout_s) <= 0 or self.drain_s < 0:
            raise ValueError("request_timeout_s and stall_timeout_s must be > 0, drain_s >= 0")
        if self.acceptance_max_labels < 1 or self.acceptance_window < 1:
            raise ValueError("acceptance_max_labels and acceptance_window must be >= 1")
        if (self.drift_margin < 0 or self.drift_hook_timeout_s <= 0 or self.drift_hook_cooldown_s < 0
                or self.drift_alert_interval_s < 0):
            raise ValueError("drift_margin, drift_hook_cooldown_s and drift_alert_interval_s must be >= 0, "
                             "drift_hook_timeout_s > 0")
        self.traffic  # validates the sink's fields (TrafficConfig), whether or not the sink is on
        if self.traffic_url is not None and not str(self.traffic_url).strip():
            raise ValueError("traffic_url must be a URL or None (off), not an empty string")
        if min(self.traffic_flush_after_s, self.traffic_close_s) <= 0:
            raise ValueError("traffic_flush_after_s and traffic_close_s must be > 0")
        for name in ("traffic_max_bytes", "traffic_max_shards", "traffic_max_age_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 or None (no limit), got {value}")
        if self.traffic_redact is not None and ":" not in self.traffic_redact:
            raise ValueError(f"traffic_redact {self.traffic_redact!r}: expected 'package.module:function'")

    @property
    def tree(self) -> TreeConfig:
        return config_from_fields(TreeConfig, self)

    @property
    def engine(self) -> EngineConfig:
        return config_from_fields(EngineConfig, self, tree=self.tree)

    @property
    def traffic(self):
        """The sink's `TrafficConfig` (its own checks run here: sample rate, rows per shard, queue size)."""
        from pipelines.traffic_config import TrafficConfig

        return TrafficConfig(url=self.traffic_url, target=self.target, sample_rate=self.traffic_sample_rate,
                             features=self.traffic_features, rows_per_shard=self.traffic_rows_per_shard,
                             flush_after_s=self.traffic_flush_after_s, max_bytes=self.traffic_max_bytes,
                             max_shards=self.traffic_max_shards, max_age_s=self.traffic_max_age_s,
                             retention_grace_s=self.traffic_retention_grace_s,
                             max_pending=self.traffic_max_pending,
                             max_pending_bytes=self.traffic_max_pending_bytes, redact=self.traffic_redact,
                             close_s=self.traffic_close_s)

    @property
    def served_name(self) -> str:
        if self.model_name:
            return self.model_name
        base = self.target.rstrip("/").split("/")[-1]
        return f"{base}-eagle3" if self.draft else base

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "ServeConfig":
        d = dict(d or {})
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:  # a typo in a YAML would otherwise silently serve something else
            raise ValueError(f"unknown ServeConfig fields: {sorted(unknown)}")
        return cls(**d)


@dataclass
class DeploymentOptions:
    """What Ray Serve needs to place and scale replicas (kept apart from what a replica does)."""

    num_replicas: int | str = 1  # or "auto" with autoscaling_config
    num_cpus: float = 1.0
    num_gpus: float | None = None  # None = 1 when the cluster has GPUs, else 0
    max_ongoing_requests: int = 64  # above the engine's capacity, so the engine's own 503 answers first
    # The router's queue (requests not yet handed to a replica); beyond it Serve answers 503 itself, with
    # a plain-text body. Deep enough that normally the engine's OpenAI-format 503 answers first.
    max_queued_requests: int = 64
    autoscaling_config: dict | None = field(default=None)
    pythonpath: str | None = None  # added to the replicas' PYTHONPATH (they don't see the driver's)


API_KEY_ENV = "EAGLE3_SERVE_API_KEY"
API_KEY_FILE_ENV = "EAGLE3_SERVE_API_KEY_FILE"
API_KEY_IN_ARGS = ("an API key in the app's arguments (api_key, --set api_key=...) is refused: they are shown by the "
                   "Ray dashboard and kept in the RayService object. Give it from a file (api_key_file=PATH, "
                   f"--set api_key_file=PATH, or ${API_KEY_FILE_ENV}; on Kubernetes a mounted Secret) or from the "
                   f"replicas' environment (${API_KEY_ENV})")


def resolve_api_key(config: ServeConfig) -> str | None:
    """The bearer token: `api_key`, else the file `api_key_file` (or $EAGLE3_SERVE_API_KEY_FILE) names, else
    $EAGLE3_SERVE_API_KEY; None = no auth. A named file that is missing or empty, or no token while
    `require_api_key`, stops the replica: serving without auth by accident is worse than not serving."""
    if config.api_key:
        return config.api_key
    path = config.api_key_file or os.environ.get(API_KEY_FILE_ENV)
    if path:
        try:
            key = Path(path).read_text().strip()
        except OSError as err:
            raise RuntimeError(f"cannot read the serve API key file {path}: {err}") from err
        if not key:
            raise RuntimeError(f"the serve API key file {path} is empty")
        return key
    key = os.environ.get(API_KEY_ENV) or None
    if key is None and config.require_api_key:
        raise RuntimeError("this deployment requires an API key, but the replica found none: mount it as a file "
                           f"and set api_key_file (or {API_KEY_FILE_ENV})")
    return key


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def keyless_exposure(host: str, port: int | str, has_key: bool, insecure: bool) -> str | None:
    """Why serving without a key on Serve's proxy at host:port must be refused, or None when it may go on: a
    loopback bind, a key, or an explicit `insecure_no_auth`. `host` must be where the proxy really binds (a running
    Serve instance keeps the http options it started with, whatever a later `serve.start` asks for)."""
    if has_key or insecure or is_loopback(host):
        return None
    return (f"refusing to serve on {host}:{port} without an API key (that is the address this cluster's Serve proxy "
            f"binds; a running Serve instance keeps the address it started with): give a key from a file or the "
            f"environment ({API_KEY_FILE_ENV}, api_key_file=PATH, {API_KEY_ENV}), restart Serve on 127.0.0.1, or "
            "accept serving without auth explicitly (--insecure-no-auth, insecure_no_auth: true)")
