"""Every input and output of every stage is a URL: a local path, `file://`, `s3://`, `gs://`, any fsspec filesystem.

- `join` builds URLs; `url_to_fs` resolves one to (filesystem, path).
- `commit_bytes` (and `commit_json`) is how every JSON, manifest and shard is written, so that no reader sees
  half of one: on a local filesystem it writes a temporary file, fsyncs it and renames it (a failed write removes
  the temporary file); an object store has no rename (s3fs's `mv` is copy + delete), but a single PUT is atomic
  (the object appears whole or not at all), so it is one `pipe`. `commit_stream` does the same for a file
  written chunk by chunk (never whole in memory): locally the same temporary file and rename, on an object
  store a multipart upload that only a completed close makes visible (a failure aborts it).
- `upload_folder` copies a local folder to a URL: to a temporary sibling first, swapped in after; a failure at any
  step leaves the old folder (`replace_folder`: a local folder swapped in one atomic exchange).
- `arrow_filesystem` hands Ray Data and Ray Train the same filesystem fsspec resolved, endpoint and credentials
  included (pyarrow's own S3 resolution ignores `AWS_ENDPOINT_URL`, s3fs honours it): what the pipeline writes
  through fsspec, Ray reads from the same place.
Node-local disk is only ever a cache: remote model folders are fetched once per node by `eagle_core`'s loaders
(`eagle_core.target.local_folder`); `resolve_source` also accepts MLflow registry URIs (`models:/name@alias`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
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
    """Write a whole file; a reader (or a rerun) never sees half of it, whatever happens meanwhile.

    Local: the bytes go to a temporary file beside the destination (`<name>.tmp-<random>`, which no reader of
    the destination's name lists), are fsynced, then renamed over the destination (atomic on POSIX) and the
    folder is fsynced, so a crash or power loss leaves the old file or the new one. Any failure (a full disk, an
    interrupt) removes the temporary file and leaves the destination as it was. Object store: one PUT, which
    appears whole or not at all."""
    fs, path = url_to_fs(url)
    if is_remote(url):
        fs.pipe_file(path, data)  # one PUT: atomic on object stores
        return
    _commit_local(local_path(url), [data])


def commit_stream(url: str, chunks) -> int:
    """Write a whole file from an iterable of byte chunks, holding one chunk at a time; returns the bytes
    written. As with `commit_bytes`, no reader sees part of it: locally the chunks go to a fsynced temporary
    file renamed over the destination (removed on any failure); on an object store they go to one streamed
    upload (multipart on S3), which only its completion on close makes visible, and a failure discards it."""
    if not is_remote(url):
        return _commit_local(local_path(url), chunks)
    fs, path = url_to_fs(url)
    f = fs.open(path, "wb")
    written = 0
    try:
        for chunk in chunks:
            written += f.write(chunk) or len(chunk)
    except BaseException:  # no partial object: an unfinished upload is aborted, never completed
        discard = getattr(f, "discard", None)
        if discard is not None:
            discard()
        # Marked closed, or the file's finaliser would close it, i.e. complete the upload of what it holds.
        with contextlib.suppress(AttributeError):
            f.closed = True
        raise
    f.close()
    return written


def _commit_local(path: str, chunks) -> int:
    """The local half of `commit_bytes` / `commit_stream`: temporary file, fsync, rename, folder fsync."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    written = 0
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                written += f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, an interrupt: no temporary file stays behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_folder(folder)
    return written


def commit_json(url: str, data, **dump_args) -> None:
    """`data` as JSON (indent 1 unless told), written whole by `commit_bytes`."""
    commit_bytes(url, json.dumps(data, **{"indent": 1, **dump_args}).encode())


def _fsync_folder(folder: str) -> None:
    """Make a rename in `folder` durable (where the platform lets a folder be opened for it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def exists(url: str) -> bool:
    fs, path = url_to_fs(url)
    return fs.exists(path)


def read_bytes(url: str) -> bytes:
    with fsspec.open(url, "rb") as f:
        return f.read()


def _exchange(a: str, b: str) -> bool:
    """Swap two existing local paths in one step (Linux renameat2 RENAME_EXCHANGE): every reader of either path sees
    one whole folder or the other, never neither. False where the system or filesystem cannot (nothing changed)."""
    import ctypes
    import errno as errnos

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errnos.EINVAL, errnos.ENOSYS, errnos.ENOTSUP):
        return False
    raise OSError(err, f"swapping {a} and {b}: {os.strerror(err)}")


def replace_folder(staging: str | Path, dest: str | Path) -> None:
    """Put the complete local folder `staging` at `dest`, replacing what is there; `staging` is gone after. A reader
    sees the old folder or the new one, whole: one atomic exchange where the filesystem has it; elsewhere two renames,
    and a failure of the second puts the old folder back. A failure at any step leaves `dest` the old folder."""
    staging, dest = str(staging), str(dest)
    if not os.path.exists(dest):
        os.rename(staging, dest)
        return
    if _exchange(staging, dest):  # the old folder is at `staging` now
        shutil.rmtree(staging, ignore_errors=True)
        return
    old = f"{dest}.old-{uuid.uuid4().hex[:8]}"
    os.rename(dest, old)
    try:
        os.rename(staging, dest)
    except BaseException:
        os.rename(old, dest)  # the old folder back where readers look
        raise
    shutil.rmtree(old, ignore_errors=True)


def upload_folder(folder: Path, url: str) -> None:
    """Copy a local folder to `url`, replacing what is there, without ever deleting the old copy before the new
    one is complete: every file is uploaded to a temporary sibling `<url>.tmp-<random>` first (a failure there
    removes it and leaves `url` as it was), then swapped in. A local destination is swapped by `replace_folder`
    (one atomic exchange). An object store has no rename: the old keys are first copied server-side to
    `<url>.old-<random>`, then each new file is copied over its old key (one atomic PUT each) and the keys the new
    folder lacks are removed; a failure there puts the old keys back, so a failure at any step leaves the old folder
    whole. (A reader listing the folder *during* that swap may still see a mix: object stores have no atomic
    folder swap.)"""
    fs, root = url_to_fs(url)
    root = root.rstrip("/")
    staging = f"{root}.tmp-{uuid.uuid4().hex[:8]}"
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
    backup = None
    try:
        for path in files:
            dest = f"{staging}/{path.relative_to(folder).as_posix()}"
            fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
            fs.put_file(str(path), dest)
        if not is_remote(url):
            replace_folder(staging, root)
            return
        names = {path.relative_to(folder).as_posix() for path in files}
        old = [p[len(root) + 1:] for p in (fs.find(root) if fs.exists(root) else [])]
        backup = f"{root}.old-{uuid.uuid4().hex[:8]}"
        for name in old:
            fs.copy(f"{root}/{name}", f"{backup}/{name}")
        try:
            for name in sorted(names):
                fs.copy(f"{staging}/{name}", f"{root}/{name}")
            stale = [f"{root}/{name}" for name in old if name not in names]
            if stale:
                fs.rm(stale)
        except BaseException:
            for name in sorted(names - set(old)):
                with contextlib.suppress(FileNotFoundError):
                    fs.rm(f"{root}/{name}")
            for name in old:
                fs.copy(f"{backup}/{name}", f"{root}/{name}")
            raise
    finally:
        for leftover in (staging, backup):
            if leftover is not None and fs.exists(leftover):
                fs.rm(leftover, recursive=True)


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
