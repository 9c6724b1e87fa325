"""The draft a replica serves when it follows the registry (`draft = models:/<name>@<alias>`), and what it does
when the registry does not answer.

A replica must not need MLflow to start: restarts and autoscaling happen exactly when things go wrong. So every
replica that resolves a registry draft records it — a copy of the draft folder per version and a pointer
`last.json` written last — at `draft_record` (a folder or fsspec URL the serving identity can read and write; by
default this node's cache). A replica whose registry lookup fails or takes longer than `registry_timeout_s` starts
from that record and catches up at its next successful poll. Loading a recorded draft is the same validated
safetensors load as any draft (`load_draft_for`): no pickle is read.

`DraftFollower` also keeps the lookups' health: when the registry last confirmed the served version, how many
polls in a row failed (and the last error), which `/health`'s detail and `/metrics` report.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time

from pipelines.serve.models import NO_DRAFT, pin_draft

log = logging.getLogger(__name__)

POINTER = "last.json"
KEEP_VERSIONS = 3  # recorded draft copies kept besides the one the pointer names


class RegistryTimeout(TimeoutError):
    pass


def default_record(source: str) -> str:
    """This node's cache, keyed by the draft source and the tracking server (two registries never share one)."""
    from eagle_core.target import cache_dir
    from pipelines import tracking

    key = hashlib.sha256(f"{tracking.tracking_uri()}\0{source}".encode()).hexdigest()[:16]
    return str(cache_dir() / "serve" / "drafts" / key)


def bounded(fn, timeout_s: float):
    """fn() in a daemon thread, waited for at most timeout_s (MLflow's client retries a refused connection for
    minutes; the thread is left to finish on its own and never holds the process at exit)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 -- handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="eagle3-registry-lookup", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RegistryTimeout(f"the registry did not answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


class DraftFollower:
    """Resolves `source` to (what to load, version label), records what was resolved, and counts the lookups."""

    def __init__(self, source: str | None, record: str | None = None, timeout_s: float = 30.0,
                 stale_polls: int = 3):
        from pipelines.storage import is_registry_uri

        self.source = source
        self.registry = bool(source) and is_registry_uri(source)
        self.record = (record or default_record(source)) if self.registry else None
        self.timeout_s, self.stale_polls = timeout_s, stale_polls
        self.lock = threading.Lock()
        self.version: str | None = None
        self.confirmed_at: float | None = None  # wall time the registry last named the served version
        self.failed_polls = 0
        self.last_error: str | None = None
        self.from_record = False  # the replica started from the record (the registry did not answer)

    # ---- lookups ---------------------------------------------------------------------------------------------
    def lookup(self) -> tuple[str | None, str | None]:
        """(what to load, version) from the registry now; a failure or a timeout is counted and raised."""
        if not self.registry:
            return pin_draft(self.source)
        try:
            pinned, version = bounded(lambda: pin_draft(self.source), self.timeout_s)
        except Exception as exc:
            self.failed(exc)
            raise
        with self.lock:
            self.confirmed_at, self.failed_polls, self.last_error = time.time(), 0, None
        return pinned, version

    def failed(self, exc: BaseException) -> None:
        with self.lock:
            self.failed_polls += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:300]

    def resolve_at_start(self) -> tuple[str | None, str | None]:
        """The registry's answer, or, when it fails, the last recorded draft (its folder and version). Raises when
        neither exists, naming both."""
        try:
            return self.lookup()
        except Exception as exc:
            if not self.registry:
                raise
            pointer = self.read_pointer()
            if pointer is None:
                raise RuntimeError(
                    f"cannot start serving {self.source}: the registry failed ({exc}) and no draft was recorded at "
                    f"{self.record} by an earlier replica. Start it once while the tracking server answers, or "
                    "point draft_record at a store an earlier replica wrote") from exc
            log.warning("the registry failed (%s); starting from the last recorded draft, version %s (resolved "
                        "%.0f s ago); following %s again at the next successful poll", exc, pointer["version"],
                        time.time() - pointer["resolved_at"], self.source)
            with self.lock:
                self.confirmed_at, self.from_record = pointer["resolved_at"], True
            return pointer["folder"], pointer["version"]

    def serving(self, version: str | None) -> None:
        with self.lock:
            self.version = version

    # ---- the record ------------------------------------------------------------------------------------------
    def read_pointer(self) -> dict | None:
        import json

        from pipelines import storage

        url = storage.join(self.record, POINTER)
        try:
            if not storage.exists(url):
                return None
            pointer = json.loads(storage.read_bytes(url))
        except Exception as exc:  # noqa: BLE001 -- an unreadable record is no record
            log.warning("cannot read the draft record %s: %s", url, exc)
            return None
        if pointer.get("source") != self.source:
            log.warning("the draft record %s is for %s, not %s: not used", url, pointer.get("source"), self.source)
            return None
        pointer["folder"] = storage.join(self.record, f"v{pointer['version']}")
        return pointer

    def remember(self, pinned: str, version: str) -> None:
        """Record the draft just loaded from the registry (a copy of its folder, then the pointer), unless the
        record already names it (the pointer's time then stays that of its first recording). Best effort: a failure is logged, the replica serves on."""
        if not self.registry or self.from_record_of(version):
            return
        from pathlib import Path

        from pipelines import storage

        try:
            folder = Path(storage.resolve_source(pinned))  # the node's cached download: no new transfer
            storage.upload_folder(folder, storage.join(self.record, f"v{version}"))
            storage.commit_json(storage.join(self.record, POINTER),
                                {"source": self.source, "pinned": pinned, "version": version,
                                 "resolved_at": self.confirmed_at or time.time()})
            self._prune()
        except Exception as exc:  # noqa: BLE001 -- the record is a fallback, not a condition to serve
            log.warning("cannot record draft version %s at %s: %s", version, self.record, exc)

    def from_record_of(self, version: str) -> bool:
        pointer = self.read_pointer()
        return pointer is not None and pointer["version"] == version

    def _prune(self) -> None:
        """Remove recorded copies beyond the KEEP_VERSIONS newest, never the one the pointer names now."""
        from pipelines import storage

        fs, root = storage.url_to_fs(self.record)
        named = (self.read_pointer() or {}).get("version")
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
        versions = sorted((int(n[1:]) for n in names if n.startswith("v") and n[1:].isdigit()), reverse=True)
        for old in versions[KEEP_VERSIONS:]:
            if str(old) != named:
                fs.rm(f"{root.rstrip('/')}/v{old}", recursive=True)

    # ---- health ----------------------------------------------------------------------------------------------
    def status(self) -> dict:
        """/health's detail: the served version, the seconds since the registry confirmed it, the failed polls in
        a row, and `stale` once they reach stale_polls (the replica serves on, on its last draft)."""
        with self.lock:
            body = {"version": self.version or NO_DRAFT, "follows": self.source if self.registry else None}
            if self.registry:
                age = None if self.confirmed_at is None else round(time.time() - self.confirmed_at, 1)
                body.update(confirmed_s_ago=age, failed_polls=self.failed_polls,
                            stale=self.failed_polls >= self.stale_polls, started_from_record=self.from_record)
                if self.last_error:
                    body["last_error"] = self.last_error
            return body

    def version_number(self) -> float:
        """The served version as a number for /metrics: the registry version, 0 for none, -1 for a folder/URL."""
        v = self.version
        return float(v) if v and v.isdigit() else 0.0 if v in (None, NO_DRAFT) else -1.0
