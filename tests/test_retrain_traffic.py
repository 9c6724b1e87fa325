"""Retraining from traffic (`pipelines.retrain.traffic`, `jobs/retrain.py --traffic`): the mix, the held-out slice,
the refusals and the promotion rule, tested on their functions (no Ray run: the planning and the decision are
what decides which rows train and which version serves).

Properties (the mix itself: tests/test_train_sources.py): each epoch draws the stated fraction of its training rows
from traffic's real shards; a traffic conversation in the held-out slice never reaches training (neither an epoch
nor the training run's own held-out split) and its served prompt is an evaluation prompt; traffic without a
manifest, or captured for another target, is refused naming the fields; the candidate is promoted through the
compare-and-set only when tau on traffic rises by the margin and tau on the base set falls by no more than
base_margin, with both taus tagged on the version.
"""

import json
import os
from types import SimpleNamespace

import pytest
import torch

from pipelines.retrain import RetrainConfig
from pipelines.feature_files import load_manifest
from pipelines.retrain.traffic import (answer_start, beats_on_traffic, check_traffic, extract_overrides, promotion_rule,
                                       traffic_prompts, training_features)
from pipelines.train.config import TrainJobConfig
from pipelines.train.plan import held_out_by_hash, make_plan


def test_a_traffic_rows_prompt_ends_where_its_last_answer_starts():
    assert answer_start([0, 0, 1, 1, 0, 0, 1, 1, 1]) == 6  # an earlier assistant turn of the chat is not the answer
    assert answer_start([0, 1, 1, 0]) == 1 and answer_start([0, 0]) == 2


def write_traffic(url: str, target_dir, tokenizer, n: int, prefix: str, fingerprint=None, target_config=None):
    """A traffic sink's output of `n` conversations (ids and mask only: planning reads no hidden state); returns
    {id: (prompt ids, answer ids)}."""
    from pipelines.traffic import TrafficSink
    from pipelines.traffic_config import TrafficConfig

    sink = TrafficSink(TrafficConfig(url=url, target=str(target_dir), features=False, rows_per_shard=16),
                       tokenizer=tokenizer, dtype=torch.float32, start=False, fingerprint=fingerprint,
                       target_config=target_config)
    served = {}
    for i in range(n):
        prompt, answer = [1, 100 + i % 50, 200 + i % 7, 2], [300 + i % 11, 301, 2]
        assert sink.record(prompt, answer, request_id=f"{prefix}{i}")
        served[f"{prefix}{i}"] = (prompt, answer)
    sink.close()
    assert sink.stats()["rows"] == n, sink.stats()
    return served


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, tiny_target_dir, smollm2_tokenizer):
    folder = tmp_path_factory.mktemp("traffic-retrain")
    base, traffic = str(folder / "base"), str(folder / "traffic")
    write_traffic(base, tiny_target_dir, smollm2_tokenizer, 30, "base-")
    served = write_traffic(traffic, tiny_target_dir, smollm2_tokenizer, 60, "t-")
    return SimpleNamespace(base=base, traffic=traffic, served=served, folder=folder)


def test_held_out_traffic_never_trains_and_its_prompts_are_the_evaluation(outputs, tiny_target_dir):
    from pipelines.train.driver import files_rows

    # traffic is 60% of the rows left to train on: at a ratio of 0.7 every one of them is drawn in every epoch
    retrain = RetrainConfig(traffic=outputs.traffic, traffic_ratio=0.7, traffic_eval_fraction=0.25, eval_count=5,
                            target=str(tiny_target_dir))
    assert check_traffic(retrain)["held_out"] == sum(held_out_by_hash(c, 0.25) for c in outputs.served)
    # the base corpus is extracted as the server captured: the two sources are decoded as one
    traffic_manifest = load_manifest(outputs.traffic)
    assert extract_overrides(retrain) == {"dtype": "float32", "aux_layer_ids": traffic_manifest.aux_layer_ids}
    assert extract_overrides(RetrainConfig()) == {}
    job = TrainJobConfig(features=training_features(retrain, outputs.base), target=str(tiny_target_dir), epochs=4,
                         eval_fraction=0.2, tokens_per_batch=40)
    _, train_rows, eval_rows, weights = files_rows(job)
    assert weights == pytest.approx([0.3, 0.7])
    held = {c for c in outputs.served if held_out_by_hash(c, 0.25)}
    assert 5 <= len(held) < 60
    id_of = {(r["file"], r["row"]): r["id"] for r in train_rows + eval_rows}
    _, epochs, evals = make_plan(train_rows, eval_rows, job, world=2, weights=weights)
    trained = {id_of[(x["file"], x["row"])] for per_rank in epochs for rank in per_rank for x in rank}
    assert not trained & held and not {r["id"] for r in eval_rows} & held
    for per_rank in epochs:  # the ratio, from real shards; every traffic row not held out is trained on
        drawn = [id_of[(x["file"], x["row"])] for rank in per_rank for x in rank]
        assert sum(c.startswith("t-") for c in drawn) == round(len(drawn) * 0.7)
        assert set(drawn) >= {c for c in outputs.served if c not in held and c not in {r["id"] for r in eval_rows}}

    prompts = traffic_prompts(outputs.traffic, 0.25, 5)
    assert len(prompts) == 5 and {p["id"] for p in prompts} <= held
    for p in prompts:  # the prompt the server was sent, not the answer
        assert p["ids"] == outputs.served[p["id"]][0] and p["set"] == "traffic"


def test_traffic_without_a_manifest_or_of_another_target_is_refused(outputs, tiny_target_dir, smollm2_tokenizer):
    from pipelines.feature_files import FingerprintMismatch

    config = dict(target=str(tiny_target_dir), traffic_eval_fraction=0.25)
    empty = outputs.folder / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        check_traffic(RetrainConfig(traffic=str(empty), **config))
    other = str(outputs.folder / "other-target")
    fingerprint = {"target_weights_hash": "another", "tokenizer_hash": "another-tok", "max_length": 64,
                   "dtype": "float32", "aux_layer_ids": [1, 2, 2], "regeneration": {"with": "serve"},
                   "corpus": "traffic"}
    write_traffic(other, "another-model", smollm2_tokenizer, 8, "o-", fingerprint=fingerprint,
                  target_config=SimpleNamespace(hidden_size=8, vocab_size=600, num_hidden_layers=4))
    with pytest.raises(FingerprintMismatch, match="target_weights_hash: 'another'.*tokenizer_hash: 'another-tok'"):
        check_traffic(RetrainConfig(traffic=other, **config))
    with pytest.raises(ValueError, match="traffic_ratio"):
        check_traffic(RetrainConfig(traffic=outputs.traffic, traffic_ratio=1.5, **config))
    with pytest.raises(ValueError, match="none of its 60 conversations falls in the held-out slice"):
        check_traffic(RetrainConfig(traffic=outputs.traffic, target=str(tiny_target_dir),
                                    traffic_eval_fraction=1e-9))


def test_a_retraining_from_traffic_is_judged_on_a_fixed_mtbench_set(tmp_path):
    """Issue 54 (13): promotion from traffic is judged on a fixed, shipped evaluation set with MT-bench prompts
    besides the held-out traffic: a JSONL file (which could be drawn from the same sink) or a set without MT-bench
    is refused before any work; the named sets with MT-bench pass this check."""
    prompts = tmp_path / "from-the-sink.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n")
    nowhere = str(tmp_path / "no-traffic-here")
    for eval_prompts in (str(prompts), "humaneval", "long"):
        with pytest.raises(ValueError, match="MT-bench prompts.*never on data from the sink alone"):
            check_traffic(RetrainConfig(traffic=nowhere, eval_prompts=eval_prompts))
    for eval_prompts in ("all", "mixed", "mtbench", "mtbench-turn2"):
        with pytest.raises(FileNotFoundError, match="no manifest.json"):  # past the check, to the next one
            check_traffic(RetrainConfig(traffic=nowhere, eval_prompts=eval_prompts))


def test_the_rule_needs_traffic_to_rise_without_the_base_falling_past_its_margin():
    champion = {"tau": 2.0, "traffic_tau": 1.5}
    assert beats_on_traffic({"tau": 1.95, "traffic_tau": 1.7}, champion, margin=0.05, base_margin=0.1)
    assert not beats_on_traffic({"tau": 1.85, "traffic_tau": 2.5}, champion, 0.05, 0.1)  # base fell 0.15 > 0.1
    assert not beats_on_traffic({"tau": 2.5, "traffic_tau": 1.52}, champion, 0.05, 0.1)  # traffic rose < margin
    assert promotion_rule(RetrainConfig()) is None  # no traffic: the plain rule (tau > champion's + margin)


def test_promotion_through_the_compare_and_set_follows_both_taus(tmp_path):
    from pipelines.registry import (CANDIDATE, CHAMPION, alias_version, client, decide_promotion,
                                    register_draft_folder)

    name = "traffic-rule-test"

    def register(tag, alias=None):
        folder = tmp_path / tag
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"note": tag}))
        return str(register_draft_folder(str(folder), name, alias, experiment="traffic-rule-tests"))

    first = register("v1", CHAMPION)
    config = RetrainConfig(traffic="unused", margin=0.05, base_margin=0.1)
    champion = {"tau": 2.0, "traffic_tau": 1.5}

    def never(version):
        raise AssertionError("the champion did not move: no re-evaluation")

    worse_base = register("v2", CANDIDATE)
    decision = decide_promotion(name, worse_base, {"tau": 1.8, "traffic_tau": 2.4}, first, champion, config.margin,
                                never, beats=promotion_rule(config))
    assert not decision.promoted and str(alias_version(name, CHAMPION).version) == first
    assert str(alias_version(name, CANDIDATE).version) == worse_base
    better = register("v3", CANDIDATE)
    decision = decide_promotion(name, better, {"tau": 1.95, "traffic_tau": 1.9}, first, champion, config.margin,
                                never, beats=promotion_rule(config))
    assert decision.promoted and str(alias_version(name, CHAMPION).version) == better
    tags = client().get_model_version(name, better).tags
    assert (tags["tau"], tags["traffic_tau"], tags["eagle3.previous_champion"]) == ("1.9500", "1.9000", first)


def test_the_drift_hook_records_the_alert_with_only_the_rights_it_needs(tmp_path, monkeypatch):
    """infra/retrain-on-drift.yaml's hook, resolved and run as a replica runs it (`acceptance_report.resolve_hook`)
    against a fake kubectl: one patch of the alert ConfigMap with the alert's time, nothing created; its Role grants
    getting and patching that one ConfigMap to the serving pods' account, nothing more (issue 54: the CronJob of
    the retraining's own account acts on it; tests/test_infra.py runs that side)."""
    import re
    from pathlib import Path

    import yaml

    from pipelines.serve.acceptance_report import resolve_hook

    infra = Path(__file__).resolve().parents[1] / "infra"
    docs = list(yaml.safe_load_all((infra / "retrain-on-drift.yaml").read_text()))
    role = next(d for d in docs if d["kind"] == "Role" and "eagle3/drift-hook" in d["metadata"].get("annotations", {}))
    alert = next(d for d in docs if d["kind"] == "ConfigMap" and "alert_at" in d["data"])["metadata"]["name"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [alert],
                              "verbs": ["get", "patch"]}]
    binding = next(d for d in docs if d["kind"] == "RoleBinding" and d["roleRef"]["name"] == role["metadata"]["name"])
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "eagle3-serve"}]

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path}/argv\n')
    (bin_dir / "kubectl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    resolve_hook(role["metadata"]["annotations"]["eagle3/drift-hook"], 30)({"category": "code", "window_tau": 1.2})
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[:5] == ["patch", "configmap", alert, "--type", "merge"] and argv[5] == "-p"
    assert re.fullmatch(r"\d{10}", json.loads(argv[6])["data"]["alert_at"]) and len(argv) == 7


def test_traffic_tau_is_the_tau_evaluate_draft_reports(tiny_target):
    """Held-out traffic is compared on tau alone (`traffic_tau`: the auto-tune's calibration decode, without its
    cost measurements and the timed decodes of the speed-ups): the tau `evaluate_draft` reports for the same
    prompts, on a draft that is right often but not always."""
    from decode_helpers import echo_draft, random_prompts
    from eagle_core.tree import TreeConfig
    from pipelines.retrain.evaluate import evaluate_draft
    from pipelines.retrain.traffic import traffic_tau

    draft = echo_draft(tiny_target)
    prompts = [{"set": "traffic", "ids": ids} for ids in random_prompts(3, tiny_target.config.vocab_size, seed=4)]
    config = RetrainConfig(eval_tree=TreeConfig(top_k=4, depth=3, total_tokens=10), eval_max_new_tokens=16)
    tokenizer = SimpleNamespace(eos_token_id=None)
    tau = traffic_tau(tiny_target, tokenizer, draft, prompts, config)
    assert 1 < tau < 1 + config.eval_tree.depth  # some rounds accept, not every one accepts the whole depth
    assert tau == evaluate_draft(tiny_target, tokenizer, draft, prompts, config)["tau"]
