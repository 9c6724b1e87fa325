"""Every input and output of every stage is a URL: a local path, `file://`, `s3://`, `gs://`, any fsspec filesystem.

- `join` builds URLs; `url_to_fs` resolves one to (filesystem, path).
- `commit_bytes` writes a file so that no reader sees half of it: on a local filesystem it writes a temporary
  file and renames it; an object store has no rename (s3fs's `mv` is copy + delete), but a single PUT is atomic
  (the object appears whole or not at all), so it is one `pipe`.
- `upload_folder` copies a local folder to a URL file by file (no folder rename).
- `arrow_filesystem` hands Ray Data and Ray Train the same filesystem fsspec resolved, endpoint and credentials
  included (pyarrow's own S3 resolution ignores `AWS_ENDPOINT_URL`, s3fs honours it): what the pipeline writes
  through fsspec, Ray reads from the same place.
Node-local disk is only ever a cache: remote model folders are fetched once per node by `eagle_core`'s loaders
(`eagle_core.target.local_folder`); `resolve_source` also accepts MLflow registry URIs (`models:/name@alias`).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import fsspec

from eagle_core.target import is_remote

# Object-store listings are never trusted across calls: other processes (actors on other nodes, training
# workers) write the folders this process lists and reads, so a listing cached by s3fs (or metadata cached by
# gcsfs) would hide their files. Defaults only: a user's own fsspec configuration wins.
fsspec.config.conf.setdefault("s3", {}).setdefault("use_listings_cache", False)
fsspec.config.conf.setdefault("gcs", {}).setdefault("cache_timeout", 0)


def url_to_fs(url: str):
    return fsspec.core.url_to_fs(url)


def join(url: str, *parts: str) -> str:
    return "/".join([str(url).rstrip("/"), *parts])


def local_path(url: str) -> str | None:
    """The local path of a local or file:// URL; None for any other fsspec URL (an object store, memory://)."""
    return None if is_remote(url) else str(url).removeprefix("file://")


def commit_bytes(url: str, data: bytes) -> None:
    """Write a whole file; a reader (or a rerun) never sees half of it."""
    fs, path = url_to_fs(url)
    if is_remote(url):
        fs.pipe_file(path, data)  # one PUT: atomic on object stores
        return
    fs.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    fs.mv(tmp, path)


def exists(url: str) -> bool:
    fs, path = url_to_fs(url)
    return fs.exists(path)


def read_bytes(url: str) -> bytes:
    with fsspec.open(url, "rb") as f:
        return f.read()


def upload_folder(folder: Path, url: str) -> None:
    """Copy a local folder to `url` (replacing what is there), file by file: no reliance on a folder rename."""
    fs, root = url_to_fs(url)
    if fs.exists(root):
        fs.rm(root, recursive=True)
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file():
            dest = f"{root}/{path.relative_to(folder).as_posix()}"
            fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
            fs.put_file(str(path), dest)


def arrow_filesystem(url: str):
    """(pyarrow filesystem, path) for Ray Data's readers and Ray Train's `storage_filesystem`; (None, local path)
    for a local URL, where Ray's own resolution is right."""
    local = local_path(url)
    if local is not None:
        return None, str(Path(local).resolve())
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    fs, path = url_to_fs(url)
    return PyFileSystem(FSSpecHandler(fs)), path


REGISTRY_PREFIX = "models:/"


def is_registry_uri(source: str) -> bool:
    return str(source).startswith(REGISTRY_PREFIX)


def resolve_source(source: str) -> str:
    """`models:/<name>@<alias>` (or `/<version>`) -> a local folder downloaded through the tracking server (on
    whichever node asks) into the node's cache, once per registered version (versions are immutable; an alias is
    looked up on every call); anything else (a path, a URL, a target name, a hub id) is returned unchanged."""
    if not is_registry_uri(source):
        return str(source)
    import hashlib

    from eagle_core.target import cache_dir, cached_folder
    from pipelines import tracking

    mlflow = tracking.configure()
    name, version = registry_version(source)
    registry = hashlib.sha256(mlflow.get_tracking_uri().encode()).hexdigest()[:8]
    out = cache_dir() / "registry" / f"{name.replace('/', '_')}-v{version}-{registry}"
    cached_folder(out, lambda tmp: mlflow.artifacts.download_artifacts(
        artifact_uri=f"{REGISTRY_PREFIX}{name}/{version}", dst_path=str(tmp)))
    return str(_model_folder(out))


def pin_registry_uri(source: str | None) -> str | None:
    """`models:/<name>@<alias>` -> `models:/<name>/<version>` of the version the alias names now; anything else
    unchanged. A training driver resolves its warm start's alias once and hands the pinned URI to every worker:
    an alias moved meanwhile (a promotion) then cannot give the driver and a worker different versions."""
    if not source or not is_registry_uri(source):
        return source
    from pipelines import tracking

    tracking.configure()
    name, version = registry_version(source)
    return f"{REGISTRY_PREFIX}{name}/{version}"


def registry_version(source: str) -> tuple[str, str]:
    """`models:/<name>@<alias>` or `models:/<name>/<version>` -> (name, version number)."""
    from mlflow import MlflowClient

    ref = source[len(REGISTRY_PREFIX):]
    if "@" in ref:
        name, alias = ref.split("@", 1)
        return name, str(MlflowClient().get_model_version_by_alias(name, alias).version)
    name, _, version = ref.rpartition("/")
    if not name or not version.isdigit():
        raise ValueError(f"{source}: expected models:/<name>@<alias> or models:/<name>/<version>")
    return name, version


def _model_folder(root: Path) -> Path:
    """The folder under a downloaded artifact tree that holds `config.json` (shallowest first)."""
    if (root / "config.json").is_file():
        return root
    found = sorted(root.rglob("config.json"), key=lambda p: len(p.parts))
    if not found:
        raise FileNotFoundError(f"no config.json under the registry artifacts in {root}")
    return found[0].parent
