"""Ray Train job: EAGLE-3 training-time-test (TTT) training of the draft, with checkpoints, resume and MLflow.

    features (an extraction output, several mixed by weight, or a stream) -> TorchTrainer workers -> draft
    -> export + registry

One concern a module:
    config.py       TrainJobConfig (also the CLI and the MLflow params)
    plan.py         driver: `TrainPlan`, held-out split, sources mixed by weight, epoch order, global batches, rank
                    shares; streaming first pass
    shards.py       driver: each rank's planned rows as a Ray Dataset, routed to it by name (`PlannedShards`)
    batches.py      worker: the `Batches` interface (planned files / streamed), row decoding and padding
    lineage.py      `Lineage`: where a draft comes from (its config.json, the MLflow params, summary.json)
    model.py        worker: target heads, the draft (built, warm-started), the TTT objective under DDP/FSDP
    collectives.py  worker: `all_reduce` on the training device (nccl has no CPU path)
    metrics.py      worker: a step's global metrics, the held-out evaluation
    checkpoint.py   worker: write and restore checkpoints (draft, trainer state, data position)
    loop.py         worker: `train_loop`, the TorchTrainer's per-worker function
    report.py       progress lines, per-step MLflow metrics, the plots
    driver.py       `run_train`: prepare the data, run the TorchTrainer, export, log and register the draft
    faults.py       tests only: kill a worker after a given step (EAGLE3_TRAIN_FAULT_AT_STEP)

Importing the package imports none of them: the names below load their module on first use (PEP 562), so a
Ray Data read task that unpickles `shards.read_planned_rows` imports pyarrow and fsspec, not torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "batches": ["collate", "decode_row"],
    "checkpoint": ["full_state"],
    "collectives": ["all_reduce"],
    "config": ["LM_HEAD_INITS", "STRATEGIES", "FeatureSource", "TrainJobConfig", "feature_sources"],
    "driver": ["CANDIDATE_ALIAS", "prepare_data", "run_train"],
    "lineage": ["Lineage"],
    "metrics": ["evaluate"],
    "model": ["TTTObjective", "build_draft", "inherited_vocab", "load_target_heads", "target_config", "vocab_from_counts", "warm_start",
              "wrap_objective"],
    "plan": ["TrainPlan", "epoch_order", "held_out_by_hash", "mix_rows", "pack_batches", "plan_steps", "scan_features",
             "split_heldout"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
