"""The streaming extraction driver: the corpus never passes through the driver (no take_all, no conversation row
handed to it), the shard plan cut in the object store equals the plan of the whole corpus in memory, and the
quarantine file holds every quarantined row, streamed to it."""

import json
import os
import uuid

import fsspec
import pytest
from ray.data import Dataset

from pipelines.extract import ExtractConfig, run_extract
from pipelines.shard_plan import plan_shard_dataset, plan_shards
from pipelines.storage import commit_stream


def _conversation(i: int) -> dict:
    turns = [{"from": "human", "value": f"Streaming question {i}?"}, {"from": "gpt", "value": f"Answer {i}."}]
    if i % 4 == 0:  # some rows carry a system turn: Arrow fills the other rows' absent fields in the same block
        turns.insert(0, {"from": "system", "value": "Be brief."})
    return {"id": f"s{i}", "conversations": turns}


def test_the_plan_cut_in_the_object_store_is_the_plan_of_the_whole_corpus(ray_cluster):
    """Blocks of uneven sizes, shards that span two or three blocks, a last short shard, one-row shards and a
    shard larger than the corpus: names and rows_json equal `plan_shards` over the rows Ray hands back whole."""
    import ray

    ray.data.DataContext.get_current().execution_options.preserve_order = True  # as ingest sets it
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": "q" * (i % 5)},
                                        {"role": "assistant", "content": f"a{i}"}]} for i in range(23)]
    ds = ray.data.from_items(rows, override_num_blocks=6).materialize()
    assert ds.num_blocks() == 6
    whole = ds.take_all()  # what the driver used to collect
    for rows_per_shard in (1, 2, 3, 7, 10, 64):
        plan, names = plan_shard_dataset(ds, rows_per_shard)
        expected = plan_shards(whole, rows_per_shard)
        assert names == [s["shard"] for s in expected], rows_per_shard
        assert plan.take_all() == expected, rows_per_shard
    empty, names = plan_shard_dataset(ds.filter(expr=ray.data.expressions.col("id") == "none"), 4)
    assert names == [] and empty.count() == 0


@pytest.fixture
def corpus(tmp_path):
    """Two files (two ingest blocks), 10 good rows and 4 quarantined ones of different reasons in each order."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    bad = {"a.jsonl": [(1, '{"id": "broken-a", "conversations": [', "bad_json"),
                       (4, json.dumps({"id": "alone", "conversations": [{"from": "human", "value": "q"}]}),
                        "no_assistant_turn")],
           "b.jsonl": [(0, json.dumps({"id": "wizard", "conversations": [{"from": "wizard", "value": "hi"},
                                                                          {"from": "gpt", "value": "x"}]}),
                        "unknown_role"),
                       (3, '{"id": "broken-b", "conversations": [', "bad_json")]}
    expected, n = [], 0
    for name in ("a.jsonl", "b.jsonl"):
        lines = [json.dumps(_conversation(n + k)) for k in range(5)]
        n += 5
        for at, line, reason in bad[name]:
            lines.insert(at, line)
        (folder / name).write_text("\n".join(lines) + "\n")
        expected += [(name, at, reason) for at, _, reason in bad[name]]
    return folder, expected


def test_run_extract_keeps_the_corpus_off_the_driver_and_writes_the_whole_quarantine(
        ray_cluster, tmp_path, tiny_target_dir, corpus, monkeypatch):
    """With every whole-dataset collection on the driver raising, and every row the driver iterates recorded,
    an extraction (and its resume) completes; no row the driver saw was a conversation; the shard names are
    those of the plan over the whole corpus; the quarantine file lists every quarantined row in input order."""
    from pipelines.data import ingest

    folder, quarantined = corpus
    config = ExtractConfig(corpus=str(folder), output=str(tmp_path / "out"), target=str(tiny_target_dir),
                           regenerate=False, rows_per_shard=3, cpus_per_worker=0.5, mlflow_experiment=None,
                           max_length=96, tokens_per_batch=4096)
    seen_columns = set()

    def refuse(name):
        def collect(self, *args, **kwargs):
            raise AssertionError(f"Dataset.{name} collects a dataset on the driver")
        return collect

    real_take, real_iter_rows, real_iter_batches = Dataset.take, Dataset.iter_rows, Dataset.iter_batches

    def take(self, limit=20):  # aggregates (Dataset.sum) read their one result row through take(1)
        if limit > 1:
            raise AssertionError(f"Dataset.take({limit}) on the driver")
        return real_take(self, limit)

    def iter_rows(self, *args, **kwargs):
        for row in real_iter_rows(self, *args, **kwargs):
            seen_columns.update(row.keys())
            yield row

    def iter_batches(self, *args, **kwargs):
        for batch in real_iter_batches(self, *args, **kwargs):
            seen_columns.update(batch.keys() if hasattr(batch, "keys") else batch.column_names)
            yield batch

    with monkeypatch.context() as patched:
        for name in ("take_all", "take_batch", "to_pandas", "to_arrow_refs"):
            patched.setattr(Dataset, name, refuse(name))
        patched.setattr(Dataset, "take", take)
        patched.setattr(Dataset, "iter_rows", iter_rows)
        patched.setattr(Dataset, "iter_batches", iter_batches)
        manifest = run_extract(config)
        features = tmp_path / "out" / "features"
        stamps = {p.name: p.stat().st_mtime_ns for p in features.glob("*.parquet")}
        deleted = features / f"{manifest.shards[1].name}.parquet"
        deleted.unlink()  # a resume recomputes this shard only
        resumed = run_extract(config)

    assert seen_columns and not seen_columns & {"messages", "rows_json", "conversations"}, seen_columns
    whole = ingest(str(folder)).dataset.take_all()  # the old driver's view of the corpus
    assert [s.name for s in manifest.shards] == [s["shard"] for s in plan_shards(whole, 3)]
    assert manifest.rows == 10 and len(manifest.shards) == 4
    assert resumed.shards == manifest.shards and resumed.token_counts == manifest.token_counts
    assert deleted.exists()
    assert {p.name: p.stat().st_mtime_ns for p in features.glob("*.parquet") if p != deleted} == \
        {k: v for k, v in stamps.items() if k != deleted.name}

    lines = (tmp_path / "out" / "quarantine" / "ingest.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [(r["file_index"], r["row_index"], r["reason"]) for r in rows] == \
        [({"a.jsonl": 0, "b.jsonl": 1}[f], at, reason) for f, at, reason in quarantined]
    assert len(rows) == manifest.ingest["quarantined"] == resumed.ingest["quarantined"] == 4
    assert os.listdir(tmp_path / "out" / "quarantine") == ["ingest.jsonl"]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_streamed_commit_is_whole_or_absent(tmp_path, where, request):
    """commit_stream: a generator that fails part-way leaves no file (and no temporary one); a complete one
    leaves every chunk, in order."""
    if where == "s3":
        request.getfixturevalue("s3_endpoint")
        url = f"s3://eagle3/stream-{uuid.uuid4().hex[:8]}/quarantine/ingest.jsonl"
    else:
        url = str(tmp_path / "quarantine" / "ingest.jsonl")
    fs, path = fsspec.core.url_to_fs(url)

    def failing():
        yield b"first line\n"
        raise OSError("the reader failed")

    with pytest.raises(OSError, match="reader failed"):
        commit_stream(url, failing())
    assert not fs.exists(path)
    parent = path.rsplit("/", 1)[0]
    assert not (fs.exists(parent) and fs.ls(parent, detail=False))  # no temporary file either
    chunks = [f"line {i}\n".encode() for i in range(1000)]
    assert commit_stream(url, iter(chunks)) == sum(map(len, chunks))
    assert fs.cat_file(path) == b"".join(chunks)
