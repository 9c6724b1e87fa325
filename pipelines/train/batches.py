"""A rank's batches: one interface (`Batches`), a planned-files and a streamed implementation, and the
decoding of feature rows into padded tensors.

    for step in batches.epoch(epoch, state):   # this rank's rows of each optimiser step, from the resume point
        ... step.rows, step.position (saved with checkpoints), step.last (the epoch's last step)
    for rows in batches.held_out():            # this rank's rows of each held-out forward (same count on all ranks)

Files (`PlannedBatches`): each rank reads its own planned share of every step (see `plan.py`, `shards.py`); a
step may give a rank no rows (`collate` then makes a fully masked dummy row, so every rank runs the same
forwards and collectives). Streamed (`StreamedBatches`): each rank batches the rows Ray Data streams to it by
`tokens_per_batch / W` and sets the held-out ids aside; every rank stops as soon as any rank's stream runs
dry. Which rank gets which streamed row is up to Ray Data, so resuming skips as many rows as were consumed
but not the very same ones.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

import torch

from eagle_core.ttt_batch import layout_batch
from pipelines.train.collectives import all_reduce
from pipelines.train.shards import EVAL_DATASET, train_dataset_name

if TYPE_CHECKING:
    from pipelines.train.plan import TrainPlan


@dataclass
class Step:
    rows: list[dict]
    position: dict  # the data position after this step ({step_in_epoch, rows_consumed}): saved with checkpoints
    last: bool  # the epoch's last step (its checkpoint comes with the epoch's held-out evaluation)


class Batches(Protocol):
    baseline_eval: bool  # the held-out rows are known before training: evaluate the untrained draft too

    def epoch(self, epoch: int, state: dict) -> Iterator[Step]: ...

    def held_out(self) -> Iterator[list[dict]]: ...


def planned_micro_batches(iterator, n_steps: int, start: int):
    """(step, rows) for steps start..n_steps-1 from a rank's planned shard; rows of earlier steps are skipped."""
    rows = iter(iterator.iter_rows()) if iterator is not None else iter(())
    pending = next(rows, None)
    for step in range(n_steps):
        micro = []
        while pending is not None and pending["step"] <= step:
            if pending["step"] == step and step >= start:
                micro.append(pending)
            pending = next(rows, None)
        if step >= start:
            yield step, sorted(micro, key=lambda r: r["slot"])


class PlannedBatches:
    """Files mode: the rank's planned share of every step, read from its `train.<epoch>` / `eval` shards."""

    baseline_eval = True

    def __init__(self, plan: TrainPlan, get_shard: Callable):
        self.plan, self.get_shard = plan, get_shard

    def epoch(self, epoch: int, state: dict) -> Iterator[Step]:
        n_steps = self.plan.steps_per_epoch[epoch]
        shard = self.get_shard(train_dataset_name(epoch))
        for step, rows in planned_micro_batches(shard, n_steps, state["step_in_epoch"]):
            yield Step(rows, {"step_in_epoch": step + 1}, last=step + 1 == n_steps)

    def held_out(self) -> Iterator[list[dict]]:
        return (rows for _, rows in planned_micro_batches(self.get_shard(EVAL_DATASET), self.plan.eval_steps, 0))


def streamed_micro_batches(iterator, tokens: int, eval_ids: set, held: list, skip_rows: int):
    """(rows consumed, rows) batches of ~`tokens` real tokens from a streamed shard; held-out rows go to `held`."""
    consumed, micro, size = 0, [], 0
    for row in iterator.iter_rows():
        consumed += 1
        if consumed <= skip_rows:
            continue
        if row["id"] in eval_ids:
            held.append(row)
            continue
        micro.append(row)
        size += len(row["input_ids"])
        if size >= tokens:
            yield consumed, micro
            micro, size = [], 0


class StreamedBatches:
    """Streaming mode: ~tokens_per_batch / W real tokens of the rows streamed to this rank per step."""

    baseline_eval = False  # the held-out rows arrive with the stream

    def __init__(self, plan: TrainPlan, tokens_per_batch: int, world: int, device, get_shard: Callable):
        self.eval_ids, self.get_shard, self.device = set(plan.eval_ids), get_shard, device
        self.tokens = max(tokens_per_batch // world, 1)
        self.held: list[dict] = []

    def epoch(self, epoch: int, state: dict) -> Iterator[Step]:
        self.held = []
        batches = streamed_micro_batches(self.get_shard("train"), self.tokens, self.eval_ids, self.held,
                                         state["rows_consumed"])
        step_in_epoch = state["step_in_epoch"]
        while True:
            got = next(batches, None)
            # every rank steps together: stop as soon as any rank's stream runs dry
            if float(all_reduce(torch.tensor([0.0 if got else 1.0]), self.device, op="max")[0]) > 0:
                return
            step_in_epoch += 1
            yield Step(got[1], {"rows_consumed": got[0], "step_in_epoch": step_in_epoch}, last=False)

    def held_out(self) -> Iterator[list[dict]]:
        groups = [[r] for r in self.held]  # one streamed held-out row per forward
        n = int(all_reduce(torch.tensor([float(len(groups))]), self.device, op="max")[0])
        return iter(groups + [[] for _ in range(n - len(groups))])


def prefetched(steps: Iterator[Step], prepare: Callable[[list[dict]], object],
               ahead: bool = True) -> Iterator[tuple[Step, object]]:
    """(step, prepare(step.rows)) for every step; with `ahead`, the next step's `prepare` runs on a background thread
    while the caller trains on this one, so the host's decoding and packing overlap the device's step. The steps
    themselves are drawn on the caller's thread, one ahead (a streamed epoch's collectives stay in one order on
    every rank); `prepare` must issue none. An error in `prepare` is raised where its step is asked for, before it
    trains. Without `ahead` (a CPU device: the step keeps the cores busy, and a second thread only competes with it
    for them and for the interpreter: a retraining test took 66-69 s inline against 74-82 s prefetched on 2 cores),
    each step is prepared on the caller's thread when it comes."""
    if not ahead:
        yield from ((step, prepare(step.rows)) for step in steps)
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch") as pool:
        step = next(steps, None)
        ready = pool.submit(prepare, step.rows) if step is not None else None
        while step is not None:
            following = next(steps, None)
            prepared = ready.result()
            if following is not None:
                ready = pool.submit(prepare, following.rows)
            yield step, prepared
            step = following


def decode_row(row: dict, meta: dict) -> dict:
    from pipelines.feature_files import decode_hidden

    h = meta["target_hidden_size"]
    return {"id": row["id"], "slot": row.get("slot", 0),
            "input_ids": torch.as_tensor(row["input_ids"], dtype=torch.long),
            "loss_mask": torch.as_tensor(row["loss_mask"], dtype=torch.long),
            "aux_hidden": decode_hidden(row["aux_hidden"], meta["dtype"], 3 * h),
            "last_hidden": decode_hidden(row["last_hidden"], meta["dtype"], h)}


def collate(rows: list[dict], meta: dict, ttt_steps: int, device, pack_length: int | None = None) -> dict:
    """Decoded rows as a batch {input_ids, loss_mask, attention_mask [B, L], aux_hidden [B, L, 3H], ...}: one row
    each, right-padded to the longest, or with `pack_length` (a number of tokens: `TrainJobConfig.row_length`) packed
    into rows of that many tokens (plus position_ids; a longer conversation is refused by name):
    `eagle_core.ttt_batch.layout_batch`.

    No rows (a rank with an empty share of a small global batch) gives one fully masked dummy row, so the
    rank still runs the forward and backward every collective expects, contributing zero loss.
    """
    h, dtype = meta["target_hidden_size"], getattr(torch, meta["dtype"])
    if not rows:
        n = ttt_steps + 2
        batch = {"input_ids": torch.zeros(1, n, dtype=torch.long), "loss_mask": torch.zeros(1, n, dtype=torch.long),
                 "attention_mask": torch.zeros(1, n, dtype=torch.long),
                 "aux_hidden": torch.zeros(1, n, 3 * h, dtype=dtype), "last_hidden": torch.zeros(1, n, h, dtype=dtype)}
    else:
        batch = layout_batch(rows, pack_length, names=[r.get("id") for r in rows])
    return {k: v.to(device) for k, v in batch.items()}
