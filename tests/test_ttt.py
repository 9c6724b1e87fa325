"""Training-time test: the efficient TTT equals the naive full-mask formulation (loss, logits, gradients)."""

import pytest
import torch
import torch.nn.functional as F

from eagle_core.draft import Eagle3Draft
from eagle_core.capture import capture_features
from eagle_core.teacher import target_distribution, with_targets
from eagle_core.ttt import (HiddenNoise, TrainConfig, load_train_state, make_optimizer, make_scheduler,
                            simulated_accept_length, step_loss, train_draft_steps, train_state_dict, ttt_forward,
                            warmup_cosine)
from eagle_core.ttt_naive import ttt_forward_naive
from eagle_core.vocab import build_vocab_mapping

B, L = 2, 12


def _batch(target, padding: str, seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, target.config.vocab_size, (B, L), generator=g)
    attention_mask = torch.ones(B, L, dtype=torch.long)
    if padding == "right":
        attention_mask[1, 8:] = 0
    elif padding == "left":
        attention_mask[1, :3] = 0
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    loss_mask = (torch.rand(B, L, generator=g) > 0.3).long() * attention_mask
    feats = capture_features(target, input_ids, attention_mask=attention_mask)
    return dict(input_ids=input_ids, loss_mask=loss_mask, attention_mask=attention_mask,
                aux_hidden=feats.aux_hidden, last_hidden=feats.last_hidden)


def _draft(target, seed=0, **kw):
    torch.manual_seed(seed)
    counts = torch.randint(0, 100, (target.config.vocab_size,))
    d2t, t2d = build_vocab_mapping(counts, 96)  # a scattered, non-identity vocab
    return Eagle3Draft.from_target(target, draft_vocab_size=96, d2t=d2t, t2d=t2d, **kw)


def _run(fn, draft, batch, target, steps):
    draft.zero_grad(set_to_none=True)
    out = fn(draft, batch["input_ids"], batch["loss_mask"], batch["aux_hidden"], batch["last_hidden"],
             target.get_output_embeddings().weight, attention_mask=batch["attention_mask"], ttt_steps=steps,
             return_logits=True)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}
    return out, grads


# EAGLE-3, EAGLE 3.1 (features normalised before fc, each step's post-norm state fed to the next), P-EAGLE (deeper
# steps fed mask slots)
VARIANTS = {"eagle3": {}, "eagle3.1": dict(norm_before_fc=True, norm_output=True),
            "p-eagle": dict(parallel_drafting=True, mask_token_id=5)}


def _variant(draft):
    """Norm weights away from their init (ones), so that a norm applied where it is not (or twice) shows."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return draft


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_efficient_ttt_matches_naive(tiny_target, padding, variant):
    batch = _batch(tiny_target, padding)
    draft = _variant(_draft(tiny_target, **VARIANTS[variant]))
    fast, fast_grads = _run(ttt_forward, draft, batch, tiny_target, steps=4)
    slow, slow_grads = _run(ttt_forward_naive, draft, batch, tiny_target, steps=4)
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast.loss, slow.loss, **tol)
    torch.testing.assert_close(fast.step_losses, slow.step_losses, **tol)
    torch.testing.assert_close(fast.step_accuracies, slow.step_accuracies)
    torch.testing.assert_close(fast.step_counts, slow.step_counts.to(fast.step_counts.dtype))
    for a, b in zip(fast.logits, slow.logits):
        torch.testing.assert_close(a, b, **tol)
    assert fast_grads.keys() == slow_grads.keys() and "fc.weight" in fast_grads
    assert ("input_norm.weight" in fast_grads) == (variant == "eagle3.1")
    assert ("mask_hidden" in fast_grads) == (variant == "p-eagle")
    for name in fast_grads:
        torch.testing.assert_close(fast_grads[name], slow_grads[name], **tol, msg=name)


def test_blocked_kernels_match_naive_across_block_edges(tiny_target, monkeypatch):
    """Attention and head blocks of 5 rows (L = 12): rows and keys split across blocks, causal ends inside them."""
    from eagle_core import ttt_ops

    monkeypatch.setattr(ttt_ops, "ATTENTION_BLOCK", 5)
    monkeypatch.setattr(ttt_ops, "HEAD_BLOCK", 5)
    batch = _batch(tiny_target, "left")
    draft = _draft(tiny_target)
    fast, fast_grads = _run(ttt_forward, draft, batch, tiny_target, steps=4)
    slow, slow_grads = _run(ttt_forward_naive, draft, batch, tiny_target, steps=4)
    torch.testing.assert_close(fast.step_losses, slow.step_losses, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast.step_accuracies, slow.step_accuracies)
    for name in fast_grads:
        torch.testing.assert_close(fast_grads[name], slow_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_efficient_ttt_matches_naive_under_bf16_autocast(tiny_target):
    """Training runs under bf16 autocast: the blocked kernels compute in bf16 as the layers around them do, so
    they agree with the naive formulation to bf16 rounding, and every trainable weight gets a gradient."""
    batch = _batch(tiny_target, "right")
    draft = _draft(tiny_target)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast, fast_grads = _run(ttt_forward, draft, batch, tiny_target, steps=3)
        slow, slow_grads = _run(ttt_forward_naive, draft, batch, tiny_target, steps=3)
    torch.testing.assert_close(fast.step_losses, slow.step_losses, rtol=2e-2, atol=2e-2)
    for name in fast_grads:
        a, b = fast_grads[name].float(), slow_grads[name].float()
        assert fast_grads[name].dtype == slow_grads[name].dtype, name
        assert float((a - b).norm() / b.norm().clamp_min(1e-12)) < 0.05, name


def test_autocast_leaves_the_teacher_and_the_counts_in_float32(tiny_target):
    """Under bf16 autocast on a CPU (how distillation trains there) the target distribution is the float32 one, bit
    for bit (the low-precision teacher is CUDA's: no faster on a CPU), and
    per-step position counts stay exact past 256 (bf16 holds integers exactly only up to 256)."""
    g = torch.Generator().manual_seed(3)
    length = 300
    input_ids = torch.randint(3, tiny_target.config.vocab_size, (1, length), generator=g)
    feats = capture_features(tiny_target, input_ids)
    head = tiny_target.get_output_embeddings().weight
    draft = _draft(tiny_target)
    plain = target_distribution(feats.last_hidden, head, draft.d2t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = target_distribution(feats.last_hidden, head, draft.d2t)
        out = ttt_forward(draft, input_ids, torch.ones_like(input_ids), feats.aux_hidden, feats.last_hidden, head,
                          ttt_steps=3)
    assert mixed[0].dtype == torch.float32 and torch.equal(mixed[0], plain[0]) and torch.equal(mixed[1], plain[1])
    assert out.step_counts.tolist() == [length - 2, length - 3, length - 4]


def _teacher_inputs(tiny_target, length=200, seed=4):
    g = torch.Generator().manual_seed(seed)
    feats = capture_features(tiny_target, torch.randint(3, tiny_target.config.vocab_size, (1, length), generator=g))
    return feats.last_hidden, tiny_target.get_output_embeddings().weight.detach(), _draft(tiny_target).d2t


@pytest.mark.parametrize("candidates", [8, 1])
def test_low_precision_teacher_has_the_float32_argmax_and_close_labels(tiny_target, monkeypatch, candidates):
    """The CUDA teacher under bf16 autocast: soft labels from bf16 inputs (close to float32's), and the argmax equal
    to float32's, through the float16 screen and its candidates (8) or with every row re-checked whole (1: no row
    can be sure from one candidate)."""
    from eagle_core import teacher

    monkeypatch.setattr(teacher, "ARGMAX_CANDIDATES", candidates)
    monkeypatch.setattr(teacher, "TARGET_BLOCK", 64)  # several blocks, the last one short
    hidden, head, d2t = _teacher_inputs(tiny_target)
    p32, arg32 = target_distribution(hidden, head, d2t)
    p, arg = teacher.low_precision_teacher(hidden, head, d2t, torch.bfloat16)
    assert p.dtype == torch.float32 and torch.equal(arg, arg32)
    torch.testing.assert_close(p, p32, rtol=3e-2, atol=1e-4)
    torch.testing.assert_close(p.sum(-1), torch.ones_like(p[..., 0]))


def test_low_precision_teacher_settles_near_ties_in_float32(tiny_target):
    """Rows whose two best target logits differ by less than float16 can resolve: the head holds, for each row's
    float32 winner, a copy nudged 1e-6 higher in that row's direction. Only the float32 re-check sees which wins."""
    from eagle_core import teacher

    hidden, head, d2t = _teacher_inputs(tiny_target, length=40)
    h = hidden.flatten(0, 1)
    winners = F.linear(h, head).argmax(-1)
    twins = head[winners] + 1e-6 * h / h.norm(dim=-1, keepdim=True)  # logit higher by 1e-6 * ||h||
    head2 = torch.cat([head, twins])
    _, arg32 = target_distribution(hidden, head2, d2t)
    assert (arg32.flatten() >= head.shape[0]).all()  # the twins win in float32
    _, arg = teacher.low_precision_teacher(hidden, head2, d2t, torch.bfloat16)
    assert torch.equal(arg, arg32)


def test_one_gemm_weight_gradient_is_closer_to_float32_than_bf16_blocks(tiny_target, monkeypatch):
    """Under bf16 autocast the lm_head gradient as one float32-output GEMM (CUDA's default, forced here) against the
    per-block bf16 products summed in float32 (a CPU's): both near the float32 step's gradient, the single GEMM no
    further from it."""
    from eagle_core import ttt_ops

    monkeypatch.setattr(ttt_ops, "HEAD_BLOCK", 5)
    batch = _batch(tiny_target, "right")
    draft = _draft(tiny_target)
    _, exact = _run(ttt_forward, draft, batch, tiny_target, steps=3)
    errors = {}
    for one_gemm in (True, False):
        monkeypatch.setattr(ttt_ops, "ONE_GEMM_WEIGHT_GRAD", one_gemm)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, grads = _run(ttt_forward, draft, batch, tiny_target, steps=3)
        g, ref = grads["lm_head.weight"], exact["lm_head.weight"]
        assert g.dtype == torch.float32
        errors[one_gemm] = float((g - ref).norm() / ref.norm())
    assert errors[True] < 0.02 and errors[False] < 0.02
    assert errors[True] <= errors[False] * 1.05, errors


def test_step_loss_matches_its_definition_position_by_position():
    """Column t of step k: soft CE against the target at t+k+1, counted when loss_mask[t+k+2] is set."""
    g = torch.Generator().manual_seed(0)
    b, length, vd, k = 2, 9, 7, 2

    class Identity:
        d2t = torch.arange(vd) * 0

        def draft_to_target(self, ids):
            return ids

    logits = torch.randn(b, length, vd, generator=g)
    target_p = torch.softmax(torch.randn(b, length, vd, generator=g), -1)
    target_argmax = target_p.argmax(-1)
    loss_mask = (torch.rand(b, length, generator=g) > 0.3).float()
    loss_sum, hits, count = step_loss(Identity(), logits, k, target_p, target_argmax, loss_mask)
    exp_loss = exp_hits = exp_count = 0.0
    for i in range(b):
        for t in range(length):
            if t + k + 2 < length and loss_mask[i, t + k + 2]:
                exp_loss -= float((target_p[i, t + k + 1] * torch.log_softmax(logits[i, t], -1)).sum())
                exp_hits += float(logits[i, t].argmax() == target_argmax[i, t + k + 1])
                exp_count += 1
    assert abs(float(loss_sum) - exp_loss) < 1e-4 and float(hits) == exp_hits and float(count) == exp_count


def test_every_masked_position_counts(tiny_target):
    """Step k scores column t on token t+k+2, including targets outside the draft vocab."""
    batch = _batch(tiny_target, "right")
    draft = _draft(tiny_target)
    out = ttt_forward(draft, batch["input_ids"], batch["loss_mask"], batch["aux_hidden"], batch["last_hidden"],
                      tiny_target.get_output_embeddings().weight, attention_mask=batch["attention_mask"],
                      ttt_steps=3)
    expected = [float(batch["loss_mask"][:, k + 2:].sum()) for k in range(3)]
    assert out.step_counts.tolist() == expected
    none = ttt_forward(draft, batch["input_ids"], torch.zeros_like(batch["loss_mask"]), batch["aux_hidden"],
                       batch["last_hidden"], tiny_target.get_output_embeddings().weight, ttt_steps=3)
    assert float(none.loss.detach()) == 0.0


@pytest.mark.parametrize("padding", ["right", "left"])
def test_padding_content_never_reaches_the_loss(tiny_target, padding):
    """Whatever the padded positions hold (features, ids, loss mask), loss and gradients are unchanged.

    With left padding a padded column t would otherwise be scored on a real loss token t+k+2.
    """
    batch = _batch(tiny_target, padding)
    pad = batch["attention_mask"] == 0
    batch["loss_mask"][1, :] = 1 - pad[1].long()  # every real token is a loss token, right up to the padding
    noisy = dict(batch)
    g = torch.Generator().manual_seed(5)
    noisy["aux_hidden"] = batch["aux_hidden"] + pad[..., None] * torch.randn(batch["aux_hidden"].shape, generator=g)
    noisy["input_ids"] = batch["input_ids"].masked_fill(pad, 7)
    noisy["loss_mask"] = batch["loss_mask"].masked_fill(pad, 1)
    draft = _draft(tiny_target)
    clean, clean_grads = _run(ttt_forward, draft, batch, tiny_target, steps=3)
    dirty, dirty_grads = _run(ttt_forward, draft, noisy, tiny_target, steps=3)
    torch.testing.assert_close(clean.step_losses, dirty.step_losses)
    torch.testing.assert_close(clean.step_counts, dirty.step_counts)
    for name in clean_grads:
        torch.testing.assert_close(clean_grads[name], dirty_grads[name], msg=name)


def test_precomputed_targets_give_the_same_loss(tiny_target):
    batch = _batch(tiny_target, "right")
    draft = _draft(tiny_target)
    head = tiny_target.get_output_embeddings().weight
    args = (draft, batch["input_ids"], batch["loss_mask"], batch["aux_hidden"], batch["last_hidden"], head)
    cached = with_targets(batch, head, draft.d2t)["targets"]
    torch.testing.assert_close(ttt_forward(*args, attention_mask=batch["attention_mask"], targets=cached).loss,
                               ttt_forward(*args, attention_mask=batch["attention_mask"]).loss)


def test_loss_is_weighted_sum_of_step_losses(tiny_target):
    batch = _batch(tiny_target, "none")
    out = ttt_forward(_draft(tiny_target), batch["input_ids"], batch["loss_mask"], batch["aux_hidden"],
                      batch["last_hidden"], tiny_target.get_output_embeddings().weight, ttt_steps=5)
    weights = torch.tensor([0.8 ** k for k in range(5)])
    torch.testing.assert_close(out.loss.detach(), (weights * out.step_losses).sum())


def test_simulated_accept_length():
    assert simulated_accept_length([1.0, 1.0, 1.0]) == 4.0
    assert simulated_accept_length([0.0, 1.0]) == 1.0
    assert abs(simulated_accept_length([0.5, 0.5]) - 1.75) < 1e-12


def test_noise_only_when_asked_and_training(tiny_target):
    batch = _batch(tiny_target, "none")
    draft = _draft(tiny_target).train()
    args = (batch["input_ids"], batch["loss_mask"], batch["aux_hidden"], batch["last_hidden"],
            tiny_target.get_output_embeddings().weight)
    base = ttt_forward(draft, *args, ttt_steps=2).loss
    assert torch.equal(base, ttt_forward(draft, *args, ttt_steps=2, noise=HiddenNoise()).loss)
    noisy = ttt_forward(draft, *args, ttt_steps=2, noise=HiddenNoise("gaussian", 1.0)).loss
    assert not torch.equal(base, noisy)
    draft.eval()
    assert torch.equal(base, ttt_forward(draft, *args, ttt_steps=2, noise=HiddenNoise("uniform", 1.0)).loss)


def test_warmup_cosine_schedule():
    cfg = TrainConfig(warmup_steps=4, total_steps=20, min_lr_ratio=0.1)
    lrs = [warmup_cosine(s, cfg) for s in range(21)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0] and lrs[4] == 1.0
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:])) and abs(lrs[20] - 0.1) < 1e-12


def _excess_step0_loss(draft, batch, head):
    """Step-0 loss minus the target's entropy on the same positions: the KL the draft can still remove."""
    with torch.no_grad():
        out = ttt_forward(draft, batch["input_ids"], batch["loss_mask"], batch["aux_hidden"], batch["last_hidden"],
                          head, attention_mask=batch["attention_mask"], ttt_steps=1)
        p, _ = target_distribution(batch["last_hidden"], head, draft.d2t)
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)[:, 1:-1]
        mask = batch["loss_mask"][:, 2:].float()
    return float(out.step_losses[0]) - float((entropy * mask).sum() / mask.sum())


@pytest.mark.parametrize("lm_head_init", ["random", "target"])
def test_training_loop_fits_a_batch_and_keeps_frozen_weights(tiny_target, lm_head_init):
    batch = _batch(tiny_target, "right")
    head = tiny_target.get_output_embeddings().weight * 4  # a peaked target, so there is something to learn
    draft = _draft(tiny_target, lm_head_init=lm_head_init)
    frozen = {n: p.detach().clone() for n, p in draft.named_parameters() if not p.requires_grad}
    expected_frozen = {"embed_tokens.weight"} | ({"lm_head.weight"} if lm_head_init == "target" else set())
    assert set(frozen) == expected_frozen
    before = _excess_step0_loss(draft, batch, head)
    cfg = TrainConfig(lr=3e-3, warmup_steps=2, total_steps=40, ttt_steps=3)
    history = train_draft_steps(draft, [batch], head, cfg)
    assert len(history) == 40 and all(h["grad_norm"] >= 0 for h in history)
    assert _excess_step0_loss(draft, batch, head) < 0.5 * before
    for name, value in frozen.items():
        assert torch.equal(dict(draft.named_parameters())[name], value), name


def test_resumed_training_equals_uninterrupted(tiny_target, tmp_path):
    """Stop after 3 of 6 steps, save the state (weights_only round trip), rebuild everything, resume: same weights."""
    batches = [_batch(tiny_target, "right", seed=1), _batch(tiny_target, "left", seed=2)]
    head = tiny_target.get_output_embeddings().weight
    cfg = TrainConfig(lr=3e-3, warmup_steps=2, total_steps=6, ttt_steps=2)

    straight = _draft(tiny_target)
    train_draft_steps(straight, batches, head, cfg)

    first = _draft(tiny_target)
    opt = make_optimizer(first, cfg)
    sched = make_scheduler(opt, cfg)
    train_draft_steps(first, batches, head, cfg, opt, sched, on_step=lambda step, _: step == 3)
    torch.save(train_state_dict(first, opt, sched, step=3), tmp_path / "state.pt")

    resumed = _draft(tiny_target, seed=123)  # different init: everything must come from the saved state
    opt2 = make_optimizer(resumed, cfg)
    sched2 = make_scheduler(opt2, cfg)
    start = load_train_state(torch.load(tmp_path / "state.pt", weights_only=True), resumed, opt2, sched2)
    assert start == 3
    history = train_draft_steps(resumed, batches[1:] + batches[:1], head, cfg, opt2, sched2, start_step=start)
    assert len(history) == 3
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_ttt_step_equals_chain_drafting_with_the_kv_cache(tiny_target, variant):
    """Train == serve: TTT step k at column t is what the draft computes when it drafts k tokens past t.

    Serving runs `draft.forward` with a KV cache: the real features up to t, then each drafted token fed
    its own previous output at the next position. TTT must produce exactly those logits.
    """
    batch = _batch(tiny_target, "none")
    draft = _variant(_draft(tiny_target, **VARIANTS[variant])).eval()
    head = tiny_target.get_output_embeddings().weight
    steps, t = 4, 5
    with torch.no_grad():
        out = ttt_forward(draft, batch["input_ids"], batch["loss_mask"], batch["aux_hidden"], batch["last_hidden"],
                          head, ttt_steps=steps, return_logits=True)
        ids = batch["input_ids"]
        pos = torch.arange(t + 1).expand(B, -1)
        # context: feature of position p paired with token p+1, for p = 0..t
        hidden, past = draft(draft.fuse(batch["aux_hidden"][:, :t + 1]), ids[:, 1:t + 2], pos)
        hidden = hidden[:, -1:]
        for k in range(steps):
            torch.testing.assert_close(draft.compute_logits(hidden)[:, 0], out.logits[k][:, t], rtol=1e-4, atol=1e-5)
            # depth k+1 sits at position t+k+1 and is fed token x[t+k+2] (teacher forcing, as in TTT)
            hidden, new = draft(hidden, ids[:, t + k + 2:t + k + 3], torch.full((B, 1), t + k + 1), past_kv=past)
            past = tuple(torch.cat(p, dim=2) for p in zip(past, new))


@pytest.mark.parametrize("norms", [False, True])
def test_p_eagle_ttt_step_equals_the_decoders_one_forward_over_mask_slots(tiny_target, norms):
    """Train == serve for P-EAGLE: TTT step k at column t is what the decoder's drafting (`tree.parallel_depths`)
    computes for depth k + 1 when the committed prefix ends at t: the root's output, then one forward over mask slots
    at positions t+1.. that attend to the prefix and causally among themselves. Checked with a mask token and a mask
    feature that differ from the fed tokens and features (a slot fed the real token would not match)."""
    from eagle_core.kv import DraftKV
    from eagle_core.tree import parallel_depths

    batch = _batch(tiny_target, "none")
    draft = _variant(_draft(tiny_target, **VARIANTS["p-eagle"], norm_before_fc=norms, norm_output=norms)).eval()
    head = tiny_target.get_output_embeddings().weight
    steps, t = 4, 5
    with torch.no_grad():
        out = ttt_forward(draft, batch["input_ids"], batch["loss_mask"], batch["aux_hidden"], batch["last_hidden"],
                          head, ttt_steps=steps, return_logits=True)
        dkv = DraftKV(B, batch["input_ids"].device)
        pos = torch.arange(t + 1).expand(B, -1)
        hidden, _ = draft(draft.fuse(batch["aux_hidden"][:, :t + 1]), batch["input_ids"][:, 1:t + 2], pos,
                          past_kv=dkv)
        dkv.lengths = torch.full((B,), t + 1)
        depths = parallel_depths(draft, dkv, hidden[:, -1:], steps, dkv.width)
        for k in range(steps):
            torch.testing.assert_close(draft.compute_logits(depths[:, k]), out.logits[k][:, t], rtol=1e-4, atol=1e-5)


def test_a_batch_that_cannot_train_the_draft_is_refused_before_the_step_by_name(tiny_target):
    """Features of another shape, a head of another vocabulary, ids past the vocabulary and a real row with nothing
    to learn are refused with a message naming them; the distributed loop's dummy row (no real token) is not."""
    from eagle_core.ttt_batch import BadBatch, check_batch

    batch = _batch(tiny_target, "right")
    draft = _draft(tiny_target)
    head = tiny_target.get_output_embeddings().weight
    check_batch(draft, batch, head)
    cases = {
        "aux_hidden": dict(batch, aux_hidden=batch["aux_hidden"][..., :-1]),
        "last_hidden": dict(batch, last_hidden=batch["last_hidden"][:, :-1]),
        "loss_mask": dict(batch, loss_mask=batch["loss_mask"][:, :-1]),
        "outside the target's vocabulary": dict(batch, input_ids=batch["input_ids"] + tiny_target.config.vocab_size),
        "row(s) [1]": dict(batch, loss_mask=batch["loss_mask"] * torch.tensor([[1], [0]])),
    }
    for words, bad in cases.items():
        with pytest.raises(BadBatch, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            check_batch(draft, bad, head)
    with pytest.raises(BadBatch, match="lm_head"):
        check_batch(draft, batch, head[:-1])
    dummy = dict(batch, attention_mask=batch["attention_mask"] * torch.tensor([[1], [0]]),
                 loss_mask=batch["loss_mask"] * torch.tensor([[1], [0]]))
    check_batch(draft, dummy, head)
    # train_step refuses a misfit before the optimizer moves a weight
    cfg = TrainConfig(total_steps=1, ttt_steps=2)
    opt = make_optimizer(draft, cfg)
    before = {n: p.detach().clone() for n, p in draft.named_parameters()}
    with pytest.raises(BadBatch, match="aux_hidden"):
        from eagle_core.ttt import train_step
        train_step(draft, cases["aux_hidden"], head, opt, make_scheduler(opt, cfg), cfg)
    assert all(torch.equal(p, before[n]) for n, p in draft.named_parameters())


def test_the_training_objective_gives_a_batch_its_teacher(tiny_target):
    """TTTObjective.teacher: the batch's target distribution under the objective's autocast (none on a CPU: the
    float32 one, bit for bit), the batch itself untouched."""
    from pipelines.train.model import TTTObjective

    batch = _batch(tiny_target, "left")
    draft = _draft(tiny_target)
    head = tiny_target.get_output_embeddings().weight
    out = TTTObjective(draft, autocast=True).teacher(batch, head)
    p, arg = target_distribution(batch["last_hidden"], head, draft.d2t)
    assert torch.equal(out["targets"][0], p) and torch.equal(out["targets"][1], arg)
    assert out["input_ids"] is batch["input_ids"] and "targets" not in batch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the GPU's teacher and head-gradient paths")
def test_the_cuda_bf16_step_takes_its_gpu_paths_and_stays_near_float32(tiny_target):
    """On CUDA under bf16 autocast: the fp32-output GEMM exists (else `float_out_mm` falls back to a slow float32
    one), the teacher keeps the float32 argmax, and the step's losses and head gradient stay near float32's."""
    from eagle_core.ttt_ops import float_out_mm

    a = torch.randn(8, 16, device="cuda", dtype=torch.bfloat16)
    assert torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
    assert float_out_mm(a, a.t()).dtype == torch.float32
    batch = {k: v.cuda() for k, v in _batch(tiny_target, "right").items()}
    draft = _draft(tiny_target).cuda()
    head = tiny_target.get_output_embeddings().weight.detach().cuda()
    p32, arg32 = target_distribution(batch["last_hidden"], head, draft.d2t)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        p16, arg16 = target_distribution(batch["last_hidden"], head, draft.d2t)
    assert torch.equal(arg16, arg32)
    torch.testing.assert_close(p16, p32, rtol=3e-2, atol=1e-4)

    class Target:  # _run reads the head through get_output_embeddings
        def get_output_embeddings(self):
            return type("Head", (), {"weight": head})

    exact, exact_grads = _run(ttt_forward, draft, batch, Target(), steps=3)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        mixed, grads = _run(ttt_forward, draft, batch, Target(), steps=3)
    torch.testing.assert_close(mixed.step_losses, exact.step_losses, rtol=2e-2, atol=2e-2)
    g, ref = grads["lm_head.weight"], exact_grads["lm_head.weight"]
    assert g.dtype == torch.float32 and float((g - ref).norm() / ref.norm()) < 0.02
