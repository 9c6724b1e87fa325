"""The draft a training run ships: the checkpoint's folder exported in the vLLM/SGLang and speculators layouts
(`export_draft`), after the serving-engine gate of the export (`export_gate`, `pipelines.serving_gate`), whose
numbers go to the training run (`log_gate`)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

from pipelines.serving_gate import ServingGateFailed
from pipelines.train.config import TrainJobConfig


def export_draft(checkpoint_draft: Path, draft_dir: Path, spec_dir: Path, target: str, gate=None):
    """The checkpoint's `save_draft` folder as-is (vLLM/SGLang layout) and re-exported in the speculators layout.

    `gate(export, checkpoint) -> GateResult` (`export_gate`): the serving-engine gate of the exported folder against
    the checkpoint's; a draft that fails it leaves neither folder behind (ServingGateFailed). Returns the gate's
    result (None without a gate)."""
    from eagle_core.checkpoint import export_speculators, load_draft

    if draft_dir.exists():
        shutil.rmtree(draft_dir)
    shutil.copytree(checkpoint_draft, draft_dir)
    result = None
    if gate is not None:  # first: it judges the folder as exported, before anything reads it
        result = gate(draft_dir, checkpoint_draft)
        if result.skipped:
            from pipelines.serving_gate import announce_skip

            announce_skip(result.skipped, f"the export of {checkpoint_draft}")
        elif result.failed:
            for folder in (draft_dir, spec_dir):
                shutil.rmtree(folder, ignore_errors=True)
            raise ServingGateFailed(result, "the export did not finish: the serving-engine gate failed")
        else:
            print(f"[train] serving gate: {result.message()}", flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # shared target embeddings are not part of either export
        draft = load_draft(draft_dir)
    export_speculators(draft, spec_dir, verifier=target)
    return result


def export_gate(config: TrainJobConfig, target: str):
    """The gate `export_draft` runs for this job (`config.serving_gate`), as a Ray task with a training worker's
    resources; None when it is off or vLLM is not installed (said loudly: `pipelines.serving_gate.announce_skip`)."""
    from pipelines.serving_gate import announce_skip, check_gate_mode, gate_on_worker

    skipped = check_gate_mode(config.serving_gate)
    if skipped:
        if config.serving_gate == "off":
            print(f"[train] serving-engine gate off: the export in {config.output} is not measured in vLLM "
                  "(--serving-gate auto|vllm measures it)", flush=True)
        else:
            announce_skip(skipped, f"the export in {config.output}")
        return None
    return lambda export, checkpoint: gate_on_worker(
        target, export, checkpoint, name=f"the export of {config.output}", mode=config.serving_gate,
        k=config.serving_gate_k, num_cpus=config.cpus_per_worker, num_gpus=1 if config.use_gpu else 0)


def log_gate(run_id: str, result) -> None:
    """The gate's numbers and verdict in the training run (tag `serving_gate`)."""
    from mlflow.tracking import MlflowClient

    from pipelines import tracking

    client = MlflowClient(tracking.tracking_uri())
    for key, value in result.metrics().items():
        client.log_metric(run_id, key, value)
    client.set_tag(run_id, "serving_gate", result.tag())
