"""The training job's sequence packing (`pack_length`, issue 40): a rank's step trains the same with its conversations
packed as one per row, and what cannot train is refused by name before any step (plan, setup, each batch). The
end-to-end Ray Train comparison (two unpacked workers against the packed single-worker run) is in test_train.py,
beside the module fixtures it shares."""

from types import SimpleNamespace

import pytest
import torch

from eagle_core.capture import capture_features
from eagle_core.draft import Eagle3Draft
from eagle_core.ttt import TrainConfig, make_optimizer, make_scheduler, ttt_forward
from eagle_core.ttt_batch import BadBatch, check_batch, step_counts
from eagle_core.vocab import build_vocab_mapping
from pipelines.feature_files import encode_hidden
from pipelines.train.batches import Step, collate, decode_row, prefetched
from pipelines.train.config import TrainJobConfig
from pipelines.train.loop import rank_batches, train_one_step
from pipelines.train.model import TTTObjective
from pipelines.train.plan import make_plan

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


def _run(target, pack_length, device="cpu", micro_batch_tokens=None):
    """The fields of loop.Run that a step reads, as `setup` makes them (bf16 autocast on CUDA)."""
    torch.manual_seed(0)
    d2t, t2d = build_vocab_mapping(torch.randint(0, 100, (target.config.vocab_size,)), 96)
    draft = Eagle3Draft.from_target(target, draft_vocab_size=96, d2t=d2t, t2d=t2d).to(device)
    tcfg = TrainConfig(lr=1e-3, total_steps=4, ttt_steps=K)
    optimizer = make_optimizer(draft, tcfg)
    objective = TTTObjective(draft, autocast=device == "cuda")
    return SimpleNamespace(config=TrainJobConfig(features="x", ttt_steps=K, pack_length=pack_length,
                                                 micro_batch_tokens=micro_batch_tokens), meta=META,
                           tcfg=tcfg, device=torch.device(device), world=1, draft=draft, objective=objective,
                           teacher=objective.teacher, head=target.get_output_embeddings().weight.detach().to(device),
                           optimizer=optimizer, scheduler=make_scheduler(optimizer, tcfg))


@pytest.mark.parametrize("pack_length, rows_shape", [(20, (3, 20)), ("longest", (4, 16))])
def test_a_packed_step_of_the_loop_trains_as_one_conversation_per_row(tiny_target, pack_length, rows_shape):
    """train_one_step (a rank's step in the Ray Train loop, alone: world 1) packed (rows of 20 tokens, or of the
    step's longest conversation, the default) and with one conversation per row: the same loss, per-step losses and
    accuracies (float32, 1e-5 relative), tokens and gradient norm; in fewer rows."""
    rows = _feature_rows(tiny_target)
    packed, plain = _run(tiny_target, pack_length), _run(tiny_target, "none")
    (packed_batch,), (plain_batch,) = rank_batches(packed, rows), rank_batches(plain, rows)
    assert packed_batch["input_ids"].shape == rows_shape and plain_batch["input_ids"].shape == (7, 16)
    a, b = train_one_step(packed, rows), train_one_step(plain, rows)
    for key in ["loss", "grad_norm"] + [f"loss_{k}" for k in range(K)]:
        assert a[key] == pytest.approx(b[key], rel=1e-5), key
    for key in ["tokens"] + [f"acc_{k}" for k in range(K)]:
        assert a[key] == b[key], key


@pytest.mark.parametrize("micro_batch_tokens, sizes", [(16, [16, 16, 16, 8]), (30, [28, 28])])
def test_a_step_in_micro_batches_trains_as_the_whole_step(tiny_target, micro_batch_tokens, sizes):
    """Gradient accumulation (`micro_batch_tokens`): train_one_step with the rank's 7 conversations (56 tokens) in
    micro-batches of at most 16 or 30 tokens, packed, each forwarded and backwarded alone, equals the step on one batch
    of them: loss, per-step losses and accuracies, gradient norm (float32, 1e-5 relative), tokens, and the summed
    gradient every weight was stepped with."""
    rows = _feature_rows(tiny_target)
    micro, whole = _run(tiny_target, "longest", micro_batch_tokens=micro_batch_tokens), _run(tiny_target, "longest")
    assert [int(b["attention_mask"].sum()) for b in rank_batches(micro, rows)] == sizes
    a, b = train_one_step(micro, rows), train_one_step(whole, rows)
    for key in ["loss", "grad_norm"] + [f"loss_{k}" for k in range(K)] + [f"acc_{k}" for k in range(K)]:
        assert a[key] == pytest.approx(b[key], rel=1e-5), key
    assert a["tokens"] == b["tokens"] == sum(LENGTHS)
    grads = {n: p.grad for n, p in whole.draft.named_parameters() if p.grad is not None}
    assert len(grads) > 3
    for name, param in micro.draft.named_parameters():
        if name in grads:
            scale = float(grads[name].abs().max())
            torch.testing.assert_close(param.grad, grads[name], rtol=1e-5, atol=1e-6 * scale, msg=name)
    with pytest.raises(ValueError, match="micro_batch_tokens must be a positive number of tokens"):
        TrainJobConfig(features="x", micro_batch_tokens=0)


def test_the_next_steps_batches_are_prepared_while_this_one_trains():
    """`prefetched` (the loop's host work one step ahead): while the caller holds step i, step i+1's prepare runs on
    another thread (step i waits for it to start: without prefetching it would never start); steps come in order;
    an error in a step's prepare is raised where that step is asked for, after the steps before it trained."""
    import threading

    started = [threading.Event() for _ in range(3)]

    def prepare(rows):
        started[rows[0]].set()
        if rows[0] == 2:
            raise BadBatch("step 2's batch")
        return 10 * rows[0]

    got = []
    with pytest.raises(BadBatch, match="step 2's batch"):
        for step, prepared in prefetched(iter([Step([i], {}, last=False) for i in range(3)]), prepare):
            got.append((step.rows[0], prepared, threading.current_thread() is threading.main_thread()))
            assert started[step.rows[0] + 1].wait(timeout=60)  # the next step prepares meanwhile
    assert got == [(0, 0, True), (1, 10, True)]
    # on a CPU device (ahead=False) each step is prepared on the caller's thread when it comes
    threads = []
    steps = [Step([i], {}, last=False) for i in range(3)]
    inline = prefetched(iter(steps), lambda rows: threads.append(threading.current_thread()) or rows[0], ahead=False)
    assert [(s.rows[0], p) for s, p in inline] == [(0, 0), (1, 1), (2, 2)]
    assert threads == [threading.main_thread()] * 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the loop's low-precision teacher")
def test_the_loop_step_takes_the_low_precision_teacher_on_cuda(tiny_target, monkeypatch):
    """On CUDA the loop's teacher runs under the objective's bf16 autocast: `low_precision_teacher`, once a step (as
    bench.ttt measures the step), and the step's loss stays near the float32 teacher's."""
    from eagle_core import teacher

    calls = []
    real = teacher.low_precision_teacher
    monkeypatch.setattr(teacher, "low_precision_teacher", lambda *a, **k: calls.append(1) or real(*a, **k))
    rows = _feature_rows(tiny_target)
    mixed = train_one_step(_run(tiny_target, "longest", "cuda"), rows)
    assert calls == [1]
    exact = train_one_step(_run(tiny_target, "longest"), rows)
    assert mixed["loss"] == pytest.approx(exact["loss"], rel=2e-2)


def test_pack_length_takes_tokens_longest_or_none():
    assert TrainJobConfig(features="x").pack_length == "longest"
    assert TrainJobConfig(features="x").row_length([5, 12, 7]) == 12
    assert TrainJobConfig(features="x", pack_length="none").row_length([5, 12]) is None
    assert TrainJobConfig(features="x", pack_length="4096").row_length([5, 12]) == 4096
    for bad in (0, -3, "long", 2.5):
        with pytest.raises(ValueError, match="pack_length must be a positive number of tokens"):
            TrainJobConfig(features="x", pack_length=bad)


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
    for fits_all in ("longest", None):  # rows as long as each step's longest, or one per row: no limit
        make_plan(rows, [], TrainJobConfig(features="x", tokens_per_batch=100, pack_length=fits_all), world=2)
    config = TrainJobConfig(features="x", tokens_per_batch=100, micro_batch_tokens=64)  # nor longer than a micro-batch
    with pytest.raises(BadBatch, match=r"\('c1', 80\).*longer than a micro-batch of 64 tokens: raise micro_batch_tok"):
        make_plan(rows, [], config, world=2)


def test_the_loop_refuses_a_bad_batch_before_its_step(tiny_target):
    """A rank's rows with a conversation that has nothing to learn: rank_batches refuses it (on the CPU) and
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
    run = _run(tiny_target, "none")
    check_batch(run.draft, collate([], META, K, "cpu"), run.head)
    with pytest.raises(BadBatch, match=r"last_hidden is \[1, 5, 128\]; this draft needs \[1, 5, 64\]"):
        check_batch(run.draft, collate([], {**META, "target_hidden_size": 128}, K, "cpu"), run.head)


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
    assert "[train] rows: several conversations packed into each row, as long as the step's longest" in \
        capsys.readouterr().out
    assert main(argv + ["--pack-length", "none"]) == 0
    assert "[train] rows: one conversation per row, right-padded" in capsys.readouterr().out
    assert main(argv + ["--pack-length", "512"]) == 0
    out = capsys.readouterr().out
    assert "[train] rows: several conversations packed into each row of 512 tokens" in out
    assert "more than --pack-length 512: a longer one is refused when the run is planned" in out
    assert "[train] workers: 1 (ddp), each runs ~" in out and "of a step in one forward and backward" in out
    assert main(argv + ["--num-workers", "8", "--micro-batch-tokens", "4096"]) == 0
    out = capsys.readouterr().out
    assert "[train] workers: 8 (ddp), each runs ~" in out
    assert "of a step in micro-batches of at most 4,096 tokens, gradients summed before the step" in out
