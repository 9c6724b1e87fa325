"""The driver: prepare the data (either mode), start the TorchTrainer, then export, log and register the draft.

Resume: rerun with the same output (`resume=True`): Ray Train v2 restores the run `RunConfig(name,
storage_path)` and `ray.train.get_checkpoint()` hands the workers the latest checkpoint; a worker that
dies mid-run is restarted from it too (`max_failures`).

MLflow: params (incl. the features manifest's sha256 and extraction run id) here; per-step and held-out
metrics from rank 0 (see `loop.py`); then the exported draft (both layouts), the loss-curve and
acceptance-per-position PNGs, and a new version of `registered_model_name` with alias `candidate`.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path

from pipelines.cluster import alive_nodes
from pipelines.serving_gate import ServingGateFailed
from pipelines.storage import (arrow_filesystem, commit_json, join, local_path, pin_registry_uri, upload_folder,
                               url_to_fs)
from pipelines.train.config import TrainJobConfig, feature_sources
from pipelines.train.export import export_draft, export_gate, log_gate
from pipelines.train.faults import fault_step_from_env
from pipelines.train.lineage import Lineage
from pipelines.train.model import count_trainable, inherited_vocab, target_config, vocab_coverage, vocab_from_counts
from pipelines.train.plan import (TrainPlan, held_out_by_hash, make_plan, scan_features, split_heldout,
                                  stream_first_pass)
from pipelines.train.report import write_plots
from pipelines.train.shards import build_planned_datasets, planned_shards_config

CANDIDATE_ALIAS = "candidate"
# Below this share of the data's loss tokens, a vocabulary kept from a warm start is reported as missing much of the
# data. The shipped SmolLM2 draft's holds 0.91 of ShareGPT's, 0.75 of five European languages' (bench.traffic_loop's
# traffic) and 0.56 of six languages' with Chinese, Japanese and Russian.
LOW_VOCAB_COVERAGE = 0.85


def _files_data(config: TrainJobConfig, world: int) -> tuple[dict, TrainPlan, dict, Lineage, str]:
    """Features mode: the plan, the per-rank planned datasets, and the manifests' lineage and sizes."""
    manifests, train_rows, eval_rows, weights = files_rows(config)
    plan, train_entries, eval_entries = make_plan(train_rows, eval_rows, config, world, weights)
    per_rank = build_planned_datasets(train_entries, eval_entries)
    first = manifests[0]
    meta = {"target_hidden_size": first.target_hidden_size, "target_vocab_size": first.target_vocab_size,
            "dtype": first.dtype, "token_counts": mixed_token_counts(manifests, train_rows, weights)}
    sources = feature_sources(config.features)
    lineage = Lineage.of_features(config.features, first) if len(sources) == 1 else Lineage.of_sources(
        [s.url for s in sources], manifests)
    return meta, plan, per_rank, lineage, config.target or first.target


def files_rows(config: TrainJobConfig) -> tuple[list, list[dict], list[dict], list[float] | None]:
    """(manifests, training rows, held-out rows, weights or None) of a features-mode run, read on the driver (no Ray).

    Every source's features must be the target's (`check_features_target`) and of one shape, dtype and aux layers
    (`check_sources_agree`); a source's conversations below its `holdout` (by id hash) are dropped before anything
    else; the training run's own held-out split (`eval_fraction`) is then taken over all the sources' rows
    together. With one source the weights are None (every row once per epoch); rows carry their source's index."""
    from pipelines.feature_files import load_manifest

    sources = feature_sources(config.features)
    manifests = [load_manifest(s.url) for s in sources]
    target = config.target or manifests[0].target
    for source, manifest in zip(sources, manifests):
        check_features_target(source.url, manifest, target)
    check_sources_agree(sources, manifests)
    rows = []
    for i, (source, manifest) in enumerate(zip(sources, manifests)):
        # exactly the manifest's shards, not whatever else the folder holds
        scanned = scan_features(source.url, [s.name for s in manifest.shards])
        rows += [{**r, "source": i} for r in scanned if not held_out_by_hash(r["id"], source.holdout)]
    train_rows, eval_rows = split_heldout(rows, config.eval_fraction)
    return manifests, train_rows, eval_rows, [s.weight for s in sources] if len(sources) > 1 else None


SOURCE_SHAPE_FIELDS = ("target_hidden_size", "target_vocab_size", "aux_layer_ids", "dtype")


def check_sources_agree(sources, manifests) -> None:
    """Mixed sources are decoded as one: the same hidden size, vocabulary, aux layers and dtype as the first source's,
    or FingerprintMismatch naming the fields."""
    from pipelines.feature_files import check_fingerprint

    shape = {k: getattr(manifests[0], k) for k in SOURCE_SHAPE_FIELDS}
    for source, manifest in zip(sources[1:], manifests[1:]):
        check_fingerprint(shape, {k: getattr(manifest, k) for k in SOURCE_SHAPE_FIELDS},
                          f"the features in {source.url} (mixed with {sources[0].url})",
                          "Mix only features of one target, extracted (or captured) with the same aux layers and "
                          "dtype.")


def mixed_token_counts(manifests, train_rows: list[dict], weights: list[float] | None) -> dict[int, int]:
    """The loss-token counts the draft vocabulary is chosen from: one source's manifest counts; mixed, each source's
    scaled by how many times an epoch draws its rows on average (its share of the rows / its rows), rounded."""
    if weights is None:
        return manifests[0].token_counts
    rows = [0] * len(weights)
    for r in train_rows:
        rows[r["source"]] += 1
    counts: dict[int, float] = {}
    for manifest, weight, n in zip(manifests, weights, rows):
        scale = len(train_rows) * weight / sum(weights) / max(n, 1)
        for token, count in manifest.token_counts.items():
            counts[token] = counts.get(token, 0.0) + scale * count
    return {token: max(int(round(c)), 1) for token, c in counts.items() if c > 0}


def check_features_target(features: str, manifest, target: str) -> None:
    """Features pair only with the target they were extracted with: its weights' content hash, its config.json and
    its tokenizer now must be those the manifest recorded. A target folder updated in place (same path) would
    otherwise train old hidden states against new embeddings, lm_head and norm (or another rope_scaling); it is
    refused, naming the fields."""
    from eagle_core.target import materialize_hf_folder, weights_fingerprint
    from pipelines.feature_files import check_fingerprint, config_fingerprint, tokenizer_fingerprint

    made = manifest.fingerprint or {}
    recorded = {"target_weights_hash": made.get("target_weights_hash", manifest.target_weights_hash)}
    current = {"target_weights_hash": weights_fingerprint(target)}
    if "tokenizer_hash" in made:
        recorded["tokenizer_hash"] = made["tokenizer_hash"]
        current["tokenizer_hash"] = tokenizer_fingerprint(materialize_hf_folder(target))
    if "target_config_hash" in made:  # outputs extracted before it was recorded are refused by a rerun, not here
        recorded["target_config_hash"] = made["target_config_hash"]
        current["target_config_hash"] = config_fingerprint(materialize_hf_folder(target))
    check_fingerprint(recorded, current, f"the features in {features} (target {target})",
                      "Re-extract them with this target (jobs/extract.py --overwrite), or train with the target "
                      "they were extracted with.")


def _stream_data(config: TrainJobConfig) -> tuple[dict, TrainPlan, dict, Lineage, str]:
    """Streaming mode: a tokenising first pass for the vocabulary and step count; the feature stream itself."""
    from eagle_core.target import resolve_aux_layer_ids, resolve_dtype, weights_fingerprint
    from pipelines.extract import ExtractConfig, stream_features
    from pipelines.feature_files import DTYPE_NAMES

    # The actors' dtype is fixed here, once: the trainer must decode the streamed bytes in that dtype.
    dtype = str(config.extract.get("dtype", "auto"))
    if dtype == "auto":
        dtype = DTYPE_NAMES[resolve_dtype("auto", "cuda" if config.use_gpu else "cpu")]
    extract = ExtractConfig(**{**config.extract, "corpus": config.corpus, "target": config.target, "dtype": dtype,
                               "output": join(config.output, "stream"), "mlflow_experiment": None})
    first = stream_first_pass(config, extract)
    steps = max(first["train_tokens"] // config.tokens_per_batch, 1)
    plan = TrainPlan(mode="stream", steps_per_epoch=[steps] * config.epochs, eval_ids=first["eval_ids"],
                     tokens_per_epoch=first["train_tokens"], train_rows=first["rows"] - len(first["eval_ids"]),
                     eval_rows=len(first["eval_ids"]))
    tc = target_config(config.target)
    lineage = Lineage(target=config.target, features=f"stream:{config.corpus}",
                      target_weights_hash=weights_fingerprint(config.target),
                      aux_layer_ids=resolve_aux_layer_ids(extract.aux_layer_ids, tc.num_hidden_layers))
    meta = {"target_hidden_size": tc.hidden_size, "target_vocab_size": tc.vocab_size, "dtype": dtype,
            "token_counts": first["token_counts"]}
    return meta, plan, {"train": stream_features(extract)}, lineage, config.target


def prepare_data(config: TrainJobConfig, world: int) -> tuple[dict, TrainPlan, dict, Lineage]:
    """(meta, plan, datasets, lineage) for either mode (planned datasets as per-rank lists).

    plan.total_steps (the planned steps, capped by max_steps) drives the LR schedule."""
    meta, plan, per_rank, lineage, target = _stream_data(config) if config.streaming else _files_data(config, world)
    planned = sum(plan.steps_per_epoch)
    plan.total_steps = min(planned, config.max_steps) if config.max_steps else planned
    meta["target"] = target
    return meta, plan, per_rank, lineage


# The fields of the job that decide the trained draft (not where or how fast it trains: workers, CPUs, checkpoint
# cadence, tracking); with the data's fingerprint they make a training output's fingerprint.
TRAINING_FINGERPRINT_FIELDS = ("target", "epochs", "max_steps", "lr", "min_lr_ratio", "weight_decay", "max_grad_norm",
                               "tokens_per_batch", "ttt_steps", "step_decay", "draft_vocab_size", "lm_head_init",
                               "eval_fraction", "seed", "strategy", "init_from", "corpus", "extract")


def features_shards_digest(manifest) -> str:
    """A hash of a features manifest's exact shard list (shard names hash their rows' ids and content)."""
    import hashlib

    return hashlib.sha256("\n".join(s.name for s in manifest.shards).encode()).hexdigest()[:16]


def features_digest(features) -> str:
    """`features_shards_digest` of one features URL; of several mixed sources, a hash of each one's digest with its
    weight and holdout (a change in any of them is other training data)."""
    import hashlib

    from pipelines.feature_files import load_manifest

    if isinstance(features, str):
        return features_shards_digest(load_manifest(features))
    parts = [f"{features_shards_digest(load_manifest(s.url))}:{s.weight!r}:{s.holdout!r}"
             for s in feature_sources(features)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def training_fingerprint(config: TrainJobConfig) -> dict:
    """What made a training output: the decisive job fields, the target's weights by content and, in features
    mode, the extraction's fingerprint and the exact shard list of its manifest (a hash), in streaming mode the
    corpus files by content; a resumed or reused run is checked against them."""
    fingerprint = {k: getattr(config, k) for k in TRAINING_FINGERPRINT_FIELDS}
    if config.draft_kind != "eagle3":  # only where set: the outputs of EAGLE-3 runs keep their fingerprints
        fingerprint["draft_kind"] = config.draft_kind
    # the warm-up that takes effect: explicit steps, else the ratio (which explicit steps make irrelevant)
    fingerprint["warmup"] = ({"steps": config.warmup_steps} if config.warmup_steps is not None
                             else {"ratio": config.warmup_ratio})
    from eagle_core.target import weights_fingerprint

    if config.features is not None:
        from pipelines.feature_files import load_manifest

        manifests = [load_manifest(s.url) for s in feature_sources(config.features)]
        fingerprint["features_fingerprint"] = manifests[0].fingerprint if isinstance(config.features, str) \
            else [m.fingerprint for m in manifests]
        fingerprint["features_shards"] = features_digest(config.features)
        fingerprint["target_weights_hash"] = weights_fingerprint(config.target or manifests[0].target)
    else:  # streaming: the target and the corpus by content (the path and the URL may hold new bytes)
        from pipelines.data import corpus_fingerprint

        fingerprint["target_weights_hash"] = weights_fingerprint(config.target)
        fingerprint["corpus_files"] = corpus_fingerprint(config.corpus)
    return json.loads(json.dumps(fingerprint))  # as it reads back from JSON (tuples as lists)


def _run_state_file(config: TrainJobConfig) -> str:
    return join(config.output, "train_run.json")


def _previous_run(config: TrainJobConfig) -> dict | None:
    fs, path = url_to_fs(_run_state_file(config))
    if not fs.exists(path):
        return None
    with fs.open(path, "rt") as f:
        return json.load(f)


def _write_run_state(config: TrainJobConfig, info: dict) -> None:
    """Written whole (`commit_json`): a crash or a full disk leaves the previous state, which --resume reads."""
    commit_json(_run_state_file(config), info)


def storage_path(config: TrainJobConfig) -> str:
    """Ray Train's storage: `<output>/ray` (set explicitly: the default is ~/ray_results)."""
    out = config.output if "://" in config.output else str(Path(config.output).resolve())
    return join(out, "ray")


def _mlflow_params(config: TrainJobConfig, plan: TrainPlan, lineage: Lineage, world: int, n_trainable: int,
                   coverage: float) -> dict:
    params = {k: v for k, v in config.to_dict().items() if v is not None and k != "extract"}
    params.update({f"extract.{k}": v for k, v in config.extract.items() if v is not None})
    params.update({k: v for k, v in lineage.to_json().items() if v is not None})
    params.update(world_size=world, total_steps=plan.total_steps, steps_per_epoch=plan.steps_per_epoch[0],
                  train_rows=plan.train_rows, eval_rows=plan.eval_rows, draft_trainable_params=n_trainable,
                  draft_vocab_coverage=f"{coverage:.4f}")
    return {k: str(v)[:6000] for k, v in params.items()}


def _start_mlflow_run(config: TrainJobConfig, plan: TrainPlan, lineage: Lineage, world: int, n_trainable: int,
                      coverage: float) -> str:
    from pipelines import tracking

    with tracking.start_run(config.mlflow_experiment, run_name=config.name) as run:
        mlflow = tracking.configure()
        mlflow.log_params(_mlflow_params(config, plan, lineage, world, n_trainable, coverage))
        mlflow.set_tags({"features_manifest_sha256": lineage.features_manifest_sha256 or "",
                         "features_mlflow_run_id": lineage.features_mlflow_run_id or "",
                         "stage": "train"})
        return run.info.run_id


def _trainer(config: TrainJobConfig, loop_config: dict, data: dict):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from pipelines.train.loop import train_loop

    planned = {name: shares for name, shares in data.items() if isinstance(shares, list)}
    datasets = {name: shares[0] if isinstance(shares, list) else shares for name, shares in data.items()}
    filesystem, storage = arrow_filesystem(storage_path(config))
    resources = {"CPU": config.cpus_per_worker, **({"GPU": 1} if config.use_gpu else {})}
    return TorchTrainer(
        train_loop,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=config.num_workers, use_gpu=config.use_gpu,
                                     resources_per_worker=resources),
        run_config=RunConfig(name=config.name, storage_path=storage, storage_filesystem=filesystem,
                             checkpoint_config=CheckpointConfig(num_to_keep=config.keep_checkpoints),
                             failure_config=FailureConfig(max_failures=config.max_failures)),
        datasets=datasets,
        dataset_config=planned_shards_config(planned),
    )


def run_train(config: TrainJobConfig) -> dict:
    """Train (or resume) a draft on the connected Ray cluster; returns a summary (also `<output>/summary.json`)."""
    from pipelines import tracking

    started = time.perf_counter()
    # one version of a models:/...@alias warm start for the vocabulary here and the weights on every worker
    config = dataclasses.replace(config, init_from=pin_registry_uri(config.init_from))
    world = config.num_workers
    previous = _previous_run(config)
    if previous and not config.resume:
        raise FileExistsError(f"{config.output} already holds a training run ({previous.get('name')}); pass "
                              "--resume to continue it, or choose another --output")
    fingerprint = training_fingerprint(config)
    if previous:  # a resume continues only the run these inputs and settings started
        from pipelines.feature_files import check_fingerprint

        check_fingerprint(previous.get("fingerprint"), fingerprint, f"the training run in {config.output}",
                          "Train into another --output, or delete this one to start over.")
    if config.mlflow_experiment:
        tracking.require_shared_store(alive_nodes())
    from pipelines.serving_gate import check_gate_mode

    check_gate_mode(config.serving_gate)  # --serving-gate vllm without vLLM: refused before any work
    meta, plan, data, lineage = prepare_data(config, world)
    tconfig = target_config(meta["target"])
    counts = meta.pop("token_counts")
    d2t = inherited_vocab(config.init_from, tconfig, config.draft_vocab_size) if config.init_from else None
    inherited = d2t is not None
    if d2t is None:
        d2t, _ = vocab_from_counts(counts, tconfig.vocab_size, config.draft_vocab_size)
    coverage = vocab_coverage(counts, d2t)
    if inherited and coverage < LOW_VOCAB_COVERAGE:
        print(f"[train] the draft vocabulary kept from the warm start ({config.init_from}) holds {coverage:.0%} of this "
              "data's loss tokens; the draft never proposes the rest. A shift into new tokens (another language, "
              "say) needs a larger draft_vocab_size or a fresh vocabulary (no warm start)", flush=True)
    run_id = (previous or {}).get("mlflow_run_id")
    if config.mlflow_experiment and run_id is None:
        run_id = _start_mlflow_run(config, plan, lineage, world, count_trainable(config, tconfig), coverage)
    _write_run_state(config, {"name": config.name, "mlflow_run_id": run_id, "num_workers": world,
                              "fingerprint": fingerprint})
    lineage.train_mlflow_run_id = run_id
    loop_config = {"job": config.to_dict(), "meta": meta, "plan": plan.to_json(), "d2t": d2t.tolist(),
                   "target": meta["target"], "lineage": lineage.to_json(), "mlflow_run_id": run_id,
                   "tracking_uri": tracking.tracking_uri(),  # warm starts from models:/ URIs need it too
                   "storage_dir": join(storage_path(config), config.name),
                   "fault_at_step": fault_step_from_env()}  # tests only (faults.py)
    result = _trainer(config, loop_config, data).fit()
    summary = finish_run(config, result, run_id, meta["target"])
    summary.update(seconds=time.perf_counter() - started, total_steps=plan.total_steps, train_rows=plan.train_rows,
                   draft_vocab_coverage=round(coverage, 4), draft_vocab_inherited=inherited,
                   eval_rows=plan.eval_rows, mlflow_run_id=run_id, lineage=lineage.to_json(), world_size=world,
                   fingerprint=fingerprint)
    # written whole: retraining reuses a scale whose summary.json exists, so it must never be half a file
    commit_json(join(config.output, "summary.json"), summary, default=str)
    return summary


def finish_run(config: TrainJobConfig, result, run_id: str | None, target: str) -> dict:
    """Export the last checkpoint's draft (both layouts) to `<output>/draft` and `<output>/draft-speculators`
    (any fsspec URL: an object-store output is staged locally and uploaded), log it with the plots, register
    a version."""
    from pipelines import tracking

    if result.checkpoint is None:
        raise RuntimeError(f"training produced no checkpoint: {result.error}")
    gate = export_gate(config, target)
    with tempfile.TemporaryDirectory() as staging, result.checkpoint.as_directory() as ckpt:
        draft_dir, spec_dir = Path(staging) / "draft", Path(staging) / "draft-speculators"
        state = json.loads((Path(ckpt) / "state.json").read_text())
        try:
            gated = export_draft(Path(ckpt) / "draft", draft_dir, spec_dir, target, gate=gate)
        except ServingGateFailed as err:
            if run_id:
                tracking.retrying(lambda: log_gate(run_id, err.result), f"logging the serving gate of run {run_id}")
            raise
        if gated is not None and run_id:
            tracking.retrying(lambda: log_gate(run_id, gated), f"logging the serving gate of run {run_id}")
        # exported beside, then swapped in whole: a crash never leaves the output without a whole draft
        for folder in (draft_dir, spec_dir):
            upload_folder(folder, join(config.output, folder.name))
        draft_url, spec_url = join(config.output, "draft"), join(config.output, "draft-speculators")
        summary = {"step": state["step"], "restored_from": state.get("restored_from", []),
                   "serving_gate": gated.to_dict() if gated is not None else None,
                   "checkpoint": _checkpoint_url(config, result.checkpoint.path), "draft": draft_url, "draft_speculators": spec_url,
                   "metrics": {k: v for k, v in (result.metrics or {}).items() if isinstance(v, (int, float))}}
        if run_id:  # hours of training are not lost to a tracking server that blinks now: wait for it
            summary.update(tracking.retrying(lambda: _log_and_register(config, run_id, draft_dir, spec_dir,
                                                                       state["step"]),
                                             f"logging and registering the draft of run {run_id}"))
    return summary


def _checkpoint_url(config: TrainJobConfig, path: str) -> str:
    """Ray Train reports the checkpoint's path on its storage filesystem: a URL again for an object store."""
    return path if local_path(config.output) is not None else url_to_fs(config.output)[0].unstrip_protocol(path)


def _log_and_register(config: TrainJobConfig, run_id: str, draft_dir: Path, spec_dir: Path, step: int) -> dict:
    from pipelines import tracking

    mlflow = tracking.configure()
    with tracking.start_run(config.mlflow_experiment, run_id=run_id):
        mlflow.log_artifacts(str(draft_dir), "draft")
        mlflow.log_artifacts(str(spec_dir), "draft-speculators")
        with tempfile.TemporaryDirectory() as tmp:
            for path in write_plots(mlflow.tracking.MlflowClient(), run_id, config.ttt_steps, Path(tmp)):
                mlflow.log_artifact(str(path), "plots")
        mlflow.log_metric("final_step", step)
        if config.registered_model_name:  # a retry finds the version a failed attempt registered (by digest)
            version = tracking.register_artifact(run_id, "draft", config.registered_model_name, CANDIDATE_ALIAS,
                                                 digest=tracking.folder_digest(draft_dir))
            return {"registered_model": config.registered_model_name, "model_version": version}
    return {}
