"""The training job's sequence packing (`pack_length`, issue 40): a rank's step trains the same with its conversations
packed as one per row, and what cannot train is refused by name before any step (plan, setup, each batch)."""

from types import SimpleNamespace

import pytest
import torch

from eagle_core.capture import capture_features
from eagle_core.draft import Eagle3Draft
from eagle_core.ttt import TrainConfig, make_optimizer, make_scheduler, ttt_forward
from eagle_core.ttt_batch import BadBatch, check_batch
from eagle_core.vocab import build_vocab_mapping
from pipelines.feature_files import encode_hidden
from pipelines.train.batches import collate, decode_row, step_counts
from pipelines.train.config import TrainJobConfig
from pipelines.train.loop import rank_batch, train_one_step
from pipelines.train.model import TTTObjective
from pipelines.train.plan import make_plan
from test_train import clean, features, peaked_target_dir, work  # noqa: F401 (the module fixtures of the job tests)

LENGTHS = [9, 4, 12, 7, 5, 16, 3]
K = 3


def _feature_rows(target, lengths=LENGTHS, seed=0):
    """Rows as a rank reads them from the features' Parquet shards (hidden states as bytes)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(lengths):
        ids = torch.randint(3, target.config.vocab_size, (1, n), generator=g)
        loss_mask = (torch.rand(n, generator=g) > 0.3).long()
        loss_mask[2:3] = 1
        feats = capture_features(target, ids)
        rows.append({"id": f"conv-{i}", "input_ids": ids[0].tolist(), "loss_mask": loss_mask.tolist(),
                     "aux_hidden": encode_hidden(feats.aux_hidden[0]),
                     "last_hidden": encode_hidden(feats.last_hidden[0])})
    return rows


META = {"target_hidden_size": 64, "dtype": "float32"}


def _run(target, pack_length):
    torch.manual_seed(0)
    d2t, t2d = build_vocab_mapping(torch.randint(0, 100, (target.config.vocab_size,)), 96)
    draft = Eagle3Draft.from_target(target, draft_vocab_size=96, d2t=d2t, t2d=t2d)
    tcfg = TrainConfig(lr=1e-3, total_steps=4, ttt_steps=K)
    optimizer = make_optimizer(draft, tcfg)
    objective = TTTObjective(draft, autocast=False)
    return SimpleNamespace(config=SimpleNamespace(ttt_steps=K, pack_length=pack_length), meta=META, tcfg=tcfg,
                           device=torch.device("cpu"), world=1, draft=draft, objective=objective,
                           teacher=objective.teacher, head=target.get_output_embeddings().weight.detach(),
                           optimizer=optimizer, scheduler=make_scheduler(optimizer, tcfg))


def test_a_packed_step_of_the_loop_trains_as_one_conversation_per_row(tiny_target):
    """train_one_step (a rank's step in the Ray Train loop, alone: world 1) with pack_length 16 and without: the same
    loss, per-step losses and accuracies (float32, 1e-5 relative), tokens and gradient norm; in fewer rows."""
    rows = _feature_rows(tiny_target)
    packed, plain = _run(tiny_target, 16), _run(tiny_target, None)
    assert rank_batch(packed, rows)["input_ids"].shape == (4, 16)
    assert rank_batch(plain, rows)["input_ids"].shape == (7, 16)
    a, b = train_one_step(packed, rows), train_one_step(plain, rows)
    for key in ["loss", "grad_norm"] + [f"loss_{k}" for k in range(K)]:
        assert a[key] == pytest.approx(b[key], rel=1e-5), key
    for key in ["tokens"] + [f"acc_{k}" for k in range(K)]:
        assert a[key] == b[key], key


def test_step_counts_are_those_the_ttt_step_counts(tiny_target):
    """The global denominators of data-parallel training come from `step_counts`: in a packed batch, as in
    ttt_forward, no position is counted whose step would reach into the next conversation."""
    rows = [decode_row(r, META) for r in _feature_rows(tiny_target)]
    run = _run(tiny_target, 16)
    for batch in (collate(rows, META, K, "cpu", pack_length=16), collate(rows, META, K, "cpu")):
        out = ttt_forward(run.draft, batch["input_ids"], batch["loss_mask"], batch["aux_hidden"],
                          batch["last_hidden"], run.head, attention_mask=batch["attention_mask"],
                          position_ids=batch.get("position_ids"), ttt_steps=K)
        assert torch.equal(step_counts(batch, K), out.step_counts)
    packed = collate(rows, META, K, "cpu", pack_length=16)
    assert step_counts(packed, K).tolist() == step_counts(collate(rows, META, K, "cpu"), K).tolist()


def test_the_plan_refuses_a_conversation_longer_than_the_packed_row_by_name():
    """Driver side, before any worker starts: the plan's light rows (id, length) against pack_length."""
    rows = [{"id": f"c{i}", "file": "f", "row": i, "length": n} for i, n in enumerate([30, 80, 20])]
    config = TrainJobConfig(features="x", tokens_per_batch=100, pack_length=64)
    with pytest.raises(BadBatch, match=r"\('c1', 80\).*longer than a packed row of 64 tokens"):
        make_plan(rows[:2], rows[2:], config, world=2)
    make_plan(rows, [], TrainJobConfig(features="x", tokens_per_batch=100), world=2)  # no packing: no limit
    with pytest.raises(ValueError, match="pack_length must be a positive"):
        TrainJobConfig(features="x", pack_length=0)


def test_the_loop_refuses_a_bad_batch_before_its_step(tiny_target):
    """A rank's rows with a conversation that has nothing to learn: rank_batch refuses it (on the CPU) and
    train_one_step does not move a weight."""
    rows = _feature_rows(tiny_target, [9, 6])
    rows[1]["loss_mask"] = [1, 1, 0, 0, 0, 0]
    run = _run(tiny_target, 16)
    before = {n: p.detach().clone() for n, p in run.draft.named_parameters()}
    with pytest.raises(BadBatch, match=r"conversation\(s\) row 0 columns 9\.\.14 .*empty loss mask"):
        train_one_step(run, rows)
    assert all(torch.equal(p, before[n]) for n, p in run.draft.named_parameters())


def test_features_of_another_hidden_size_are_refused_at_setup(tiny_target):
    """setup checks the dummy batch built from the features' manifest against the draft before any step: features
    of a target with another hidden size are refused by name there."""
    run = _run(tiny_target, None)
    check_batch(run.draft, collate([], META, K, "cpu"), run.head)
    with pytest.raises(BadBatch, match=r"last_hidden is \[1, 5, 128\]; this draft needs \[1, 5, 64\]"):
        check_batch(run.draft, collate([], {**META, "target_hidden_size": 128}, K, "cpu"), run.head)


def test_a_packed_two_worker_job_follows_the_unpacked_single_worker_run(features, clean, tmp_path):
    """End to end (Ray Train, features mode): two workers packing their share of each step into rows of 64 tokens
    follow the single-worker run with one conversation per row: the same loss and step-0 accuracy curves (the
    tolerance of the two-worker test in test_train.py) and the same draft."""
    from test_train import STEPS_COMPARED, history, job, weights

    from pipelines.train import run_train

    packed = run_train(job(features, tmp_path / "packed", num_workers=2, pack_length=64))
    assert packed["total_steps"] == clean["total_steps"] >= 8
    for key in STEPS_COMPARED:
        one, two = history(clean["mlflow_run_id"], key), history(packed["mlflow_run_id"], key)
        assert len(one) == len(two) == clean["total_steps"]
        assert torch.allclose(torch.tensor(two), torch.tensor(one), rtol=1e-4, atol=1e-5), key
    a, b = weights(clean), weights(packed)
    for name in a:
        assert torch.allclose(a[name].float(), b[name].float(), rtol=1e-3, atol=1e-5), name


def test_the_dry_run_says_how_rows_are_laid_out(tiny_target_dir, tmp_path, capsys):
    """jobs/train.py --dry-run says whether it packs, and warns when the max length in force exceeds the row."""
    import json

    from jobs.train import main

    corpus = tmp_path / "chats.jsonl"
    corpus.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                                         {"role": "assistant", "content": f"It is {2 * i}."}]})
                                for i in range(4)) + "\n")
    argv = ["--recipe", "llama3.1-8b-instruct", "--target", str(tiny_target_dir), "--corpus", str(corpus),
            "--dry-run"]
    assert main(argv) == 0
    assert "[train] rows: one conversation per row, right-padded" in capsys.readouterr().out
    assert main(argv + ["--pack-length", "512"]) == 0
    out = capsys.readouterr().out
    assert "[train] rows: several conversations packed into each row of 512 tokens" in out
    assert "more than --pack-length 512: a longer one is refused when the run is planned" in out
