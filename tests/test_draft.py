"""Properties of the draft model's inference contract (eagle_core/draft.py)."""

import pytest
import torch

from eagle_core.draft import DraftConfig, Eagle3Draft, causal_mask_with_cache
from eagle_core.target import default_aux_layer_ids, make_tiny_llama


def _draft(target, **kw):
    torch.manual_seed(0)
    return Eagle3Draft.from_target(target, draft_vocab_size=kw.pop("draft_vocab_size", 128), **kw)


def _inputs(draft, b=2, s=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, draft.config.hidden_size, generator=g)
    ids = torch.randint(0, draft.config.target_vocab_size, (b, s), generator=g)
    pos = torch.arange(s).expand(b, s)
    return hidden, ids, pos


def test_config_follows_target(tiny_target):
    cfg = DraftConfig.from_target(tiny_target.config, draft_vocab_size=10_000)
    tc = tiny_target.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        tc.hidden_size, tc.num_attention_heads, tc.num_key_value_heads, tc.head_dim)
    assert cfg.draft_vocab_size == tc.vocab_size  # capped at the target vocab
    assert cfg.aux_layer_ids == default_aux_layer_ids(tc.num_hidden_layers)
    assert DraftConfig.from_dict(cfg.to_dict()) == cfg


def test_embeddings_are_the_targets_and_frozen(tiny_target):
    draft = _draft(tiny_target)
    target_embed = tiny_target.get_input_embeddings().weight
    assert draft.embed_tokens.weight.data_ptr() == target_embed.data_ptr()
    assert not draft.embed_tokens.weight.requires_grad
    assert draft.fc.weight.shape == (64, 3 * 64)
    assert draft.midlayer.self_attn.q_proj.weight.shape[1] == 2 * 64


def test_rope_matches_target(tiny_target):
    """Our rotary tables equal the target's (a wrong rope_theta mapping would silently hurt acceptance)."""
    draft = _draft(tiny_target)
    pos = torch.arange(50)[None]
    x = torch.zeros(1, 50, 64)
    cos_t, sin_t = tiny_target.model.rotary_emb(x, pos)
    cos, sin = draft.rope(pos, torch.float32)
    torch.testing.assert_close(cos[:, 0], cos_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin[:, 0], sin_t, rtol=1e-5, atol=1e-5)


def test_rope_keeps_float32_frequencies_in_bf16(tiny_target):
    """`.to(bfloat16)` must not round the rotary frequencies (errors grow with the position)."""
    draft = _draft(tiny_target)
    pos = torch.tensor([[0, 1000, 3000, 4000]])
    cos32, sin32 = draft.rope(pos, torch.float32)
    cos16, sin16 = draft.to(torch.bfloat16).rope(pos, torch.bfloat16)
    torch.testing.assert_close(cos16.float(), cos32, rtol=0, atol=8e-3)
    torch.testing.assert_close(sin16.float(), sin32, rtol=0, atol=8e-3)


def test_kv_cache_matches_full_forward(tiny_target):
    """Running a sequence in chunks with the returned (k, v) equals one causal forward."""
    draft = _draft(tiny_target).eval()
    hidden, ids, pos = _inputs(draft)
    with torch.no_grad():
        full, (k_full, v_full) = draft(hidden, ids, pos)
        out1, kv1 = draft(hidden[:, :4], ids[:, :4], pos[:, :4])
        out2, kv2 = draft(hidden[:, 4:7], ids[:, 4:7], pos[:, 4:7], past_kv=kv1)
        past = tuple(torch.cat(p, dim=2) for p in zip(kv1, kv2))
        out3, _ = draft(hidden[:, 7:], ids[:, 7:], pos[:, 7:], past_kv=past)
    torch.testing.assert_close(torch.cat([out1, out2, out3], 1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([kv1[0], kv2[0]], 2), k_full[:, :, :7], rtol=1e-5, atol=1e-5)


def test_explicit_mask_hides_entries(tiny_target):
    """A tree mask that hides cache entries equals a forward where those entries never existed."""
    draft = _draft(tiny_target).eval()
    hidden, ids, pos = _inputs(draft, s=6)
    with torch.no_grad():
        _, kv = draft(hidden[:, :5], ids[:, :5], pos[:, :5])
        keep = torch.tensor([0, 1, 3])  # hide cached entries 2 and 4
        mask = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
        mask[..., keep] = True
        mask[..., 5] = True
        masked, _ = draft(hidden[:, 5:], ids[:, 5:], pos[:, 5:], attention_mask=mask, past_kv=kv)
        pruned = tuple(t[:, :, keep] for t in kv)
        direct, _ = draft(hidden[:, 5:], ids[:, 5:], pos[:, 5:], past_kv=pruned)
    torch.testing.assert_close(masked, direct, rtol=1e-5, atol=1e-5)
    assert causal_mask_with_cache(2, 5, "cpu").tolist() == [[[[True] * 4 + [False], [True] * 5]]]


def test_bf16_draft_step_with_a_tree_mask_agrees_with_float32(tiny_target):
    """A bf16 draft step on a CPU (cache + tree mask, SDPA's grouped-query path) agrees with float32."""
    draft = _draft(tiny_target).eval()
    hidden, ids, pos = _inputs(draft, s=8)
    mask = torch.ones(2, 1, 3, 8, dtype=torch.bool)
    mask[:, :, 1, 6] = mask[:, :, 0, 6:] = False  # tree-like: not every new entry sees the others
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        d = _draft(tiny_target).to(dtype).eval()
        with torch.no_grad():
            _, kv = d(hidden[:, :5].to(dtype), ids[:, :5], pos[:, :5])
            out[dtype], _ = d(hidden[:, 5:].to(dtype), ids[:, 5:], pos[:, 5:], attention_mask=mask, past_kv=kv)
    torch.testing.assert_close(out[torch.bfloat16].float(), out[torch.float32], rtol=0.05, atol=0.05)


def test_vocab_mapping_and_logits(tiny_target):
    draft = _draft(tiny_target, draft_vocab_size=4)
    draft.set_vocab(torch.tensor([3, 3, 5, 10]), torch.zeros(512, dtype=torch.bool).index_fill_(
        0, torch.tensor([3, 4, 7, 13]), True))
    assert draft.draft_to_target(torch.tensor([[0, 1, 2, 3]])).tolist() == [[3, 4, 7, 13]]
    hidden, ids, pos = _inputs(draft)
    out, _ = draft(hidden, ids, pos)
    logits = draft.compute_logits(out.to(torch.bfloat16).float())
    assert logits.shape == (2, 9, 4) and logits.dtype == torch.float32


def test_lm_head_from_target_rows(tiny_target):
    draft = _draft(tiny_target, lm_head_init="target", draft_vocab_size=8)
    rows = draft.draft_to_target(torch.arange(8))
    assert torch.equal(draft.lm_head.weight, tiny_target.get_output_embeddings().weight[rows])
    assert not draft.lm_head.weight.requires_grad  # speculators' recipe: frozen
    trainable = _draft(tiny_target, lm_head_init="target", freeze_lm_head=False, draft_vocab_size=8)
    assert trainable.lm_head.weight.requires_grad


def test_draft_hidden_size_can_differ():
    target = make_tiny_llama(hidden_size=64)
    draft = _draft(target, hidden_size=32, intermediate_size=64)
    assert draft.config.target_hidden_size == 64 and draft.config.head_dim == 8
    assert draft.embed_tokens.weight.requires_grad  # its own embedding: the target's does not fit
    aux = torch.randn(1, 5, 3 * 64)
    hidden = draft.fuse(aux)
    out, (k, _) = draft(hidden, torch.randint(0, 512, (1, 5)), torch.arange(5)[None])
    assert out.shape == (1, 5, 32) and k.shape == (1, 2, 5, 8)
    with pytest.raises(ValueError):
        DraftConfig.from_target(target.config, hidden_size=32, lm_head_init="target")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_on_cuda(tiny_target):
    draft = _draft(tiny_target.cuda()).cuda().to(torch.bfloat16)
    hidden, ids, pos = (t.cuda() for t in _inputs(draft))
    out, _ = draft(hidden.bfloat16(), ids, pos)
    assert draft.compute_logits(out).dtype == torch.float32
