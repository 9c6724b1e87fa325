"""Retraining at growing data scales: extract what is new -> train -> evaluate by real decoding -> promote.

Each scale is a prefix of the corpus (a row count, or a fraction of the corpus). Its extraction output
reuses every shard an earlier scale already committed (shard k of a prefix is shard k of the whole), so a
larger scale only regenerates and extracts the rows it adds; a scale whose draft was already trained
skips training. Evaluation (pipelines/retrain/evaluate.py) decodes held-out prompts with the new draft and with the
current champion; the new version takes alias `champion` only when its tau beats the champion's by `margin`,
otherwise it stays `candidate`. One MLflow parent run per invocation, one child run per scale, and the
tau-vs-data-scale curve (EAGLE-3's scaling property, for this target) as a plot on the parent. With `traffic` the
drafts also train on served traffic and are compared on its held-out slice too (pipelines/retrain/traffic.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace

from eagle_core.tree import TreeConfig
from pipelines.registry import (CANDIDATE, CHAMPION, TAU_DTYPE_TAG, PromotionConflict,  # noqa: F401 (re-exported)
                                PromotionLease, alias_version, client as registry_client, decide_promotion,
                                register_draft_folder, rollback)
from pipelines.retrain.evaluate import check_eval_prompts, evaluate_on_worker
from pipelines.retrain.traffic import (check_traffic, extract_overrides, promotion_rule, promotion_score,
                                       traffic_result, training_features)
from pipelines.storage import exists, join, read_bytes


@dataclass
class RetrainConfig:
    corpus: str = "sharegpt"
    scales: list[float] = field(default_factory=lambda: [0.5, 1.0])  # <= 1: fraction of corpus_rows; > 1: rows
    corpus_rows: int | None = None  # rows a fraction refers to (None: every row of the corpus)
    work: str = "work/retrain"
    target: str = "smollm2-135m"
    registered_model: str = "eagle3-draft"
    # a named prompt set of pipelines.prompt_sets or a JSONL file of {"prompt"|"messages"}; "all" spreads the
    # evaluation over MT-bench turns 1 and 2, HumanEval and long contexts, so promotion compares on a mix
    eval_prompts: str = "all"
    eval_count: int = 8  # held-out prompts decoded per evaluation
    eval_max_new_tokens: int = 64
    eval_tree: TreeConfig = field(default_factory=TreeConfig)  # the decoding tree of the evaluation
    margin: float = 0.05  # tau the new draft must gain over the champion to replace it (on traffic, with `traffic`)
    # Retraining from traffic (pipelines/retrain/traffic.py): a traffic sink's output mixed into training, its
    # held-out slice (by conversation id hash) decoded as a second evaluation set beside eval_prompts
    traffic: str | None = None
    traffic_ratio: float = 0.5  # the fraction of each epoch's training rows drawn from traffic
    traffic_eval_fraction: float = 0.1  # the traffic conversations never trained on; eval_count of them decoded
    base_margin: float = 0.1  # with traffic: tau on eval_prompts may fall by at most this for a promotion
    warm_start: bool = True  # initialise from the current champion when its shapes fit
    # learning rate of a warm-started candidate unless `train` sets one: fine-tuning takes a smaller step than
    # training from scratch (the recipe's lr); the shipped draft's warm-started runs used 2e-4 and 3e-4
    warm_start_lr: float = 2e-4
    extract: dict = field(default_factory=dict)  # ExtractConfig overrides (regenerate, max_length, ...)
    train: dict = field(default_factory=dict)  # TrainJobConfig overrides (epochs, lr, num_workers, ...)
    mlflow_experiment: str = "eagle3-retrain"
    # Evaluation runs as a Ray task on a worker holding the target's resources, never on the driver (a cluster's
    # head has no GPU and little memory). None GPUs: 1 when the cluster has GPUs, else 0.
    eval_cpus: float = 1.0
    eval_gpus: float | None = None
    # The promotion lock (pipelines.registry.PromotionLease): its lease, renewed while held, and how long to wait
    # for another driver's decision before giving up.
    lock_ttl_s: float = 600.0
    lock_wait_s: float = 3600.0
    # The champion's re-evaluation under the lock reports progress per prompt (the lease lapses after lock_ttl_s
    # without any, so a hung evaluation loses the lock) and is cancelled after eval_timeout_s: the decision then
    # fails with nothing changed. lock_ttl_s must exceed the evaluation's longest silent phase (the target's load).
    eval_timeout_s: float = 3600.0
    # The serving-engine gate (pipelines/serving_gate.py): the evaluation also decodes its prompts with each draft in
    # vLLM and with our decoder's chain of the same depth; a candidate whose acceptance length in vLLM is below 0.9x
    # ours, or whose export is not the draft as trained, is never promoted. "auto": where vLLM is installed and
    # loads the target (else said loudly, and tagged on the run, that it was skipped); "vllm": measure or fail;
    # "off". The depth: serving_gate_k, else each draft's TTT depth (ttt_steps; the recipe's for a candidate).
    serving_gate: str = "auto"
    serving_gate_k: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def scale_rows(scale: float, corpus_rows: int) -> int:
    rows = int(round(scale * corpus_rows)) if scale <= 1 else int(scale)
    if rows < 1:
        raise ValueError(f"scale {scale} selects no rows of a {corpus_rows}-row corpus")
    return rows


def count_corpus_rows(corpus: str) -> int:
    from pipelines.data import ingest

    return ingest(corpus).stats.read


# --------------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------------

def scale_folder(config: RetrainConfig, rows: int) -> str:
    """A scale's folder name under `features/` and `drafts/`: `rows-<rows>`, `rows-<rows>-traffic` with traffic
    (`extract_overrides`: its own dtype and aux layers, which an extraction output's fingerprint would refuse in the
    plain folder; its draft trains on other data)."""
    return f"rows-{rows}" + ("-traffic" if config.traffic else "")


def features_url(config: RetrainConfig, rows: int) -> str:
    """Where a scale's features are extracted."""
    return join(config.work, "features", scale_folder(config, rows))


def _extract_scale(config: RetrainConfig, rows: int, earlier: list[str]):
    from pipelines.extract import ExtractConfig, run_extract

    extract = ExtractConfig(**{**config.extract, **extract_overrides(config), "corpus": config.corpus,
                               "target": config.target, "limit": rows,
                               "output": features_url(config, rows),
                               "reuse_from": [*config.extract.get("reuse_from", []), *earlier],
                               "mlflow_experiment": config.extract.get("mlflow_experiment")})
    return run_extract(extract)


def _train_scale(config: RetrainConfig, rows: int, features: str, init_from: str | None) -> dict:
    """Train the scale's draft, or return the summary of the one trained by an earlier invocation."""
    from pipelines.train import run_train

    output = draft_output(config, rows, features)
    summary = join(output, "summary.json")
    if exists(summary):
        done = json.loads(read_bytes(summary))
        _check_trained(config, rows, features, done.get("fingerprint"), output)
        return done
    return run_train(_scale_job(config, rows, features, init_from, output))


def draft_output(config: RetrainConfig, rows: int, features: str | list) -> str:
    """Where the scale's draft is trained: `drafts/rows-<rows>`, unless a draft of other features was trained (or
    started) there. Then the corpus was edited in place since (the features' shard names hash their rows'
    content, so the shard list changed), and the new features are trained in `drafts/rows-<rows>-<shard-list
    hash>` rather than refused; every other difference is still refused by `_check_trained`."""
    from pipelines.train.driver import features_digest

    base = join(config.work, "drafts", scale_folder(config, rows))
    recorded = None
    for name in ("summary.json", "train_run.json"):  # a finished run, else one started
        if exists(join(base, name)):
            recorded = json.loads(read_bytes(join(base, name))).get("fingerprint") or {}
            break
    if recorded is None or recorded.get("features_shards") is None:
        return base  # nothing trained there yet (or by a version that did not record it: checked as before)
    shards = features_digest(features)
    return base if recorded["features_shards"] == shards else f"{base}-{shards}"


def _scale_job(config: RetrainConfig, rows: int, features: str, init_from: str | None, output: str):
    from pipelines.train import TrainJobConfig

    # the export is gated at the promotion (beside the champion), not once more in training
    overrides = {"serving_gate": "off", **config.train, "features": features, "target": config.target,
                 "output": output, "registered_model_name": config.registered_model, "resume": True}
    if init_from:
        overrides["init_from"] = init_from
        overrides.setdefault("lr", config.warm_start_lr)
    return TrainJobConfig(**overrides)


def _check_trained(config: RetrainConfig, rows: int, features: str, recorded: dict | None, output: str) -> None:
    """A scale trained by an earlier invocation is reused only if the same data and settings made it, given the
    warm start it had (the champion it started from has usually been replaced since, often by this very draft,
    and a warm start also sets the learning rate)."""
    from pipelines.feature_files import check_fingerprint
    from pipelines.train.driver import training_fingerprint

    started_from = (recorded or {}).get("init_from")
    check_fingerprint(recorded, training_fingerprint(_scale_job(config, rows, features, started_from, output)),
                      f"the draft trained in {output}",
                      "Retrain into another --work, or delete that scale's drafts folder to train it again.")


def _plot_scaling(points: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs = [p["rows"] for p in points]
    ax.plot(xs, [p["tau"] for p in points], "o-", label="new draft")
    ax.set_xscale("log")
    ax.set_xlabel("training conversations")
    ax.set_ylabel("mean accept length tau (greedy)")
    ax.set_title("EAGLE-3 scaling: acceptance vs data")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _scale_step(config: RetrainConfig, rows: int, earlier: list[str]) -> dict:
    manifest = _extract_scale(config, rows, earlier)
    features = features_url(config, rows)
    earlier.append(features)
    champion = alias_version(config.registered_model, CHAMPION)
    # the champion by its registry URI: train workers on any node fetch it through the tracking server
    champion_uri = f"models:/{config.registered_model}/{champion.version}" if champion else None
    trained = _train_scale(config, rows, training_features(config, features),
                           champion_uri if config.warm_start else None)
    version = trained["model_version"]
    sources = {"new": f"models:/{config.registered_model}/{version}"}
    if champion is not None and str(champion.version) != str(version):  # a rerun re-evaluates the champion alone
        sources["champion"] = champion_uri
    # the serving gate's "draft as trained": the training run's last checkpoint (the registered folder is its export)
    references = {"new": join(trained["checkpoint"], "draft")} if trained.get("checkpoint") else None
    evals = evaluate_on_worker(config, sources, references=references)
    new, champion_eval = evals["new"], evals.get("champion")
    if (champion_eval or {}).get("serving_gate"):
        from pipelines.serving_gate import GateResult

        tag_gate(config.registered_model, champion.version, GateResult.from_dict(champion_eval["serving_gate"]))
    observed = None if champion is None else str(champion.version)
    decision, champion_eval = promote(config, version, new, champion_eval, observed)
    promoted = decision.promoted
    if decision.champion_version in (None, str(version)):
        champion_eval = None
    return {"rows": rows, "version": int(version), "promoted": promoted, "tau": new["tau"],
            "tokens_per_s": new["tokens_per_s"], "plain_tokens_per_s": new["plain_tokens_per_s"],
            "tree_tau_by_set": new["tree_tau_by_set"],
            "speedup": new["speedup"], "tree_speedup": new["tree_speedup"], "tuned_tree": new["tuned_tree"],
            "champion_tau": champion_eval["tau"] if champion_eval else None,
            "champion_speedup": champion_eval["speedup"] if champion_eval else None,
            "champion_tree_speedup": champion_eval["tree_speedup"] if champion_eval else None,
            "champion_tuned_tree": champion_eval["tuned_tree"] if champion_eval else None,
            "champion_version": int(decision.champion_version) if decision.champion_version else None,
            "champion_moved": decision.moved,
            "reused_shards": len(manifest.reused_shards), "shards": len(manifest.shards),
            "train_run_id": trained.get("mlflow_run_id"), "features": features, "draft": trained["draft"],
            "serving_gate": new.get("serving_gate"),
            "champion_serving_gate": (evals.get("champion") or {}).get("serving_gate"),
            **traffic_result(config, new, champion_eval)}


@dataclass
class GateRefusal:
    """What `promote` returns when the serving gate refuses the candidate: no decision was attempted."""

    champion_version: str | None
    promoted: bool = False
    moved: int = 0


def promote(config: RetrainConfig, version, new: dict, champion_eval: dict | None, observed: str | None):
    """The promotion decision for the evaluated `version`: refused outright when its serving-engine gate failed
    (`new["serving_gate"]`: the version stays `candidate`, tagged with the gate's verdict, and the message is
    printed), else the compare-and-set under the promotion lock (`decide_promotion`). Returns (decision, the
    champion's evaluation: a moved champion's is measured again, under the lock, without the gate)."""
    from pipelines.serving_gate import GateResult

    gate = GateResult.from_dict(new["serving_gate"]) if new.get("serving_gate") else None
    if gate is not None:
        tag_gate(config.registered_model, version, gate)
    if gate is not None and gate.failed:
        print(f"[retrain] serving gate: version {version} is NOT promoted: {gate.message()}", flush=True)
        return GateRefusal(observed), champion_eval
    if gate is not None:
        print(f"[retrain] serving gate: version {version}: " + (
            f"WARNING: not measured in vLLM: {gate.skipped}" if gate.skipped else gate.message()), flush=True)
    champion_gate = (champion_eval or {}).get("serving_gate")
    if champion_gate and GateResult.from_dict(champion_gate).failed:  # said, not acted on: it is already served
        print(f"[retrain] serving gate: note: the champion (version {observed}) itself fails the gate: "
              f"{GateResult.from_dict(champion_gate).message()}", flush=True)
    lease = PromotionLease(config.registered_model, ttl_s=config.lock_ttl_s, wait_s=config.lock_wait_s)
    ungated = replace(config, serving_gate="off")

    def evaluate_champion(moved_to: str):  # the champion moved since: compare with the new one (under the lock:
        nonlocal champion_eval  # it reports progress to the lease and has a deadline)
        champion_eval = evaluate_on_worker(ungated, {"champion": f"models:/{config.registered_model}/{moved_to}"},
                                           lease=lease, timeout_s=config.eval_timeout_s)["champion"]
        return promotion_score(config, champion_eval)

    decision = decide_promotion(config.registered_model, version, promotion_score(config, new), observed,
                                promotion_score(config, champion_eval), config.margin, evaluate_champion, lease,
                                beats=promotion_rule(config), tags={TAU_DTYPE_TAG: new["dtype"]})
    return decision, champion_eval


def tag_gate(name: str, version, gate) -> None:
    """The serving gate's verdict on the version (`eagle3.serving_gate`) and, where measured, its acceptance length in
    vLLM (`vllm_spec.ACCEPTANCE_TAG`: what a vLLM replica's drift rule compares its window with)."""
    from pipelines.engines.vllm_spec import ACCEPTANCE_TAG

    c = registry_client()
    c.set_model_version_tag(name, str(version), "eagle3.serving_gate", gate.tag())
    if gate.vllm_acceptance_length is not None:
        c.set_model_version_tag(name, str(version), ACCEPTANCE_TAG, f"{gate.vllm_acceptance_length:.4f}")


def log_gates(client, run_id: str, result: dict) -> None:
    """The serving gate's numbers for the candidate (`serving_gate/...`) and the champion
    (`champion_serving_gate/...`) in a scale's child run, and each verdict as a tag."""
    from pipelines.serving_gate import GateResult

    for key in ("serving_gate", "champion_serving_gate"):
        if result.get(key):
            gate = GateResult.from_dict(result[key])
            for name, value in gate.metrics(f"{key}/").items():
                client.log_metric(run_id, name, value)
            client.set_tag(run_id, key, gate.tag())


def run_retrain(config: RetrainConfig) -> dict:
    """Run every scale in ascending order; returns {"parent_run_id", "scales": [per-scale results]}.

    Runs are created through the client, not `mlflow.start_run`, so the extraction and training stages can
    open their own runs while the parent and child runs are open.
    """
    import tempfile

    from pipelines import tracking

    # Before any work: a registry that does not answer raises here (RegistryUnavailable names the server),
    # rather than after hours of extraction and training.
    alias_version(config.registered_model, CHAMPION)
    corpus_rows = config.corpus_rows or (count_corpus_rows(config.corpus) if any(s <= 1 for s in config.scales) else 0)
    scales = sorted({scale_rows(s, corpus_rows) for s in config.scales})
    check_eval_prompts(config.eval_prompts)
    if config.traffic:  # a traffic URL without a manifest, or of another target, is refused before any work
        check_traffic(config)
    from pipelines.serving_gate import announce_skip, check_gate_mode

    gate_skipped = check_gate_mode(config.serving_gate)  # "vllm" without vLLM: refused here
    if config.serving_gate == "off":
        print("[retrain] serving gate off: candidates are promoted on their tau alone, never measured in vLLM "
              "(--serving-gate auto|vllm)", flush=True)
    elif gate_skipped:
        announce_skip(gate_skipped, "retraining's promotion", stage="retrain")
    client = registry_client()
    experiment_id = tracking.ensure_experiment(config.mlflow_experiment)
    parent = client.create_run(experiment_id, run_name="retrain").info.run_id
    for key, value in config.to_dict().items():
        if value is not None:
            client.log_param(parent, key, json.dumps(value) if isinstance(value, (list, dict)) else value)
    client.set_tag(parent, "serving_gate", f"skipped: {gate_skipped}" if gate_skipped else config.serving_gate)
    results, earlier = [], []
    for rows in scales:
        child = client.create_run(experiment_id, run_name=f"scale-{rows}",
                                  tags={"mlflow.parentRunId": parent}).info.run_id
        result = _scale_step(config, rows, earlier)
        result["child_run_id"] = child
        for key in ("rows", "version", "reused_shards", "train_run_id", "features", "draft"):
            client.log_param(child, key, result[key])
        for key in ("tau", "tokens_per_s", "plain_tokens_per_s", "speedup", "shards", "champion_tau", "traffic_tau",
                    "champion_traffic_tau"):
            if result.get(key) is not None:  # the champion's taus: when there was one; traffic taus: with traffic
                client.log_metric(child, key, float(result[key]))
        client.log_metric(child, "promoted", float(result["promoted"]))
        log_gates(client, child, result)
        for name, tau in result["tree_tau_by_set"].items():
            client.log_metric(child, f"tree_tau/{name}", tau)
        client.log_metric(parent, "tau", result["tau"], step=rows)
        client.set_terminated(child)
        results.append(result)
        print(f"[retrain] {rows} rows: tau {result['tau']:.2f} (champion tau "
              f"{'-' if result['champion_tau'] is None else round(result['champion_tau'], 2)}), "
              f"{'champion' if result['promoted'] else 'candidate'}; reused {result['reused_shards']}/"
              f"{result['shards']} shards", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        plot = os.path.join(tmp, "tau_vs_data_scale.png")
        _plot_scaling(results, plot)
        client.log_artifact(parent, plot)
        with open(os.path.join(tmp, "scaling.json"), "w") as f:
            json.dump({"scales": results}, f, indent=1)
        client.log_artifact(parent, os.path.join(tmp, "scaling.json"))
    client.set_terminated(parent)
    return {"parent_run_id": parent, "scales": results}
