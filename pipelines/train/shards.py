"""Features mode, Ray Data side: each rank's planned rows as a Ray Dataset, routed to that rank by name.

Rank r's share of the plan (see `plan.py`) becomes a Dataset of plan items -> the feature rows they name,
handed to rank r by `PlannedShards` under `get_dataset_shard("train.<epoch>")` / `("eval")`.
"""

from __future__ import annotations

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq


EVAL_DATASET = "eval"


def train_dataset_name(epoch: int) -> str:
    return f"train.{epoch}"


def read_items(entries: list[dict]) -> list[dict]:
    """Group consecutive plan rows of one shard file: each item makes one task read that file once."""
    items = []
    for e in entries:
        if not items or items[-1]["file"] != e["file"]:
            items.append({"file": e["file"], "rows": [], "steps": [], "slots": []})
        items[-1]["rows"].append(e["row"])
        items[-1]["steps"].append(e["step"])
        items[-1]["slots"].append(e["slot"])
    return items


def read_planned_rows(batch: pa.Table) -> pa.Table:
    """Ray Data map: plan items -> the feature rows they name, each tagged with its step and slot."""
    out = []
    for item in batch.to_pylist():
        with fsspec.open(item["file"], "rb") as f:
            table = pq.read_table(f).take(pa.array(item["rows"], pa.int64()))
        table = table.append_column("step", pa.array(item["steps"], pa.int32()))
        out.append(table.append_column("slot", pa.array(item["slots"], pa.int32())))
    return pa.concat_tables(out)


def planned_dataset(entries: list[dict]):
    import ray

    items = read_items(entries)
    if not items:
        return ray.data.from_items([{"file": "", "rows": [], "steps": [], "slots": []}]).limit(0)
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    # Decoding a shard is light work next to a training step: a fraction of a CPU keeps workers unstarved.
    return ds.map_batches(read_planned_rows, batch_size=1, batch_format="pyarrow", num_cpus=0.25)


def build_planned_datasets(train: list[list[list[dict]]], held_out: list[list[dict]]) -> dict:
    """{"train.<epoch>": [per-rank Dataset], "eval": [...]} from the plan rows of each epoch and rank ([epoch][rank])
    and of the held-out split ([rank]): lazy, nothing is read until a rank iterates its own."""
    datasets = {train_dataset_name(e): [planned_dataset(entries) for entries in ranks] for e, ranks in enumerate(train)}
    datasets[EVAL_DATASET] = [planned_dataset(entries) for entries in held_out]
    return datasets


def planned_shards_config(per_rank: dict):
    """A Ray Train DataConfig that routes each rank its own planned Dataset (class built lazily: no Ray import)."""
    from ray.train import DataConfig

    class PlannedShards(DataConfig):
        """Hands rank r its own planned Dataset for the names in `per_rank`, in order; others split as usual.

        Ray Train asks for one dataset name at a time; the trainer's `datasets` entry for a planned name is
        only a stand-in (rank 0's share), so Ray Train knows the name.
        """

        def __init__(self, per_rank: dict):
            super().__init__()
            self.per_rank = per_rank

        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
            routed = {n for n in datasets if n in self.per_rank}
            rest = {n: ds for n, ds in datasets.items() if n not in routed}
            output = super().configure(rest, world_size, worker_handles, worker_node_ids, **kwargs) if rest \
                else [{} for _ in range(world_size)]
            for name in routed:
                for rank, ds in enumerate(self.per_rank[name]):
                    ds = ds.copy(ds)
                    ds.context.execution_options = self._resolve_execution_options(name)
                    ds.context.execution_options.preserve_order = True  # the plan's order is the training order
                    output[rank][name] = ds.iterator()
            return output

    return PlannedShards(per_rank)
