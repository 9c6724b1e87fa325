"""Ray Train job: EAGLE-3 training-time-test (TTT) training of the draft, with checkpoints, resume and MLflow.

    features (an extraction output, or a stream of them) -> TorchTrainer workers -> draft -> export + registry

One concern a module:
    config.py       TrainJobConfig (also the CLI and the MLflow params)
    plan.py         driver: held-out split, epoch order, global batches, rank shares; the streaming first pass
    shards.py       driver: each rank's planned rows as a Ray Dataset, routed to it by name (`PlannedShards`)
    batches.py      worker: the `Batches` interface (planned files / streamed), row decoding and padding
    model.py        worker: target heads, the draft (built, warm-started), the TTT objective under DDP/FSDP
    collectives.py  worker: `all_reduce` on the training device (nccl has no CPU path)
    metrics.py      worker: a step's global metrics, the held-out evaluation
    checkpoint.py   worker: write and restore checkpoints (draft, trainer state, data position)
    loop.py         worker: `train_loop`, the TorchTrainer's per-worker function
    report.py       progress lines, per-step MLflow metrics, the plots
    driver.py       `run_train`: prepare the data, run the TorchTrainer, export, log and register the draft
    faults.py       tests only: kill a worker after a given step (EAGLE3_TRAIN_FAULT_AT_STEP)
"""

from pipelines.train.batches import collate, decode_row, step_counts
from pipelines.train.checkpoint import full_state
from pipelines.train.collectives import all_reduce
from pipelines.train.config import LM_HEAD_INITS, STRATEGIES, TrainJobConfig
from pipelines.train.driver import CANDIDATE_ALIAS, prepare_data, run_train
from pipelines.train.metrics import evaluate
from pipelines.train.model import (
    TTTObjective,
    build_draft,
    load_target_heads,
    target_config,
    vocab_from_counts,
    warm_start,
    wrap_objective,
)
from pipelines.train.plan import epoch_order, pack_batches, plan_steps, scan_features, split_heldout

__all__ = [
    "CANDIDATE_ALIAS", "LM_HEAD_INITS", "STRATEGIES", "TTTObjective", "TrainJobConfig", "all_reduce", "build_draft",
    "collate", "decode_row", "epoch_order", "evaluate", "full_state", "load_target_heads", "pack_batches",
    "plan_steps", "prepare_data", "run_train", "scan_features", "split_heldout", "step_counts", "target_config",
    "vocab_from_counts", "warm_start", "wrap_objective",
]
