"""MLflow helpers: one place that decides where runs go.

Default store: SQLite inside the project's work folder (`$EAGLE3_WORK`, default `./work`), artifacts
beside it; any `MLFLOW_TRACKING_URI` (an `mlflow server`) is honoured instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)


def work_dir() -> Path:
    """The project's work folder (not created here: only a run that uses the default store writes to it)."""
    return Path(os.environ.get("EAGLE3_WORK", "work")).resolve()


def default_tracking_uri() -> str:
    return f"sqlite:///{work_dir() / 'mlflow.db'}"


def tracking_uri() -> str:
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    work_dir().mkdir(parents=True, exist_ok=True)  # SQLite creates the file, not its folder
    return default_tracking_uri()


def uses_default_store() -> bool:
    """True when runs go to our local SQLite store (`mlflow.set_tracking_uri` exports the variable itself,
    so its mere presence does not mean the user chose a server)."""
    return os.environ.get("MLFLOW_TRACKING_URI") in (None, "", default_tracking_uri())


def is_node_local(uri: str) -> bool:
    """A store only this node can open: a SQLite file or a folder (not an `mlflow server`, not Databricks)."""
    return uri.split(":", 1)[0] in ("sqlite", "file") or "://" not in uri and ":" not in uri


def require_shared_store(nodes: int) -> None:
    """Refuse to start a multi-node run whose workers would log to a store on the driver's disk."""
    if nodes > 1 and is_node_local(tracking_uri()):
        raise RuntimeError(
            f"the MLflow store {tracking_uri()} is on this node's disk, but the Ray cluster has {nodes} nodes: "
            "workers on other nodes cannot log to it. Start a tracking server every node reaches (e.g. "
            "`mlflow server --backend-store-uri postgresql://... --artifacts-destination s3://bucket/mlflow`) and "
            "set MLFLOW_TRACKING_URI to it, or turn tracking off (--mlflow-experiment '')")


def configure():
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    return mlflow


def ensure_experiment(name: str) -> str:
    mlflow = configure()
    experiment = mlflow.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    artifact_location = None
    if uses_default_store():  # else the server decides (e.g. its S3 artifact root)
        artifact_location = (work_dir() / "mlartifacts" / name).as_uri()
    try:
        return mlflow.create_experiment(name, artifact_location=artifact_location)
    except Exception:  # created concurrently by another process
        return mlflow.get_experiment_by_name(name).experiment_id


@contextlib.contextmanager
def start_run(experiment: str, run_name: str | None = None, run_id: str | None = None, nested: bool = False,
              tags: dict | None = None):
    """`mlflow.start_run` in our experiment; resumes `run_id` when given."""
    mlflow = configure()
    experiment_id = ensure_experiment(experiment)
    with mlflow.start_run(run_id=run_id, experiment_id=None if run_id else experiment_id, run_name=run_name,
                          nested=nested, tags=tags) as run:
        yield run


DRAFT_DIGEST_TAG = "eagle3.draft_sha256"  # a registered version's draft folder, by content (`folder_digest`)


def folder_digest(folder) -> str:
    """SHA-256 over a folder's files (relative names and contents): a draft folder's identity in the registry."""
    import hashlib

    root = Path(folder)
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(8 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


def registered_version(name: str, run_id: str, digest: str):
    """The lowest version of `name` that run `run_id` registered with draft digest `digest`, or None (also when
    `name` is not registered yet)."""
    client = configure().tracking.MlflowClient()
    found = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}' and "
                                         f"tags.`{DRAFT_DIGEST_TAG}` = '{digest}'")
    return min(found, key=lambda v: int(v.version)) if found else None


def register_artifact(run_id: str, artifact_path: str, name: str, alias: str | None = None,
                      digest: str | None = None) -> int:
    """Register a run's artifact folder as a new version of model `name`; point `alias` at it. Returns the version.

    With `digest` (`folder_digest` of the folder logged there) registration is idempotent: a version this run
    already registered with that digest (a retry after the server answered the first attempt's create too late,
    or failed after it) is returned instead of registering the draft twice; the digest is a tag that the create
    itself sets, so no version exists without it."""
    if alias == "champion":  # it moves only by compare-and-set under the promotion lock
        raise ValueError("register_artifact does not set `champion`: use pipelines.registry (set_champion, "
                         "decide_promotion)")
    mlflow = configure()
    client = mlflow.tracking.MlflowClient()
    try:
        client.create_registered_model(name)
    except mlflow.exceptions.MlflowException:
        pass  # it exists already (or was created concurrently)
    existing = registered_version(name, run_id, digest) if digest else None
    if existing is not None:
        version = existing
    else:
        source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{artifact_path}"
        version = client.create_model_version(name, source=source, run_id=run_id,
                                              tags={DRAFT_DIGEST_TAG: digest} if digest else None)
    if alias:
        client.set_registered_model_alias(name, alias, version.version)
    return int(version.version)


def is_outage(err: BaseException) -> bool:
    """An error that says the tracking server did not answer (refused, timed out, 5xx), not that the request
    was wrong: worth retrying."""
    import requests
    from mlflow.exceptions import MlflowException

    if isinstance(err, (OSError, requests.exceptions.RequestException)):
        return True
    if isinstance(err, MlflowException):
        code = getattr(err, "error_code", None)
        return code in ("TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED") or (
            code == "INTERNAL_ERROR" and "API request to" in str(err))
    return False


def retrying(fn, what: str, timeout_s: float = 900.0, max_backoff_s: float = 60.0):
    """`fn()`, retried through a tracking-server outage (`is_outage`) for up to `timeout_s`, with a growing
    pause; other errors, and the last outage error past the deadline, are raised."""
    deadline, backoff = time.monotonic() + timeout_s, 1.0
    while True:
        try:
            return fn()
        except Exception as err:
            if not is_outage(err) or time.monotonic() + backoff > deadline:
                raise
            log.warning("MLflow at %s unreachable while %s (%s); retrying in %.0f s", tracking_uri(), what,
                        str(err)[:200], backoff)
            print(f"[mlflow] unreachable while {what}; retrying in {backoff:.0f} s", flush=True)
            time.sleep(backoff)
            backoff = min(2 * backoff, max_backoff_s)
