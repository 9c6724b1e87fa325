"""Sequence packing in TTT training (issue 40): several conversations per row give the loss and gradients of the same
conversations one per row, and a batch that cannot train the draft is refused by name before any step."""

import pytest
import torch

from eagle_core.capture import capture_features
from eagle_core.draft import Eagle3Draft
from eagle_core.teacher import with_targets
from eagle_core.ttt import TrainConfig, make_optimizer, make_scheduler, train_draft_steps, train_step, ttt_forward
from eagle_core.ttt_batch import BadBatch, check_batch, layout_batch, pack_rows
from eagle_core.vocab import build_vocab_mapping

# Lengths chosen so rows hold 2-3 conversations, one is shorter than the TTT steps reach (4: steps 2+ count nothing
# in it, and in a packed row they would reach into the next conversation) and one exactly fills a row.
LENGTHS = [9, 4, 12, 7, 5, 16, 3]
ROW = 16


def _conversations(target, lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, target.config.vocab_size, (1, n), generator=g)
        loss_mask = (torch.rand(n, generator=g) > 0.3).long()
        loss_mask[2:3] = 1  # every conversation of 3 tokens or more has a position to learn from
        feats = capture_features(target, ids)
        out.append({"input_ids": ids[0], "loss_mask": loss_mask, "aux_hidden": feats.aux_hidden[0],
                    "last_hidden": feats.last_hidden[0]})
    return out


def _draft(target, seed=0):
    torch.manual_seed(seed)
    d2t, t2d = build_vocab_mapping(torch.randint(0, 100, (target.config.vocab_size,)), 96)
    return Eagle3Draft.from_target(target, draft_vocab_size=96, d2t=d2t, t2d=t2d)


def _loss_and_grads(draft, batch, head, steps=4):
    draft.zero_grad(set_to_none=True)
    out = ttt_forward(draft, batch["input_ids"], batch["loss_mask"], batch["aux_hidden"], batch["last_hidden"], head,
                      attention_mask=batch["attention_mask"], position_ids=batch.get("position_ids"), ttt_steps=steps)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}


def _assert_same_training(a, b, rtol=1e-5):
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert torch.equal(out_a.step_counts, out_b.step_counts)
    torch.testing.assert_close(out_a.loss, out_b.loss, rtol=rtol, atol=0)
    torch.testing.assert_close(out_a.step_losses, out_b.step_losses, rtol=rtol, atol=0)
    torch.testing.assert_close(out_a.step_accuracies, out_b.step_accuracies)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        err = float((grads_a[name] - grads_b[name]).norm() / grads_b[name].norm())
        assert err < rtol, (name, err)


@pytest.mark.parametrize("blocks", [None, 5])
def test_packed_rows_train_as_the_same_conversations_one_per_row(tiny_target, monkeypatch, blocks):
    """float32: loss, per-step losses, counts, accuracies and every gradient of 7 conversations packed into rows of 16
    equal those of one conversation per row (right-padded), within 1e-5 relative; with blocks of 5 rows the
    attention and head blocks also cut across conversation boundaries."""
    from eagle_core import ttt_ops

    if blocks:
        monkeypatch.setattr(ttt_ops, "ATTENTION_BLOCK", blocks)
        monkeypatch.setattr(ttt_ops, "HEAD_BLOCK", blocks)
    convs = _conversations(tiny_target)
    head = tiny_target.get_output_embeddings().weight.detach()
    draft = _draft(tiny_target)
    packed = layout_batch(convs, ROW)
    one_per_row = layout_batch(convs)
    assert packed["input_ids"].shape[0] < len(convs) == one_per_row["input_ids"].shape[0]
    assert "position_ids" in packed and "position_ids" not in one_per_row
    _assert_same_training(_loss_and_grads(draft, packed, head), _loss_and_grads(draft, one_per_row, head))


def test_without_its_boundaries_a_packed_row_trains_differently(tiny_target):
    """The boundaries are what make packing exact: the same packed rows read as one conversation each (no
    position_ids) attend and shift across conversations, and their loss differs."""
    convs = _conversations(tiny_target)
    head = tiny_target.get_output_embeddings().weight.detach()
    draft = _draft(tiny_target)
    packed = layout_batch(convs, ROW)
    merged = {k: v for k, v in packed.items() if k != "position_ids"}
    right, right_grads = _loss_and_grads(draft, packed, head)
    wrong, wrong_grads = _loss_and_grads(draft, merged, head)
    assert float(wrong.step_counts.sum()) > float(right.step_counts.sum())  # shifted steps reach the next one
    # far outside the 1e-5 that packing keeps (a random draft: losses near log(96) either way)
    assert abs(float(wrong.loss.detach() / right.loss.detach()) - 1) > 1e-4
    fc = right_grads["fc.weight"]
    assert float((wrong_grads["fc.weight"] - fc).norm() / fc.norm()) > 1e-2


def test_packed_bf16_step_stays_near_one_per_row(tiny_target):
    """Under bf16 autocast the packed and one-per-row steps round differently (other blocks, other sums) but stay
    within bf16's tolerance of each other."""
    convs = _conversations(tiny_target)
    head = tiny_target.get_output_embeddings().weight.detach()
    draft = _draft(tiny_target)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        packed, g_packed = _loss_and_grads(draft, layout_batch(convs, ROW), head, steps=3)
        plain, g_plain = _loss_and_grads(draft, layout_batch(convs), head, steps=3)
    torch.testing.assert_close(packed.step_losses, plain.step_losses, rtol=2e-2, atol=2e-2)
    for name in g_plain:
        assert float((g_packed[name] - g_plain[name]).norm() / g_plain[name].norm()) < 0.05, name


def test_pack_rows_places_each_conversation_once_within_the_row():
    lengths = [5, 16, 3, 9, 9, 1, 7, 12]
    rows = pack_rows(lengths, 16)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 16 for row in rows)
    assert rows == [[1], [7, 2, 5], [3, 6], [4, 0]]  # 62 tokens in the 4 rows that are the fewest possible
    assert pack_rows([], 16) == []


# ---------------------------------------------------------------------------------------------------
# refusals, each naming what is wrong


def test_a_conversation_longer_than_the_row_is_refused_by_name(tiny_target):
    with pytest.raises(BadBatch, match=r"\('conv-b', 20\).*longer than a packed row of 16 tokens"):
        pack_rows([10, 20, 5], 16, names=["conv-a", "conv-b", "conv-c"])
    convs = _conversations(tiny_target, [9, 17])
    with pytest.raises(BadBatch, match=r"\(1, 17\)"):
        layout_batch(convs, ROW)
    # A packer that cut it instead leaves a row that begins inside a conversation: check_batch names that row.
    batch = layout_batch(_conversations(tiny_target, [9, 5]), ROW)
    cut = dict(batch, position_ids=batch["position_ids"] + 4 * (batch["attention_mask"] > 0))
    with pytest.raises(BadBatch, match="row 0 begins inside a conversation .*conversation longer than the row"):
        check_batch(_draft(tiny_target), cut)


def test_positions_that_do_not_count_up_inside_a_conversation_are_refused(tiny_target):
    batch = layout_batch(_conversations(tiny_target, [9, 5]), ROW)
    check_batch(_draft(tiny_target), batch)
    skipped = batch["position_ids"].clone()
    skipped[0, 4:9] += 1
    with pytest.raises(BadBatch, match=r"position_ids: row 0 column 4: position 5 after 3"):
        check_batch(_draft(tiny_target), dict(batch, position_ids=skipped))


def test_a_packed_conversation_with_an_empty_loss_mask_is_refused_by_its_columns(tiny_target):
    convs = _conversations(tiny_target, [9, 5, 2])
    convs[1]["loss_mask"] = torch.tensor([1, 1, 0, 0, 0])  # positions 0-1 are no TTT target: nothing counts
    draft = _draft(tiny_target)
    batch = layout_batch(convs, ROW)  # row 0: the 9 then the 5 (columns 9..13), then the 2 (columns 14..15)
    with pytest.raises(BadBatch, match=r"conversation\(s\) row 0 columns 9\.\.13, row 0 columns 14\.\.15 .*empty "
                                       r"loss mask"):
        check_batch(draft, batch)
    with pytest.raises(BadBatch, match=r"row\(s\) \[1, 2\] .*empty loss mask"):
        check_batch(draft, layout_batch(convs))


@pytest.mark.parametrize("field, features, words", [
    ("hidden size", lambda c: {"last_hidden": torch.cat([c["last_hidden"]] * 2, -1)},
     r"last_hidden is \[1, 9, 128\]; this draft needs \[1, 9, 64\] \(the target's hidden size 64\)"),
    ("aux layers", lambda c: {"aux_hidden": torch.cat([c["aux_hidden"], c["last_hidden"]], -1)},
     r"aux_hidden .*3 aux layers .*the features hold 4 aux layers of hidden 64"),
])
def test_features_that_do_not_fit_the_draft_are_refused_by_name(tiny_target, field, features, words):
    conv = _conversations(tiny_target, [9])[0]
    batch = layout_batch([{**conv, **features(conv)}])
    with pytest.raises(BadBatch, match=words):
        check_batch(_draft(tiny_target), batch, contents=False)


def test_a_head_or_teacher_of_another_vocabulary_is_refused_by_name(tiny_target):
    draft = _draft(tiny_target)
    head = tiny_target.get_output_embeddings().weight.detach()
    batch = layout_batch(_conversations(tiny_target, [9]))
    with pytest.raises(BadBatch, match=r"lm_head is \[511, 64\].*target vocabulary"):
        check_batch(draft, batch, head[:-1])
    other = _draft(tiny_target)
    other.config.draft_vocab_size = 95
    with pytest.raises(BadBatch, match=r"targets' distribution is \[1, 9, 96\].*draft vocabulary"):
        check_batch(other, with_targets(batch, head, draft.d2t))


def test_the_training_loop_refuses_a_bad_batch_before_its_first_step(tiny_target):
    """train_draft_steps checks every batch's contents before its step: a conversation with nothing to learn in the
    second batch stops the run before the first step moves a weight."""
    convs = _conversations(tiny_target, [9, 5])
    empty = _conversations(tiny_target, [6])[0]
    empty["loss_mask"] = torch.zeros(6, dtype=torch.long)
    draft = _draft(tiny_target)
    head = tiny_target.get_output_embeddings().weight.detach()
    before = {n: p.detach().clone() for n, p in draft.named_parameters()}
    cfg = TrainConfig(total_steps=4, ttt_steps=2)
    with pytest.raises(BadBatch, match=r"conversation\(s\) row 0 columns 0\.\.5"):
        train_draft_steps(draft, [layout_batch(convs, ROW), layout_batch([empty], ROW)], head, cfg)
    assert all(torch.equal(p, before[n]) for n, p in draft.named_parameters())
    opt = make_optimizer(draft, cfg)
    metrics = train_step(draft, layout_batch(convs, ROW), head, opt, make_scheduler(opt, cfg), cfg)
    assert metrics["tokens"] == 14
