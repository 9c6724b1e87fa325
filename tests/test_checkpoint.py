"""Checkpoint formats: round trips, the exported key/config layout, refusal of mismatched targets."""

import json

import pytest
import torch
from safetensors import safe_open

from eagle_core.checkpoint import DraftTargetMismatch, export_speculators, load_draft, save_draft
from eagle_core.draft import Eagle3Draft
from eagle_core.target import make_tiny_llama
from eagle_core.vocab import build_vocab_mapping

EXPORT_KEYS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
}


def _trained_looking_draft(target, **kw):
    torch.manual_seed(0)
    d2t, t2d = build_vocab_mapping(torch.randint(0, 50, (target.config.vocab_size,)), 80)
    draft = Eagle3Draft.from_target(target, draft_vocab_size=80, d2t=d2t, t2d=t2d, **kw)
    with torch.no_grad():  # norms away from their init, so a skipped tensor would show
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return draft


def _logits(draft, seed=3):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(2, 7, 3 * draft.config.target_hidden_size, generator=g)
    ids = torch.randint(0, draft.config.target_vocab_size, (2, 7), generator=g)
    with torch.no_grad():
        out, _ = draft(draft.fuse(aux), ids, torch.arange(7).expand(2, 7))
        return draft.compute_logits(out)


def _keys(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_round_trip_identical_logits(tiny_target, tmp_path):
    draft = _trained_looking_draft(tiny_target)
    save_draft(draft, tmp_path / "d")
    loaded = load_draft(tmp_path / "d", target=tiny_target)
    assert loaded.config == draft.config
    assert torch.equal(_logits(loaded), _logits(draft))
    assert torch.equal(loaded.d2t, draft.d2t) and torch.equal(loaded.t2d, draft.t2d)


def test_eagle3_layout(tiny_target, tmp_path):
    save_draft(_trained_looking_draft(tiny_target), tmp_path / "d")
    tensors = _keys(tmp_path / "d" / "model.safetensors")
    assert set(tensors) == EXPORT_KEYS  # embeddings come from the target, as the engines expect
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["d2t"].shape == (80,) and tensors["t2d"].shape == (512,)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"], cfg["num_hidden_layers"]) == (80, 64, 1)
    # Our ids [2, 3, 3] at the top for vLLM; SGLang's convention (ours - 1) under eagle_config.
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]
    assert cfg["vocab_size"] == 512 and cfg["norm_before_residual"] is False


def test_speculators_export_round_trip(tiny_target, tmp_path):
    draft = _trained_looking_draft(tiny_target)
    export_speculators(draft, tmp_path / "s", verifier="tiny-llama")
    tensors = _keys(tmp_path / "s" / "model.safetensors")
    assert set(tensors) == {k.replace("midlayer.", "layers.0.") for k in EXPORT_KEYS}
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "tiny-llama"
    assert cfg["norm_before_residual"] is False
    assert torch.equal(_logits(load_draft(tmp_path / "s", target=tiny_target)), _logits(draft))


def test_foreign_checkpoint_without_our_block_loads(tiny_target, tmp_path):
    """A checkpoint written by another trainer (only the engine fields) reads back to the same draft."""
    draft = _trained_looking_draft(tiny_target)
    save_draft(draft, tmp_path / "d")
    path = tmp_path / "d" / "config.json"
    cfg = json.loads(path.read_text())
    del cfg["eagle3_pipeline"]
    path.write_text(json.dumps(cfg))
    assert torch.equal(_logits(load_draft(tmp_path / "d", target=tiny_target)), _logits(draft))


def test_an_eagle31_draft_exports_its_switches_and_norm_where_vllm_reads_them(tiny_target, tmp_path):
    """EAGLE 3.1 (issue 55): `input_norm.weight` among the tensors, `norm_before_fc` and `norm_output` at the top of
    config.json (vLLM's keys) and in the speculators export; both read back, from our block and from the engine
    fields alone (a foreign checkpoint), to the same logits; an EAGLE-3 export has neither key."""
    draft = _trained_looking_draft(tiny_target, norm_before_fc=True, norm_output=True)
    assert not torch.equal(_logits(draft), _logits(_trained_looking_draft(tiny_target)))
    save_draft(draft, tmp_path / "d")
    export_speculators(draft, tmp_path / "s", verifier="tiny-llama")
    assert set(_keys(tmp_path / "d" / "model.safetensors")) == EXPORT_KEYS | {"input_norm.weight"}
    for folder in ("d", "s"):
        cfg = json.loads((tmp_path / folder / "config.json").read_text())
        assert cfg["norm_before_fc"] is True and cfg["norm_output"] is True
        loaded = load_draft(tmp_path / folder, target=tiny_target)
        assert (loaded.config.norm_before_fc, loaded.config.norm_output) == (True, True)
        assert torch.equal(_logits(loaded), _logits(draft))
    path = tmp_path / "d" / "config.json"
    cfg = json.loads(path.read_text())
    del cfg["eagle3_pipeline"]
    path.write_text(json.dumps(cfg))
    assert torch.equal(_logits(load_draft(tmp_path / "d", target=tiny_target)), _logits(draft))
    save_draft(_trained_looking_draft(tiny_target), tmp_path / "plain")
    assert not {"norm_before_fc", "norm_output"} & set(json.loads((tmp_path / "plain" / "config.json").read_text()))


def _depth_logits(draft, steps=3):
    """The heads of a P-EAGLE round's depths (`tree.parallel_depths`) after a 7-token prefix."""
    from eagle_core.kv import DraftKV
    from eagle_core.tree import parallel_depths

    g = torch.Generator().manual_seed(3)
    aux = torch.randn(1, 7, 3 * draft.config.target_hidden_size, generator=g)
    ids = torch.randint(0, draft.config.target_vocab_size, (1, 7), generator=g)
    with torch.no_grad():
        dkv = DraftKV(1, aux.device)
        out, _ = draft(draft.fuse(aux), ids, torch.arange(7)[None], past_kv=dkv)
        dkv.lengths = torch.full((1,), 7)
        return draft.compute_logits(parallel_depths(draft, dkv, out[:, -1:], steps, dkv.width))


def test_a_p_eagle_draft_exports_its_mask_where_vllm_reads_it(tiny_target, tmp_path):
    """P-EAGLE (issue 55): `mask_hidden` among the tensors, `mask_token_id` and `parallel_drafting` at the top of
    config.json; read back from our block and from the engine fields alone to the same depth logits; vLLM's
    speculative config for the folder asks for parallel drafting, and an EAGLE-3 folder's does not."""
    from pipelines.engines.vllm_spec import speculative_config

    draft = _trained_looking_draft(tiny_target, parallel_drafting=True, mask_token_id=7)
    save_draft(draft, tmp_path / "d")
    export_speculators(draft, tmp_path / "s", verifier="tiny-llama")
    assert set(_keys(tmp_path / "d" / "model.safetensors")) == EXPORT_KEYS | {"mask_hidden"}
    for folder in ("d", "s"):
        cfg = json.loads((tmp_path / folder / "config.json").read_text())
        assert (cfg["parallel_drafting"], cfg["mask_token_id"]) == (True, 7)
        assert torch.equal(_depth_logits(load_draft(tmp_path / folder, target=tiny_target)), _depth_logits(draft))
    path = tmp_path / "d" / "config.json"
    cfg = json.loads(path.read_text())
    del cfg["eagle3_pipeline"]
    path.write_text(json.dumps(cfg))
    loaded = load_draft(tmp_path / "d", target=tiny_target)
    assert loaded.config.mask_token_id == 7 and torch.equal(_depth_logits(loaded), _depth_logits(draft))
    assert speculative_config(str(tmp_path / "d"), 3)["parallel_drafting"] is True
    save_draft(_trained_looking_draft(tiny_target), tmp_path / "plain")
    assert "parallel_drafting" not in speculative_config(str(tmp_path / "plain"), 3)


def test_own_embeddings_are_saved_when_hidden_differs(tiny_target, tmp_path):
    draft = _trained_looking_draft(tiny_target, hidden_size=32, intermediate_size=64)
    save_draft(draft, tmp_path / "d")
    assert "embed_tokens.weight" in _keys(tmp_path / "d" / "model.safetensors")
    assert torch.equal(_logits(load_draft(tmp_path / "d")), _logits(draft))


def test_bf16_save_and_load(tiny_target, tmp_path):
    draft = _trained_looking_draft(tiny_target)
    save_draft(draft, tmp_path / "d", dtype=torch.bfloat16)
    tensors = _keys(tmp_path / "d" / "model.safetensors")
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64
    loaded = load_draft(tmp_path / "d", target=tiny_target, dtype=torch.float32)
    torch.testing.assert_close(_logits(loaded), _logits(draft), rtol=0.05, atol=0.05)


def test_a_draft_loaded_for_a_target_takes_its_dtype(tmp_path):
    """Beside a bf16 target the draft runs in bf16 unless told otherwise (fp32 draft steps cost ~2x on CPUs)."""
    target = make_tiny_llama(dtype=torch.bfloat16)
    save_draft(_trained_looking_draft(make_tiny_llama()), tmp_path / "d")
    assert {p.dtype for p in load_draft(tmp_path / "d", target=target).parameters()} == {torch.bfloat16}
    assert load_draft(tmp_path / "d", target=target, dtype=torch.float32).fc.weight.dtype == torch.float32
    assert load_draft(tmp_path / "d").fc.weight.dtype == torch.float32  # no target: as saved (fp32 here)


@pytest.mark.parametrize("target_kw, field", [
    (dict(num_hidden_layers=3), "aux_layer_ids"),
    (dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1), "target_hidden_size"),
    (dict(vocab_size=600), "vocab"),
])
def test_refuses_mismatched_target(tiny_target, tmp_path, target_kw, field):
    save_draft(_trained_looking_draft(tiny_target), tmp_path / "d")
    other = make_tiny_llama(**target_kw)
    with pytest.raises(DraftTargetMismatch, match=field):
        load_draft(tmp_path / "d", target=other)


def test_refuses_same_ids_on_a_deeper_target(tiny_target, tmp_path):
    """Ids that are in range but were picked for another depth are a silent acceptance killer."""
    save_draft(_trained_looking_draft(tiny_target), tmp_path / "d")
    with pytest.raises(DraftTargetMismatch, match="6-layer target"):
        load_draft(tmp_path / "d", target=make_tiny_llama(num_hidden_layers=12))


def test_without_target_warns_about_embeddings(tiny_target, tmp_path):
    draft = _trained_looking_draft(tiny_target)
    save_draft(draft, tmp_path / "d")
    with pytest.warns(UserWarning, match="set_target_embeddings"):
        loaded = load_draft(tmp_path / "d")
    loaded.set_target_embeddings(tiny_target.get_input_embeddings().weight)
    assert torch.equal(_logits(loaded), _logits(draft))
