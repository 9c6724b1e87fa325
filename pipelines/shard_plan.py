"""An extraction's shards: their names (a hash of their rows' content) and the plan that cuts a corpus into them,
either from rows in hand (`plan_shards`) or from a Ray Dataset without the rows leaving the object store
(`plan_shard_dataset`, what `pipelines.extract` runs: the driver holds shard names only)."""

from __future__ import annotations

import hashlib
import json

def shard_name(index: int, rows: list[dict]) -> str:
    """`shard-<index>-<hash>`: the hash covers the rows' ids and their content (messages, tools), so a corpus
    edited in place with its ids kept names the changed rows' shards anew; they are extracted again (and
    regenerated: the cache under regenerated/ is named by the shard too) while unchanged shards are kept."""
    text = "\n".join(json.dumps(r, ensure_ascii=False, sort_keys=True) for r in rows)
    return f"shard-{index:05d}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


def plan_shards(rows: list[dict], rows_per_shard: int, first_shard: int = 0) -> list[dict]:
    """Consecutive rows cut into shards of `rows_per_shard`, numbered from `first_shard`: {shard, rows_json}."""
    return [
        {"shard": shard_name(first_shard + k // rows_per_shard, rows[k:k + rows_per_shard]),
         "rows_json": json.dumps(rows[k:k + rows_per_shard], ensure_ascii=False)}
        for k in range(0, len(rows), rows_per_shard)
    ]


def _plan_part(first_shard: int, rows_per_shard: int, ranges: list[tuple[int, int]], *blocks):
    """Ray task: the shards [first_shard, ...) whose rows are `blocks[i][ranges[i]]`, concatenated, as an Arrow
    table {shard, rows_json}, and their names. Rows are read as `Dataset.iter_rows` reads them (the same dicts,
    so the same names and JSON as when the driver collected the whole corpus)."""
    import pyarrow as pa
    from ray.data.block import BlockAccessor

    rows = []
    for block, (lo, hi) in zip(blocks, ranges):
        part = BlockAccessor.for_block(block).slice(lo, hi, copy=False)
        rows.extend(BlockAccessor.for_block(part).iter_rows(public_row_format=True))
    shards = plan_shards(rows, rows_per_shard, first_shard)
    names = [s["shard"] for s in shards]
    return pa.table({"shard": names, "rows_json": [s["rows_json"] for s in shards]}), names


def plan_shard_dataset(rows, rows_per_shard: int):
    """The plan of `plan_shards` for a Dataset of rows, without the rows leaving the object store: returns
    (Dataset of {shard, rows_json} in shard order, the shard names in order).

    The rows are materialised in the object store; their blocks' row counts (metadata, no data) give each block's
    first row in the corpus, hence which shards start in it. One task per block that starts a shard cuts those
    shards, reading the next blocks too where its last shard runs on. Each task's table stays in the object store
    (a block's worth of rows: stored there, not in the driver); only the names come back."""
    import ray

    materialized = rows.materialize()  # held until every planning task has read its blocks
    spans, total = [], 0  # (block ref, first row, end row within the block, first row in the corpus)
    for bundle in materialized.iter_internal_ref_bundles():
        for entry, cut in zip(bundle.blocks, bundle.slices):
            lo, hi = (0, entry.metadata.num_rows) if cut is None else (cut.start_offset, cut.end_offset)
            if hi > lo:
                spans.append((entry.ref, lo, hi, total))
                total += hi - lo
    task = ray.remote(num_returns=2)(_plan_part)
    tables, names = [], []
    for ref, lo, hi, start in spans:
        first, end = -(-start // rows_per_shard), -(-(start + hi - lo) // rows_per_shard)  # shards starting here
        if first >= end:
            continue
        row_lo, row_hi = first * rows_per_shard, min(total, end * rows_per_shard)
        refs, ranges = [], []
        for ref_i, lo_i, hi_i, start_i in spans:  # the blocks that hold rows [row_lo, row_hi)
            a, b = max(row_lo, start_i), min(row_hi, start_i + hi_i - lo_i)
            if a < b:
                refs.append(ref_i)
                ranges.append((lo_i + a - start_i, lo_i + b - start_i))
        table, part_names = task.remote(first, rows_per_shard, ranges, *refs)
        tables.append(table)
        names.append(part_names)
    names = [name for part in ray.get(names) for name in part]
    del materialized  # the tables hold the rows now
    if not tables:
        import pyarrow as pa

        return ray.data.from_arrow(pa.table({"shard": pa.array([], pa.string()),
                                             "rows_json": pa.array([], pa.string())})), names
    return ray.data.from_arrow_refs(tables), names


def one_shard_per_block(plan):
    """Blocks of one shard each, made as the stage asks for them (streaming), so that the actor pool spreads the
    shards of a planning task's table over all its actors rather than handing the whole table to one."""
    return plan.repartition(target_num_rows_per_block=1)
