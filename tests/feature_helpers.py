"""Reading an extraction output's feature rows back in tests (imported by test_extract.py and test_engines.py)."""

from __future__ import annotations


def read_rows(output: str) -> list[dict]:
    """The rows of every committed shard (the files `pipelines.feature_files.read_features` reads), sorted by id,
    from a local folder or any fsspec URL (s3://...). Read with pyarrow: a Ray Data read
    (`read_features(output).take_all()`) starts ~32 footer-reading workers and takes ~10 s here for the same rows,
    ~0.02 s this way. test_extract.py's streaming test checks once that `read_features` gives these rows."""
    import pyarrow.parquet as pq

    from pipelines.feature_files import committed_shards
    from pipelines.storage import join, url_to_fs

    rows = []
    for name in sorted(committed_shards(str(output))):
        fs, path = url_to_fs(join(str(output), "features", f"{name}.parquet"))
        with fs.open(path, "rb") as f:
            rows += pq.read_table(f).to_pylist()
    return sorted(rows, key=lambda r: r["id"])
