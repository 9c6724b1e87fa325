"""Retraining from traffic: a traffic sink's shards mixed into training, a held-out slice of them as the evaluation.

`jobs/retrain.py --traffic URL` (`RetrainConfig.traffic`) changes three things in a retraining run
(`pipelines.retrain.job`), and nothing else:

- *Training data*: the base corpus is extracted with the traffic's dtype and aux layers (`extract_overrides`: the
  two are decoded as one) into `features/rows-<rows>-traffic`, and each scale's draft (`drafts/rows-<rows>-traffic`)
  trains on two sources (`pipelines.train.config.FeatureSource`): the base corpus's features and the sink's output at
  URL (Parquet shards in the extraction's schema and manifest format).
  `traffic_ratio` is the fraction of each epoch's training rows drawn from traffic (`pipelines.train.plan.mix_rows`:
  the epoch keeps the length of both sources' rows together; traffic rows repeat when there are fewer of them than
  their share, and are subsampled, a new sample each epoch, when there are more).
- *The held-out slice*: conversations whose id hash falls below `traffic_eval_fraction`
  (`pipelines.train.plan.held_out_by_hash`) are never read by training; the first `eval_count` of them (by id hash)
  are the traffic evaluation's prompts: each row's tokens up to its last answer (the prompt the server was sent,
  chat template and generation prompt included).
- *Promotion*: candidate and champion are decoded greedily on the base evaluation set (`eval_prompts`) and on the
  held-out traffic, with one target load (`pipelines.retrain.evaluate.evaluate_draft` on the base set; on traffic its
  tau alone, `traffic_tau`; both by real decoding). The candidate takes `champion` (the same compare-and-set under
  the promotion lock, `pipelines.registry.decide_promotion`) only when its traffic tau beats the champion's by
  `margin` AND its base tau is no more than `base_margin` below the champion's (`beats_on_traffic`). Both taus are
  tagged on the version (`tau`, `traffic_tau`), logged in the MLflow child run and returned in the result.

Before any work (`check_traffic`): the base evaluation set must be one of the fixed, shipped sets that hold MT-bench
prompts (`FIXED_EVAL_SETS`: a JSONL file could be drawn from the same sink, and the promotion would then be judged
on sink data alone, which a client with the key can steer by flooding one label); the URL must hold a manifest
whose fingerprint is the target's (else FingerprintMismatch naming the fields, as training refuses features of
another target), with conversations both held out and left to train on.
"""

from __future__ import annotations

import pyarrow.parquet as pq

from pipelines.storage import exists, join, url_to_fs

TRAFFIC_SET = "traffic"  # the prompt-set name of the held-out traffic prompts (evaluate_draft's per-set tau)
# the named prompt sets (pipelines.prompt_sets) with MT-bench prompts: a retraining from traffic is judged on one
FIXED_EVAL_SETS = ("all", "mixed", "mtbench", "mtbench-turn2")


def check_traffic(config) -> dict:
    """Refuse a traffic source that cannot be trained and evaluated on (the fields named), before any work.

    Returns {"rows", "held_out", "train"}: the manifest's conversations, those held out, those left to train on."""
    from pipelines.feature_files import load_manifest
    from pipelines.train.driver import check_features_target
    from pipelines.train.plan import held_out_by_hash, scan_features

    url = config.traffic
    if not 0 <= config.traffic_ratio <= 1:
        raise ValueError(f"traffic_ratio must be in [0, 1] (the fraction of training rows drawn from traffic), "
                         f"got {config.traffic_ratio}")
    if not 0 < config.traffic_eval_fraction < 1:
        raise ValueError(f"traffic_eval_fraction must be in (0, 1), got {config.traffic_eval_fraction}")
    if config.base_margin < 0:
        raise ValueError(f"base_margin must be >= 0, got {config.base_margin}")
    if config.eval_prompts not in FIXED_EVAL_SETS:
        raise ValueError(f"--traffic {url}: eval_prompts {config.eval_prompts!r} is not a fixed evaluation set with "
                         f"MT-bench prompts ({', '.join(FIXED_EVAL_SETS)}); a retraining from traffic is judged on one "
                         "of them besides the held-out traffic, never on data from the sink alone")
    if not exists(join(url, "manifest.json")):
        raise FileNotFoundError(f"--traffic {url}: no manifest.json there; expected a traffic sink's output "
                                "(traffic_url of a deployment) that has committed at least one shard")
    manifest = load_manifest(url)
    check_features_target(url, manifest, config.target)
    ids = [r["id"] for r in scan_features(url, [s.name for s in manifest.shards])]
    held = sum(held_out_by_hash(cid, config.traffic_eval_fraction) for cid in ids)
    if held == 0:
        raise ValueError(f"--traffic {url}: none of its {len(ids)} conversations falls in the held-out slice "
                         f"(traffic_eval_fraction {config.traffic_eval_fraction}); wait for more traffic or raise it")
    if config.traffic_ratio > 0 and held == len(ids):
        raise ValueError(f"--traffic {url}: all of its {len(ids)} conversations are held out for the evaluation "
                         f"(traffic_eval_fraction {config.traffic_eval_fraction}); none is left to train on")
    return {"rows": len(ids), "held_out": held, "train": len(ids) - held}


def extract_overrides(config) -> dict:
    """The base extraction's settings that traffic fixes: its features are mixed with the traffic's, so they take the
    dtype and aux layers the server captured with (the traffic manifest's), whatever `extract` or the recipe set
    ({} without traffic). They are extracted into their own folder (`pipelines.retrain.job.features_url`)."""
    if not config.traffic:
        return {}
    from pipelines.feature_files import load_manifest

    manifest = load_manifest(config.traffic)
    return {"dtype": manifest.dtype, "aux_layer_ids": list(manifest.aux_layer_ids)}


def training_features(config, base: str) -> str | list[dict]:
    """A scale's `TrainJobConfig.features`: the base features alone, or with traffic mixed in at `traffic_ratio`
    and its held-out slice never read."""
    if not config.traffic:
        return base
    return [{"url": base, "weight": 1.0 - config.traffic_ratio},
            {"url": config.traffic, "weight": config.traffic_ratio, "holdout": config.traffic_eval_fraction}]


def answer_start(loss_mask: list[int]) -> int:
    """Where a conversation's last answer starts: the start of the loss mask's last run of 1s (the served answer;
    earlier assistant turns of a chat are earlier runs). len(mask) when the mask has no 1."""
    end = len(loss_mask)
    while end > 0 and not loss_mask[end - 1]:
        end -= 1
    start = end
    while start > 0 and loss_mask[start - 1]:
        start -= 1
    return start if end else len(loss_mask)


def traffic_prompts(url: str, fraction: float, count: int) -> list[dict]:
    """The held-out traffic's prompts as `pipelines.prompt_sets` items with token ids ({"set", "id", "ids"}): the
    first `count` held-out conversations by id hash, each cut before its last answer. Reads the manifest's shards'
    id, input_ids and loss_mask columns only."""
    from pipelines.feature_files import load_manifest
    from pipelines.train.plan import held_out_by_hash, id_hash

    fs, path = url_to_fs(join(url, "features"))
    held = []
    for shard in load_manifest(url).shards:
        with fs.open(f"{path}/{shard.name}.parquet", "rb") as f:
            table = pq.read_table(f, columns=["id", "input_ids", "loss_mask"])
        for cid, ids, mask in zip(*(table[c].to_pylist() for c in ("id", "input_ids", "loss_mask"))):
            start = answer_start(mask)
            if held_out_by_hash(cid, fraction) and 0 < start < len(ids):
                held.append({"set": TRAFFIC_SET, "id": cid, "ids": ids[:start]})
    return sorted(held, key=lambda item: id_hash(item["id"]))[:count]


def traffic_tau(target, tokenizer, draft, prompts: list[dict], config) -> float:
    """tau on the held-out traffic (`traffic_prompts`), as `pipelines.retrain.evaluate.evaluate_draft` measures its tau:
    greedy decoding with `config.eval_tree` as its auto-tune's calibration decodes (the same tree and context
    chains, `eagle_core.autotune`), without the cost measurements and timed decodes its speed-ups need."""
    from eagle_core.autotune import DEFAULT_CONTEXT_CHAINS, calibrate_acceptance
    from eagle_core.tree import TreeConfig

    full = config.eval_tree
    size = full.size
    tau, _ = calibrate_acceptance(target, draft, [item["ids"] for item in prompts],
                                  TreeConfig(full.top_k, full.depth, size), [full.depth], [size],
                                  config.eval_max_new_tokens, tokenizer.eos_token_id, DEFAULT_CONTEXT_CHAINS)
    return tau[(full.depth, size)]


def beats_on_traffic(new: dict, champion: dict, margin: float, base_margin: float) -> bool:
    """The promotion rule of a retraining from traffic: tau on held-out traffic rises by more than `margin`, and
    tau on the base evaluation set falls by no more than `base_margin`."""
    return new["traffic_tau"] > champion["traffic_tau"] + margin and new["tau"] >= champion["tau"] - base_margin


def promotion_score(config, evaluation: dict | None):
    """What `decide_promotion` compares of an evaluation (`_evaluate_drafts`' item): its tau, or with traffic
    {"tau": base tau, "traffic_tau": tau on held-out traffic}. None for no evaluation."""
    if evaluation is None:
        return None
    if not config.traffic:
        return evaluation["tau"]
    return {"tau": evaluation["tau"], "traffic_tau": evaluation[TRAFFIC_SET]["tau"]}


def promotion_rule(config):
    """`decide_promotion`'s `beats`: None (tau > champion's + margin) without traffic, else `beats_on_traffic`."""
    if not config.traffic:
        return None
    return lambda new, champion: beats_on_traffic(new, champion, config.margin, config.base_margin)


def traffic_result(config, new: dict, champion: dict | None) -> dict:
    """The traffic fields of a scale's result: the candidate's and the champion's tau on held-out traffic and how
    many prompts measured it ({} without traffic)."""
    if not config.traffic:
        return {}
    return {"traffic_tau": new[TRAFFIC_SET]["tau"], "traffic_prompts": new[TRAFFIC_SET]["prompts"],
            "champion_traffic_tau": champion[TRAFFIC_SET]["tau"] if champion else None}
