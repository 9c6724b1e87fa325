"""Retraining at growing scales on the tiny target: shard reuse, no-op reruns, MLflow parent/child runs with the
scaling plot, and the promotion rule in both directions."""

import json
import os
from pathlib import Path

import pytest
import torch

from eagle_core.tree import TreeConfig
from pipelines.retrain import CANDIDATE, CHAMPION, RetrainConfig, alias_version, run_retrain


def test_warm_start_copies_weights_and_the_shared_vocab_rows(tmp_path, tiny_target):
    import torch

    from eagle_core.checkpoint import save_draft
    from eagle_core.draft import DraftConfig, Eagle3Draft
    from eagle_core.vocab import mapping_from_draft_ids
    from pipelines.train import warm_start

    def draft(seed, ids):
        torch.manual_seed(seed)
        d = Eagle3Draft(DraftConfig.from_target(tiny_target.config, draft_vocab_size=len(ids)),
                        tiny_target.get_input_embeddings().weight)
        d.set_vocab(*mapping_from_draft_ids(torch.tensor(ids), tiny_target.config.vocab_size))
        return d

    old = draft(0, list(range(0, 64)))
    save_draft(old, tmp_path / "old")
    new = draft(1, list(range(32, 96)))  # shares target ids 32..63 with the old vocabulary
    copied = warm_start(new, str(tmp_path / "old"))
    assert "fc.weight" in copied and "lm_head.weight" in copied
    assert torch.equal(new.fc.weight, old.fc.weight)
    assert torch.equal(new.midlayer.self_attn.q_proj.weight, old.midlayer.self_attn.q_proj.weight)
    assert torch.equal(new.lm_head.weight[:32], old.lm_head.weight[32:])  # same target tokens, same rows
    fresh = draft(1, list(range(32, 96)))
    assert torch.equal(new.lm_head.weight[32:], fresh.lm_head.weight[32:])  # tokens new to the vocab: fresh rows
    assert torch.equal(new.d2t + torch.arange(64), torch.arange(32, 96))  # the new vocabulary is kept


def test_a_grown_vocabulary_maps_the_new_target_rows_into_the_trained_head(tmp_path, tiny_target):
    """Growing the vocabulary of a draft whose head started from the target's: the old rows carry over, and the new
    tokens' target rows go through the linear map that trained rows and target rows of the shared tokens define
    (here exactly a known map M, which least squares recovers), not raw: raw target rows would outscore every
    trained row of a real draft."""
    from eagle_core.checkpoint import save_draft
    from eagle_core.draft import DraftConfig, Eagle3Draft
    from eagle_core.vocab import mapping_from_draft_ids
    from pipelines.train import warm_start

    head = tiny_target.get_output_embeddings().weight.detach()
    h = head.shape[1]

    def draft(n):
        d = Eagle3Draft(DraftConfig.from_target(tiny_target.config, draft_vocab_size=n, lm_head_init="target"),
                        tiny_target.get_input_embeddings().weight)
        d.set_vocab(*mapping_from_draft_ids(torch.arange(n), tiny_target.config.vocab_size))
        d.init_lm_head_from_target(head)
        return d

    g = torch.Generator().manual_seed(0)
    mapping = torch.eye(h) + 0.3 * torch.randn(h, h, generator=g)
    old = draft(3 * h)  # more shared rows than hidden channels: the map is determined
    with torch.no_grad():
        old.lm_head.weight.copy_(head[: 3 * h] @ mapping)
    save_draft(old, tmp_path / "old")
    grown = draft(5 * h)
    warm_start(grown, str(tmp_path / "old"))
    assert torch.equal(grown.lm_head.weight[: 3 * h], old.lm_head.weight)
    new_rows = grown.lm_head.weight[3 * h:]
    assert torch.allclose(new_rows, head[3 * h: 5 * h] @ mapping, atol=1e-3)
    assert not torch.allclose(new_rows, head[3 * h: 5 * h], atol=1e-1)  # not the raw target rows


def test_a_warm_start_inherits_the_source_vocabulary_when_it_fits(tmp_path, tiny_target):
    """A run warm-started from a draft keeps that draft's vocabulary (every lm_head row then carries over);
    a draft of another vocabulary size or another target leaves the run to build its own."""
    import torch

    from eagle_core.checkpoint import save_draft
    from eagle_core.draft import DraftConfig, Eagle3Draft
    from eagle_core.vocab import mapping_from_draft_ids
    from pipelines.train import inherited_vocab

    source = Eagle3Draft(DraftConfig.from_target(tiny_target.config, draft_vocab_size=64),
                         tiny_target.get_input_embeddings().weight)
    source.set_vocab(*mapping_from_draft_ids(torch.arange(100, 164), tiny_target.config.vocab_size))
    save_draft(source, tmp_path / "source")
    d2t = inherited_vocab(str(tmp_path / "source"), tiny_target.config, 64)
    assert torch.equal(d2t + torch.arange(64), torch.arange(100, 164))
    assert inherited_vocab(str(tmp_path / "source"), tiny_target.config, 32) is None
    other = type(tiny_target.config)(**{**tiny_target.config.to_dict(), "vocab_size": tiny_target.config.vocab_size + 1})
    assert inherited_vocab(str(tmp_path / "source"), other, 64) is None

    from pipelines.train.model import vocab_coverage  # the share of loss tokens that vocabulary (100..163) holds

    assert vocab_coverage({100: 6, 163: 2, 99: 1, 164: 1}, d2t) == pytest.approx(0.8)
    assert vocab_coverage({}, d2t) == 1.0


# one word per answer, so that a larger scale's answers hold tokens a smaller scale's never saw (its own
# vocabulary would differ from the champion's)
WORDS = ["apple", "river", "mountain", "violin", "glacier", "harbor", "lantern", "meadow", "orchid", "pyramid",
         "saffron", "thunder", "umbrella", "volcano", "walnut", "zeppelin"]


def write_corpus(path: Path, n: int) -> Path:
    rows = [json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: what is {i} plus {i + 1}?"},
        {"from": "gpt", "value": f"{i} plus {i + 1} is {2 * i + 1}, said the {WORDS[i]}."}]}) for i in range(n)]
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def setting(ray_cluster, tmp_path_factory, tiny_target_dir):
    folder = tmp_path_factory.mktemp("retrain")
    old = os.environ.get("EAGLE3_WORK")
    os.environ["EAGLE3_WORK"] = str(folder / "work")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("Hello there", "What is 2 plus 3?")) + "\n")
    base = dict(corpus=str(write_corpus(folder / "corpus.jsonl", 8)), work=str(folder / "retrain"),
                target=str(tiny_target_dir), registered_model="retrain-test", eval_prompts=str(prompts),
                eval_count=2, eval_max_new_tokens=6, eval_tree=TreeConfig(top_k=2, depth=2, total_tokens=3),
                mlflow_experiment="retrain-test",
                serving_gate="off",  # vLLM cannot load the tiny target (head size 16); tests/test_serving_gate.py
                extract={"regenerate": False, "rows_per_shard": 2, "cpus_per_worker": 0.5, "max_length": 64},
                train={"epochs": 1, "tokens_per_batch": 256, "ttt_steps": 2, "draft_vocab_size": 128,
                       "eval_fraction": 0.25, "checkpoint_every": 100, "cpus_per_worker": 0.5,
                       "mlflow_experiment": "retrain-test-train", "log_every": 100})
    yield base
    if old is None:
        os.environ.pop("EAGLE3_WORK", None)
    else:
        os.environ["EAGLE3_WORK"] = old


def child_runs(client, experiment, parent):
    return client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{parent}'")


@pytest.mark.slow
def test_scales_reuse_shards_and_promotion_follows_the_rule(setting):
    from mlflow.tracking import MlflowClient

    from pipelines import tracking

    # Pass 1: scales 4 and 8 rows (two rows a shard); a margin no draft can beat, so the first version (no champion
    # yet) becomes champion and the second stays candidate.
    first = run_retrain(RetrainConfig(**setting, scales=[4, 8], margin=1e9))
    small, large = first["scales"]
    assert (small["shards"], small["reused_shards"]) == (2, 0)
    assert (large["shards"], large["reused_shards"]) == (4, 2)  # the 4-row prefix's shards were copied
    assert small["promoted"] and not large["promoted"]
    assert str(alias_version("retrain-test", CHAMPION).version) == str(small["version"])
    assert str(alias_version("retrain-test", CANDIDATE).version) == str(large["version"])
    # the larger scale warm-started from the champion and kept its vocabulary
    from eagle_core.checkpoint import load_draft

    drafts = Path(setting["work"]) / "drafts"
    assert torch.equal(load_draft(drafts / "rows-8" / "draft").d2t, load_draft(drafts / "rows-4" / "draft").d2t)
    # ... and reported how much of its data that kept vocabulary holds (the first scale built its own)
    summaries = {rows: json.loads((drafts / f"rows-{rows}" / "summary.json").read_text()) for rows in (4, 8)}
    assert [summaries[r]["draft_vocab_inherited"] for r in (4, 8)] == [False, True]
    assert all(0 < summaries[r]["draft_vocab_coverage"] <= 1 for r in (4, 8))
    assert summaries[8]["draft_vocab_coverage"] < 1  # the larger scale's new words are outside it

    client = MlflowClient(tracking.tracking_uri())
    experiment = client.get_experiment_by_name("retrain-test").experiment_id
    runs = child_runs(client, experiment, first["parent_run_id"])
    assert sorted(r.data.params["rows"] for r in runs) == ["4", "8"]
    assert all("tau" in r.data.metrics for r in runs)
    for scale in (small, large):  # each decision tagged its version's tau and the dtype it was measured in
        tags = client.get_model_version("retrain-test", str(scale["version"])).tags
        assert float(tags["tau"]) == pytest.approx(scale["tau"], abs=1e-4) and tags["eagle3.tau_dtype"] in (
            "float32", "bfloat16"), tags
    artifacts = {a.path for a in client.list_artifacts(first["parent_run_id"])}
    assert {"tau_vs_data_scale.png", "scaling.json"} <= artifacts

    # Pass 2: the corpus grew, the same scales, and a margin every draft beats: nothing is extracted or trained again
    # (same versions and training runs; every shard already committed), and the candidate left by pass 1, evaluated
    # again against the champion, is promoted. (Pass 2 also added a third scale, which reused the larger scale's
    # shards, until the suite had to fit 15 minutes: pass 1's larger scale shows the same reuse, by the same code.)
    write_corpus(Path(setting["corpus"]), 12)
    second = run_retrain(RetrainConfig(**setting, scales=[4, 8], margin=-1e9))
    again_small, again_large = second["scales"]
    assert (again_small["version"], again_large["version"]) == (small["version"], large["version"])
    assert (again_small["train_run_id"], again_large["train_run_id"]) == (small["train_run_id"], large["train_run_id"])
    assert again_large["reused_shards"] == 0 and again_large["shards"] == 4  # nothing new to copy: all committed
    assert again_large["promoted"]
    assert str(alias_version("retrain-test", CHAMPION).version) == str(large["version"])
    assert len(child_runs(client, experiment, second["parent_run_id"])) == 2


@pytest.mark.parametrize("train,init_from,lr", [({}, "models:/m@champion", 2e-4), ({"lr": 5e-4}, "models:/m@champion", 5e-4),
                                                 ({}, None, None)])
def test_a_warm_started_candidate_takes_the_fine_tuning_rate(tmp_path, monkeypatch, train, init_from, lr):
    """Warm-started, a candidate trains at `warm_start_lr` (fine-tuning) unless `train` sets lr; from scratch
    it keeps the trainer's own default."""
    import pipelines.train
    from pipelines.retrain.job import _train_scale
    from pipelines.train import TrainJobConfig

    seen = []
    monkeypatch.setattr(pipelines.train, "run_train", lambda cfg: seen.append(cfg) or {})
    _train_scale(RetrainConfig(work=str(tmp_path), train=train), 40, str(tmp_path / "features"), init_from)
    assert seen[0].init_from == init_from
    assert seen[0].lr == (lr if lr is not None else TrainJobConfig.lr)


def test_the_evaluation_rotates_which_mode_decodes_a_prompt_first(tiny_target, monkeypatch):
    """Tree, auto and plain decode each prompt in turn; each leads on every third prompt, so a slow spell of the
    machine or a warm-up cost is not charged to one mode's side of the speed-up."""
    import types

    import eagle_core.chat
    import eagle_core.generate
    from pipelines.retrain.evaluate import evaluate_draft
    from tests.decode_helpers import echo_draft

    real, order = eagle_core.generate.generate, []

    def recording(target, ids, **kw):
        order.append((ids[0][0], kw["mode"]))
        return real(target, ids, **kw)

    monkeypatch.setattr(eagle_core.generate, "generate", recording)
    monkeypatch.setattr(eagle_core.chat, "prompt_ids", lambda tok, messages: [int(messages[0]["content"]), 5, 9, 2])
    prompts = [{"set": "a" if n < 13 else "b", "messages": [{"role": "user", "content": str(n)}]}
               for n in (11, 12, 13, 14)]
    config = RetrainConfig(eval_tree=TreeConfig(top_k=2, depth=2, total_tokens=4), eval_max_new_tokens=6)
    result = evaluate_draft(tiny_target, types.SimpleNamespace(eos_token_id=None), echo_draft(tiny_target), prompts,
                            config)
    per_prompt = {}
    for first_token, mode in order[-12:]:  # the timed decodes follow the auto-tune's calibration
        per_prompt.setdefault(first_token, []).append(mode)
    assert per_prompt == {11: ["tree", "auto", "plain"], 12: ["auto", "plain", "tree"],
                          13: ["plain", "tree", "auto"], 14: ["tree", "auto", "plain"]}
    assert result["prompts"] == 4 and result["speedup"] > 0 and result["tree_speedup"] > 0
    # tau per prompt set, from the tuned tree's rounds: the echo draft is always right, so both sets accept
    assert set(result["tree_tau_by_set"]) == {"a", "b"} and all(t > 1 for t in result["tree_tau_by_set"].values())
