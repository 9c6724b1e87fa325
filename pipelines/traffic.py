"""The traffic sink: served conversations appended to feature shards that training reads with no extraction pass.

Off unless a deployment builds one. A served conversation is the prompt's ids and the target's answer as ids
(one sequence), the chat template's assistant-only loss mask over it (`eagle_core.chat.served_loss_mask`) and,
optionally, the features decoding captured for it (`eagle_core.decoding.DecodingState.prefill(capture=True)` /
`take_features`): the same aux layers and dtype an extraction computes, positions in order. The server is
lossless, so the answer is the target's own, the regenerated reply an extraction would pay a generation for.

Where it writes (any fsspec URL), in the extraction's layout (`pipelines.feature_files`):
    fingerprint.json                          what made the shards (the extraction's fields: target weights and
                                              tokenizer hashes, max_length, dtype, aux layers, regeneration, corpus)
    features/shard-<ms>-<writer>-<hash>.parquet   FEATURE_SCHEMA rows, the summary in the Parquet metadata
    manifest.json                             a `FeatureManifest` of every committed shard (rebuilt after each)
so `jobs/train.py --features URL` trains on it as on an extraction's output. Shard names start with their
creation time (milliseconds, fixed width): the oldest sort first, which retention removes first.

Guarantees:
- `record` never raises and never waits: a sampling draw, an asynchronous copy of device features into pinned host
  memory (the device's memory is free once the copy lands; the writer waits for it, the caller does not) and a
  bounded queue's put. What is not committed yet (queued, buffered, being written) is bounded in bytes as well as
  in records (`max_pending_bytes`, `max_pending`): a record past either bound is dropped and counted, so a stalled
  store holds at most `max_pending_bytes` of this process's memory, and no device memory. Everything else (the
  redaction hook, the mask, Parquet, the store) runs on one background thread, which flushes a shard when it holds
  `rows_per_shard` rows or half of `max_pending_bytes`, when its oldest row waited `flush_after_s`, and on
  `flush()` / `close()`.
- A store failure (full disk, unreachable store, a fingerprint mismatch) drops that shard's rows and counts them
  (`stats()["dropped"]`); nothing is retried, nothing reaches the caller.
- Every file is written whole or not at all (`pipelines.storage.commit_bytes`: a temporary name then a rename;
  one PUT on object stores), so a writer killed mid-write leaves no shard a reader lists (a `.tmp-` file at most).
- A size cap (`max_bytes`, the committed shards' bytes): records beyond it are dropped and counted. Retention
  (`max_shards`, `max_age_s`): after each commit the oldest shards beyond the limits are retired (a tombstone every
  replica reads: they leave every manifest), and leave the store `retention_grace_s` later, when no manifest lists
  them (a training run that read a manifest before has that long to read its shards). Several replicas may share
  one URL (each its own writer id). The folder's shards, retention and manifest: `pipelines.traffic_retention`.
"""

from __future__ import annotations

import atexit
import io
import json
import logging
import queue
import random
import threading
import time
import uuid
from collections import Counter
from typing import Callable

import pyarrow.parquet as pq
import torch

from pipelines.feature_files import DTYPE_NAMES, SHARD_META_KEY, FingerprintMismatch, check_fingerprint, feature_table
from pipelines.hooks import import_callable
from pipelines.storage import commit_bytes, exists, join, read_bytes
from pipelines.traffic_config import ServedConversation, TrafficConfig, traffic_fingerprint
from pipelines.traffic_retention import TrafficShards

_STOP = object()  # queued by close(): the writer thread ends now instead of at its next poll
log = logging.getLogger(__name__)


def _nbytes(features) -> int:
    """Bytes of a record's features (0 without)."""
    if features is None:
        return 0
    return sum(int(x.numel()) * x.element_size() for x in features)


def _to_host(features):
    """(features on the host, the CUDA event their copy completes at, or None). Device features are copied into
    pinned host memory without waiting (the caller is the decoding thread); the writer waits for the event."""
    if features is None or not any(x.is_cuda for x in features):
        return features, None
    host = [torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x.detach(), non_blocking=True)
            for x in features]
    event = torch.cuda.Event()
    event.record()
    return type(features)(*host), event


def resolve_hook(spec: str | Callable | None) -> Callable | None:
    """A callable, or "module:function" imported here (so a bad path fails when the sink is built)."""
    if spec is None or callable(spec):
        return spec
    return import_callable(spec, "redaction hook")


class TrafficSink:
    """Appends served conversations to feature shards at `config.url` (module docstring: layout and guarantees).

    tokenizer: for the chat template's loss mask over earlier assistant turns (None: 1 on the answer only).
    dtype: the target's compute dtype (the features' and the manifest's). redact: a callable (or
    `config.redact`) applied to each `ServedConversation` before it is written; it returns the conversation (or
    another) or None to drop it. A hook that changes the token ids drops the features (they belong to the old
    ids): with `config.features` the conversation is then dropped. fingerprint / target_config: computed from
    `config.target` when not given. start: run the writer thread (tests drive `_drain` themselves with False).
    """

    def __init__(self, config: TrafficConfig, *, tokenizer=None, dtype: torch.dtype = torch.float32,
                 redact: Callable | None = None, target_config=None, fingerprint: dict | None = None,
                 start: bool = True):
        self.config, self.tokenizer, self.dtype = config, tokenizer, dtype
        self.enabled = config.url is not None
        self.redact = resolve_hook(redact if redact is not None else config.redact)
        self._rng = random.Random(config.seed)
        self._lock = threading.Lock()  # guards the counters, read by stats() from any thread
        self._counts = Counter()
        self._dropped = Counter()
        self._pending_bytes = 0  # bytes of records held and not committed (under _lock)
        self.last_error: str | None = None
        if not self.enabled:
            return
        if target_config is None or fingerprint is None:
            from transformers import AutoConfig

            from eagle_core.target import materialize_hf_folder

            folder = materialize_hf_folder(config.target)
            target_config = target_config or AutoConfig.from_pretrained(folder)
            fingerprint = fingerprint or traffic_fingerprint(config, folder, target_config, dtype)
        self.target_config, self.fingerprint = target_config, fingerprint
        self.hidden = target_config.hidden_size
        # the folder's committed shards (any writer's), retention and manifest (writer thread; record reads its bytes)
        self.shards = TrafficShards(config, fingerprint, target_config, dtype, self._count)
        self.writer = uuid.uuid4().hex[:8]  # this sink's shards, beside other replicas' in the same folder
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_pending)
        self._buffer_held = 0  # bytes of the records in the buffer and the shard being written (writer thread)
        self._buffer: list = []  # FeatureRow of the shard being filled (writer thread only)
        self._row_meta: dict[str, dict] = {}  # buffered row id -> its conversation's meta (e.g. the category)
        self._buffer_bytes = 0
        self._oldest: float | None = None
        self._prepared = False
        self._stop = threading.Event()
        self._thread = None
        if start:
            self._thread = threading.Thread(target=self._run, name="traffic-sink", daemon=True)
            self._thread.start()
            # A process that exits writes what is buffered first: a Ray worker (a Serve replica) turns SIGTERM
            # into SystemExit, and an exit runs atexit hooks before daemon threads stop (for up to config.close_s).
            self._at_exit = _close_at_exit(self)
            atexit.register(self._at_exit)

    # ---- the caller's side: O(1), never raises, never waits ------------------------------------------------

    def record(self, prompt_ids, answer_ids, features=None, messages=None, tools=None, request_id=None,
               meta=None) -> bool:
        """Offer one served conversation; True when it was queued for writing. Never raises, never blocks."""
        if not self.enabled:
            return False
        try:
            self._count("offered")
            if self._rng.random() >= self.config.sample_rate:
                self._count("sampled_out")
                return False
            if self.config.max_bytes is not None and self.shards.committed_bytes is not None \
                    and self.shards.committed_bytes >= self.config.max_bytes:
                self._drop("size_cap")
                return False
            nbytes = 8 * (len(prompt_ids) + len(answer_ids)) + _nbytes(features)
            if not self._hold(nbytes):
                self._drop("pending_bytes")
                return False
            try:
                features, copied = _to_host(features)
                item = ServedConversation(id=request_id or uuid.uuid4().hex, prompt_ids=list(prompt_ids),
                                          answer_ids=list(answer_ids), messages=messages, tools=tools,
                                          features=features, meta=dict(meta or {}))
                self._queue.put_nowait((item, nbytes, copied))
            except BaseException:
                self._release(nbytes)
                raise
            return True
        except queue.Full:
            self._drop("queue_full")
        except Exception as err:  # noqa: BLE001 -- nothing reaches the caller
            self._drop("record_error", err)
        return False

    def _hold(self, nbytes: int) -> bool:
        with self._lock:
            if self._pending_bytes + nbytes > self.config.max_pending_bytes:
                return False
            self._pending_bytes += nbytes
            return True

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._pending_bytes -= nbytes

    def stats(self) -> dict:
        """Counters: offered, sampled_out, queued rows written (`rows`), `shards`, `bytes` committed, and
        `dropped` by reason (queue_full, size_cap, redacted, redaction_error, no_features, bad_features,
        no_loss_tokens, store_error, fingerprint_mismatch, ...)."""
        with self._lock:
            return {**self._counts, "dropped": dict(self._dropped), "last_error": self.last_error,
                    "pending_bytes": self._pending_bytes}

    def flush(self, timeout: float = 60.0) -> None:
        """Write what is queued and buffered now (a partial shard too); waits up to `timeout` seconds."""
        if not self.enabled:
            return
        if self._thread is None:
            self._drain(force=True)
            return
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return
        done.wait(timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Flush, then stop the writer thread."""
        if not self.enabled:
            return
        if getattr(self, "_at_exit", None) is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
        self.flush(timeout)
        self._stop.set()
        if self._thread is not None:
            try:
                self._queue.put_nowait(_STOP)
            except queue.Full:  # the thread sees the stop flag at its next poll (within a second)
                pass
            self._thread.join(timeout)

    # ---- the writer thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            wait = self.config.flush_after_s if self._oldest is None else max(
                0.0, self._oldest + self.config.flush_after_s - time.monotonic())
            try:
                item = self._queue.get(timeout=min(max(wait, 0.01), 1.0))
            except queue.Empty:
                item = None
            if item is _STOP:
                break
            if isinstance(item, threading.Event):  # flush(): a partial shard too
                self._drain(force=True)
                item.set()
                continue
            if item is not None:
                self._add(*item)
            if self._buffer and (self._full() or time.monotonic() - self._oldest >= self.config.flush_after_s):
                self._flush_buffer()

    def _full(self) -> bool:
        """The buffer makes a shard: `rows_per_shard` rows, or half the bytes the sink may hold."""
        return len(self._buffer) >= self.config.rows_per_shard or \
            2 * self._buffer_held >= self.config.max_pending_bytes

    def _drain(self, force: bool = False) -> None:
        """Everything queued into the buffer, shards committed as they fill; `force`: the rest too."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, threading.Event):
                item.set()
                continue
            if item is _STOP:
                continue
            self._add(*item)
            if self._full():
                self._flush_buffer()
        if force and self._buffer:
            self._flush_buffer()

    def _add(self, item: ServedConversation, nbytes: int = 0, copied=None) -> None:
        """The record's `nbytes` stay held while its row is buffered and written; released if it is dropped here."""
        if copied is not None:
            copied.synchronize()  # its features' copy to the host has landed
        self._buffer_held += nbytes
        rows = len(self._buffer)
        try:
            self._add_row(item)
        finally:
            if len(self._buffer) == rows:  # dropped: nothing of it is held any longer
                self._buffer_held -= nbytes
                self._release(nbytes)

    def _add_row(self, item: ServedConversation) -> None:
        """Redact, mask, truncate, check the features; the row joins the buffer (or is dropped and counted)."""
        from eagle_core.chat import served_loss_mask
        from eagle_core.features import FeatureRow

        ids = (list(item.prompt_ids), list(item.answer_ids))
        if self.redact is not None:
            try:
                item = self.redact(item)
            except Exception as err:  # noqa: BLE001
                return self._drop("redaction_error", err)
            if item is None:
                return self._drop("redacted")
            if (list(item.prompt_ids), list(item.answer_ids)) != ids:
                item.features = None  # computed for other tokens
        try:
            mask = served_loss_mask(self.tokenizer, item.messages, item.prompt_ids, len(item.answer_ids), item.tools)
        except Exception as err:  # noqa: BLE001 -- a template that refuses: the answer alone is still right
            mask = [0] * len(item.prompt_ids) + [1] * len(item.answer_ids)
            self._count("mask_fallback")
            self.last_error = f"loss mask: {err}"
        tokens = (item.prompt_ids + item.answer_ids)[: self.config.max_length]
        mask = mask[: len(tokens)]
        if not any(mask):
            return self._drop("no_loss_tokens")
        n = len(tokens)
        if self.config.features:
            got = self._features(item.features, n)
            if isinstance(got, str):
                return self._drop(got)
            aux, last = got
        else:
            aux = torch.empty(0, 3 * self.hidden, dtype=self.dtype)
            last = torch.empty(0, self.hidden, dtype=self.dtype)
        row = FeatureRow(id=str(item.id), input_ids=torch.tensor(tokens), loss_mask=torch.tensor(mask, dtype=torch.int8),
                         aux_hidden=aux, last_hidden=last)
        size = n * 4 + aux.numel() * aux.element_size() + last.numel() * last.element_size()
        if self.config.max_bytes is not None and (self.shards.committed() + self._buffer_bytes + size
                                                  > self.config.max_bytes):
            return self._drop("size_cap")
        self._buffer.append(row)
        if item.meta:
            self._row_meta[row.id] = dict(item.meta)
        self._buffer_bytes += size
        if self._oldest is None:
            self._oldest = time.monotonic()

    def _features(self, features, n: int):
        """(aux [n, 3H], last [n, H]) on the host, or the reason to drop the row.

        A finished row's last token never went through a forward (it was a round's bonus), so it has no features:
        its row is zeros. Training never reads it (TTT counts column t only where t + 2 is a real token of the
        conversation, and the last position's hidden state labels the token after the conversation), and an
        extraction's value there would be the target's features of the final token, used by nothing."""
        if features is None:
            return "no_features"
        aux, last = features[0], features[1]
        if aux.dtype != self.dtype or aux.shape[-1] != 3 * self.hidden or last.shape[-1] != self.hidden \
                or len(aux) != len(last) or len(aux) < n - 1:
            return "bad_features"
        aux, last = aux[:n].detach().to("cpu"), last[:n].detach().to("cpu")
        if len(aux) == n - 1:
            self._count("last_token_zero")
            aux = torch.cat([aux, aux.new_zeros(1, aux.shape[1])])
            last = torch.cat([last, last.new_zeros(1, last.shape[1])])
        return aux.contiguous(), last.contiguous()

    def _flush_buffer(self) -> None:
        rows, self._buffer, self._buffer_bytes, self._oldest = self._buffer, [], 0, None
        held, self._buffer_held = self._buffer_held, 0
        meta = {r.id: self._row_meta.pop(r.id) for r in rows if r.id in self._row_meta}
        try:
            self._commit_shard(rows, meta)
        except FingerprintMismatch as err:
            self._drop("fingerprint_mismatch", err, len(rows))
        except Exception as err:  # noqa: BLE001 -- a full disk, a store down: counted, never raised
            self._drop("store_error", err, len(rows))
        else:
            try:
                self.shards.refresh()
            except Exception as err:  # noqa: BLE001 -- the shard is committed; the next commit lists it
                self._count("manifest_errors")
                self.last_error = f"manifest: {err}"
        finally:
            del rows
            self._release(held)  # written or dropped: the rows' memory is free

    def _prepare(self) -> None:
        """Before the first shard: the output's fingerprint must be this sink's (or it is recorded now)."""
        if self._prepared:
            return
        url = join(self.config.url, "fingerprint.json")
        if exists(url):
            check_fingerprint(json.loads(read_bytes(url)), self.fingerprint, f"the traffic output {self.config.url}",
                              "Point the sink at another URL, or remove that output.")
        else:
            commit_bytes(url, json.dumps(self.fingerprint, indent=1).encode())
        self._prepared = True

    def _commit_shard(self, rows: list, meta: dict | None = None) -> None:
        """One Parquet shard of `rows` (`FeatureRow`s), its summary in the metadata as extraction writes it, plus
        the rows' meta (`row_meta`: row id -> the conversation's meta, such as its category label; `categories`:
        rows per category), which the feature schema has no column for and training does not read."""
        self._prepare()
        start = time.perf_counter()
        created_ms = int(time.time() * 1000)
        digest = uuid.uuid5(uuid.NAMESPACE_OID, "\n".join(r.id for r in rows)).hex[:10]
        name = f"shard-{created_ms:013d}-{self.writer}-{digest}"
        counts = Counter()
        for r in rows:
            counts.update(r.input_ids[r.loss_mask.bool()].tolist())
        summary = {
            "shard": name, "rows": len(rows), "tokens": sum(len(r.input_ids) for r in rows),
            "loss_tokens": sum(int(r.loss_mask.sum()) for r in rows), "seconds": 0.0,
            "quarantined": {}, "quarantined_ids": {},
            "token_counts": {str(k): v for k, v in sorted(counts.items())}, "dtype": DTYPE_NAMES[self.dtype],
            "fingerprint": self.fingerprint, "created_unix_ms": created_ms, "writer": self.writer,
            "features": self.config.features,
            "row_meta": dict(meta or {}),
            "categories": dict(Counter(str(m["category"]) for m in (meta or {}).values() if "category" in m)),
        }
        table = feature_table(rows).replace_schema_metadata({SHARD_META_KEY: json.dumps(summary).encode()})
        sink = io.BytesIO()
        pq.write_table(table, sink, compression="zstd")
        summary["seconds"] = time.perf_counter() - start
        commit_bytes(join(self.config.url, "features", f"{name}.parquet"), sink.getvalue())
        self.shards.add(name, summary, sink.tell())
        with self._lock:
            self._counts["rows"] += len(rows)
            self._counts["shards"] += 1
            self._counts["bytes"] += sink.tell()

    # ---- counters ------------------------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _drop(self, reason: str, err: BaseException | None = None, n: int = 1) -> None:
        with self._lock:
            self._dropped[reason] += n
            if err is not None:
                self.last_error = f"{reason}: {type(err).__name__}: {err}"


def _close_at_exit(sink: TrafficSink):
    """An atexit hook closing `sink` (flush, then stop) if it is still alive; holds it only weakly."""
    import weakref

    ref = weakref.ref(sink)

    def close() -> None:
        alive = ref()
        if alive is not None and not alive._stop.is_set():
            try:
                alive.close(alive.config.close_s / 2)  # as Service.close: the flush, then the thread
            except Exception:  # noqa: BLE001 -- the process is exiting regardless
                log.exception("traffic sink: flush at exit failed")

    return close
