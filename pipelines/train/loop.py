"""The per-worker training loop of the TorchTrainer (read it top to bottom: `train_loop`).

The TTT loss of a rank is normalised by the *global* per-step position counts (all-reduced first, see
`ttt_forward(step_denominators=...)`), so DDP's averaged gradient equals one process training on the whole
global batch: 1 worker and W workers follow the same trajectory, up to float rounding.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from eagle_core.ttt import TrainConfig, batch_to, make_optimizer, make_scheduler, train_step
from eagle_core.ttt_batch import check_batch, pack_rows, step_counts
from pipelines.train.batches import Batches, PlannedBatches, StreamedBatches, collate, decode_row, prefetched
from pipelines.train.checkpoint import full_state, is_sharded, restore_state, restore_trainer, save_checkpoint
from pipelines.train.collectives import all_reduce, world_info
from pipelines.train.config import TrainJobConfig
from pipelines.train.faults import maybe_fault
from pipelines.train.lineage import Lineage
from pipelines.train.metrics import evaluate, global_step_metrics
from pipelines.train.model import (TTTObjective, build_draft, gradient_sync, load_target_heads, target_config,
                                   wrap_objective)
from pipelines.train.plan import TrainPlan
from pipelines.train.report import RankZeroLogger, log_held_out, log_step


def initial_state() -> dict:
    """The run's position, saved with every checkpoint (state.json)."""
    return {"step": 0, "epoch": 0, "step_in_epoch": 0, "rows_consumed": 0, "restored_from": []}


@dataclass
class Run:
    """Everything one worker trains with; `state` is what a checkpoint saves of the run's position."""

    config: TrainJobConfig
    tcfg: TrainConfig
    meta: dict
    plan: TrainPlan
    rank: int
    world: int
    device: torch.device
    head: torch.Tensor  # the target's lm_head (float32)
    draft: torch.nn.Module
    objective: torch.nn.Module  # the draft's TTT forward, wrapped for DDP/FSDP
    teacher: Callable[[dict, torch.Tensor], dict]  # a batch plus its target distribution (`TTTObjective.teacher`)
    optimizer: torch.optim.Optimizer
    scheduler: object
    sharded: bool
    batches: Batches
    mlflow: RankZeroLogger
    storage_dir: str
    fault_at_step: int | None = None  # tests only, see faults.py
    state: dict = field(default_factory=lambda: initial_state())

    @property
    def restored(self) -> bool:
        return bool(self.state["restored_from"])


def train_loop(loop_config: dict) -> None:
    """Set up (or restore), evaluate the untrained draft, then epochs of steps, each ending in an evaluation
    and a checkpoint; `max_steps` may stop the run early."""
    run = setup(loop_config)
    try:
        _train_epochs(run)
    except BaseException:
        run.mlflow.close(timeout_s=10.0)  # failing: Ray Train restarts the worker; do not hold it up
        raise
    run.mlflow.close()  # metrics queued during a tracking-server outage are sent before the worker ends


def _train_epochs(run: "Run") -> None:
    if not run.restored and run.batches.baseline_eval:
        held_out_eval(run)  # the untrained draft: the baseline of the held-out curves, logged at step 0
    while run.state["epoch"] < run.config.epochs:
        epoch, done, data_wait, asked = run.state["epoch"], False, 0.0, time.perf_counter()
        # On a GPU the next step's host work (decoding, packing, checks, pinning) runs while this one trains.
        for step, host in prefetched(run.batches.epoch(epoch, run.state), lambda rows: host_batches(run, rows),
                                     ahead=run.device.type == "cuda"):
            data_wait += time.perf_counter() - asked  # time blocked on the data, not computing
            metrics = train_one_step(run, step.rows, host)
            run.state.update(step.position, step=run.state["step"] + 1)
            done = run.config.max_steps is not None and run.state["step"] >= run.config.max_steps
            after_step(run, metrics, checkpoint_now=not (step.last or done))
            if done:
                break
            asked = time.perf_counter()
        metrics = held_out_eval(run, epoch_data_wait_s=data_wait)
        run.state.update(epoch=epoch + 1, step_in_epoch=0, rows_consumed=0)  # resuming from here starts the next
        save_and_report(run, {"step": run.state["step"], **metrics})
        if done:
            break


def setup(loop_config: dict) -> Run:
    """Target heads, draft (restored from Ray Train's latest checkpoint if any), wrapping, optimiser, batches."""
    import ray.train
    import ray.train.torch

    from pipelines.cluster import use_assigned_cpus

    use_assigned_cpus()
    config, meta = TrainJobConfig(**loop_config["job"]), loop_config["meta"]
    plan = TrainPlan.from_json(loop_config["plan"])
    rank, world = world_info()
    device = ray.train.torch.get_device()
    heads = load_target_heads(loop_config["target"], device)
    d2t = torch.tensor(loop_config["d2t"])
    t2d = torch.zeros(meta["target_vocab_size"], dtype=torch.bool)
    t2d[torch.arange(len(d2t)) + d2t] = True
    os.environ["MLFLOW_TRACKING_URI"] = loop_config["tracking_uri"]  # the driver's store, for models:/ warm starts
    draft = build_draft(config, target_config(loop_config["target"]), heads, d2t, t2d,
                        Lineage.from_json(loop_config["lineage"]))
    state = initial_state()
    latest = ray.train.get_checkpoint()
    restore_dir = Path(latest.to_directory()) if latest is not None else None
    if restore_dir is not None:
        restore_state(draft, restore_dir, state)
    # The features' shapes (the manifest's hidden size, three aux layers) against the draft, before any step: the
    # dummy batch is built from the same meta as every batch of the run (`check_batch` refuses it by name).
    check_batch(draft, collate([], meta, config.ttt_steps, torch.device("cpu")), heads["lm_head"])
    sharded = is_sharded(config.strategy, world)
    base = TTTObjective(draft, autocast=device.type == "cuda")
    objective = wrap_objective(base, config.strategy, world, device)
    tcfg = config.train_config(plan.total_steps)
    optimizer = make_optimizer(draft, tcfg)  # after wrapping: FSDP swaps the parameters for sharded ones
    scheduler = make_scheduler(optimizer, tcfg)
    if restore_dir is not None:
        restore_trainer(objective, optimizer, scheduler, restore_dir, sharded)
    if plan.mode == "files":
        batches = PlannedBatches(plan, ray.train.get_dataset_shard)
    else:
        batches = StreamedBatches(plan, config.tokens_per_batch, world, device, ray.train.get_dataset_shard)
    return Run(config=config, tcfg=tcfg, meta=meta, plan=plan, rank=rank, world=world, device=device,
               head=heads["lm_head"], draft=draft, objective=objective, teacher=base.teacher, optimizer=optimizer,
               scheduler=scheduler, sharded=sharded, batches=batches, state=state,
               storage_dir=loop_config["storage_dir"],
               mlflow=RankZeroLogger(loop_config["tracking_uri"], loop_config["mlflow_run_id"], rank == 0),
               fault_at_step=loop_config.get("fault_at_step"))


def train_one_step(run: Run, rows: list[dict], host: list[dict] | None = None) -> dict:
    """One optimiser step on this rank's rows of the global batch (in micro-batches when the job says so); the
    global metrics of the step. `host`: the rows' `host_batches` when they were prepared ahead (`prefetched`)."""
    started = time.perf_counter()
    K = run.config.ttt_steps
    micro = pad_to_every_rank(run, host_batches(run, rows) if host is None else host)
    # Every micro-batch's losses over the whole global step's position counts: the ranks' and micro-batches'
    # gradients then sum to the gradient of the global batch (see the module docstring).
    counts = all_reduce(sum(step_counts(b, K).double() for b in micro), run.device)
    for batch in micro:
        batch["step_denominators"] = (counts.clamp(min=1) / run.world).float()

    def prepare(batch: dict) -> dict:
        # On the device just before its forward, with the teacher under the objective's autocast: float32 on a CPU;
        # on CUDA the draft-vocabulary labels from bf16 inputs and the float32 argmax
        # (`eagle_core.teacher.low_precision_teacher`), as bench.ttt measures the step.
        return run.teacher(batch_to(batch, run.device, non_blocking=True), run.head)

    local = train_step(run.draft, micro, run.head, run.optimizer, run.scheduler, run.tcfg,
                       forward=lambda _draft, *a, **k: run.objective(*a, **k), prepare=prepare,
                       gradient_sync=lambda last: gradient_sync(run.objective, last))
    metrics = global_step_metrics(local, K, run.world, run.device)
    metrics["tokens_per_s"] = metrics["tokens"] / max(time.perf_counter() - started, 1e-9)
    return metrics


def rank_batches(run: Run, rows: list[dict]) -> list[dict]:
    """This rank's rows of a step (or of a held-out forward) as batches on the host, as many on every rank
    (`host_batches`, then `pad_to_every_rank`)."""
    return pad_to_every_rank(run, host_batches(run, rows))


def host_batches(run: Run, rows: list[dict]) -> list[dict]:
    """This rank's rows as batches on the host: one, or with `micro_batch_tokens` its micro-batches (conversations
    first-fit, longest first, `pack_rows`). Each is packed when the job says so, refused by name (`check_batch`:
    shapes, ids, positions, empty loss masks) before anything moves to the device, so before the step that would use
    it, and pinned for an asynchronous copy when the device is a GPU. No collective: it may run on the prefetching
    thread."""
    decoded = [decode_row(r, run.meta) for r in rows]
    lengths = [len(r["input_ids"]) for r in decoded]
    groups = [list(range(len(decoded)))]
    if run.config.micro_batch_tokens is not None:
        groups = pack_rows(lengths, run.config.micro_batch_tokens, [r.get("id") for r in decoded]) if decoded else []
    batches = []
    for group in groups:
        part = [decoded[i] for i in sorted(group)]  # read order inside a micro-batch
        batch = collate(part, run.meta, run.config.ttt_steps, torch.device("cpu"),
                        run.config.row_length([lengths[i] for i in group]))
        check_batch(run.draft, batch, run.head)
        batches.append({k: v.pin_memory() for k, v in batch.items()} if run.device.type == "cuda" else batch)
    return batches


def pad_to_every_rank(run: Run, batches: list[dict]) -> list[dict]:
    """With micro-batches, `batches` plus dummy rows (`collate([])`) up to the count of the rank with the most, so every
    rank runs the same forwards and collectives (one all-reduce); without, as they are (one each)."""
    if run.config.micro_batch_tokens is None:
        return batches
    count = int(all_reduce(torch.tensor([float(len(batches))]), run.device, op="max")[0])
    dummy = [collate([], run.meta, run.config.ttt_steps, torch.device("cpu")) for _ in range(count - len(batches))]
    return batches + dummy


def after_step(run: Run, metrics: dict, checkpoint_now: bool) -> None:
    """Log the step (MLflow every step, a progress line every `log_every`), checkpoint every `checkpoint_every`."""
    step = run.state["step"]
    metrics["epoch"] = run.state["epoch"]
    run.mlflow.log(metrics, step)
    if run.rank == 0 and (step % run.config.log_every == 0 or step == 1):
        log_step(step, run.plan.total_steps, metrics)
    if checkpoint_now and step % run.config.checkpoint_every == 0:
        save_and_report(run, {"step": step, "loss": metrics["loss"]})
    maybe_fault(run.fault_at_step, step, run.rank, run.storage_dir)


def held_out_eval(run: Run, epoch_data_wait_s: float | None = None) -> dict:
    """Evaluate the draft on this rank's held-out rows (summed over all ranks); log it with the epoch's data wait."""
    K = run.config.ttt_steps
    batches = (batch_to(b, run.device) for rows in run.batches.held_out() for b in rank_batches(run, rows))
    metrics = evaluate(run.objective, run.draft, batches, run.head, K, run.config.step_decay, run.device)
    metrics["epoch"] = run.state["epoch"]
    if epoch_data_wait_s is not None:
        metrics["epoch_data_wait_s"] = epoch_data_wait_s
    run.mlflow.log(metrics, run.state["step"])
    if run.rank == 0:
        log_held_out(run.state["step"], metrics, K)
    return metrics


def save_and_report(run: Run, metrics: dict) -> None:
    """`ray.train.report` the metrics with a checkpoint of the run (written by rank 0)."""
    import ray.train

    model, optim = full_state(run.draft, run.objective, run.optimizer, run.sharded)  # a collective under FSDP
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = None
        if run.rank == 0:
            save_checkpoint(model, optim, run.scheduler, run.state, Path(tmp))
            ckpt = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report(metrics, checkpoint=ckpt, checkpoint_dir_name=f"checkpoint-{run.state['step']:07d}")
