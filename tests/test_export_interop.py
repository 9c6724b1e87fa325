"""Exported drafts make every engine capture exactly the target layers the draft was trained on.

A "physical layer" below is an index into transformers' `output_hidden_states` (0 = embeddings, j = output
of decoder layer j-1), which is also how our `aux_layer_ids` count. Each `*_captured` function simulates how
one engine turns a draft's config.json into the layers it captures from the target; its docstring cites the
engine code it mirrors. `test_capture_before_layer_i_is_hidden_states_i` pins the one fact all of them
share (capturing "before decoder layer i" yields `output_hidden_states[i]`) on a real transformers model.
"""

import json

import pytest
import torch

from eagle_core.checkpoint import (
    EXPORT_KEY,
    OUR_KEY,
    eagle3_config_from,
    export_speculators,
    load_draft,
    refresh_export_config,
    resolve_verifier,
    save_draft,
)
from eagle_core.engine_ids import from_engine_ids, to_engine_ids
from eagle_core.draft import Eagle3Draft
from eagle_core.target import default_aux_layer_ids, make_tiny_llama
from eagle_core.capture import record_hidden_states
from eagle_core.vocab import build_vocab_mapping

N_LAYERS = 6  # the tiny target's depth: our default ids are [2, 3, 3]


def _nested(config: dict):
    return (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")


def vllm_captured(config: dict, num_layers: int) -> list[int]:
    """vLLM V1. The runner's `_get_eagle3_aux_layers_from_config` (vllm/v1/worker/gpu_model_runner.py; newer
    releases: `get_eagle3_aux_layers_from_config` in .../spec_decode/eagle/eagle3_utils.py) reads the draft
    hf_config's top-level `eagle_aux_hidden_state_layer_ids`; some runners fall back to
    `eagle_config["eagle_aux_hidden_state_layer_ids"]` when it is absent; otherwise the model's
    `get_eagle3_aux_hidden_state_layers()` = (2, N//2, N-3). `LlamaModel.forward` appends
    `hidden_states + residual` *before* running layer `idx` when `idx` is listed: output_hidden_states[idx].
    Speculators configs reach the same attribute (`update_eagle3` copies the top-level key)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or _nested(config)
    if not ids:
        ids = [2, num_layers // 2, num_layers - 3]
    return [int(i) for i in ids]  # captured before layer i = output_hidden_states[i]


def sglang_captured(config: dict, num_layers: int) -> list[int]:
    """SGLang. The EAGLE worker reads the draft's `eagle_config["eagle_aux_hidden_state_layer_ids"]` (None when
    absent) and calls the target's `set_eagle3_layers_to_capture(ids)` (python/sglang/srt/models/llama.py):
    None -> `layers_to_capture = [2, N//2, N-3]`; otherwise `[val + 1 for val in layer_ids]` ("for the ith
    layer, it takes the output of the (i-1)th layer"). `LlamaModel.forward` captures before layer i, i.e.
    output_hidden_states[i]."""
    ids = _nested(config)
    layers_to_capture = [2, num_layers // 2, num_layers - 3] if ids is None else [int(v) + 1 for v in ids]
    return layers_to_capture


def specforge_captured(config: dict, num_layers: int) -> list[int]:
    """SpecForge (the trainer whose drafts SGLang serves). Its training and evaluation scripts read
    `draft_config.eagle_config["eagle_aux_hidden_state_layer_ids"]` and call the target's
    `set_aux_hidden_states_layers(ids)`, default `[1, N//2 - 1, N - 4]`; an id names the decoder layer whose
    output is taken, i.e. output_hidden_states[id + 1] (SGLang's convention). `resolve_eagle_capture_layers`
    (specforge/algorithms/model_providers.py) refuses ids that are not non-negative integers."""
    ids = _nested(config)
    if ids is None:
        ids = [1, num_layers // 2 - 1, num_layers - 4]
    if any(int(i) < 0 for i in ids):
        raise ValueError(f"resolved EAGLE capture layers must contain exactly three non-negative integers, got {ids}")
    return [int(i) + 1 for i in ids]


READERS = [vllm_captured, sglang_captured, specforge_captured]

CUSTOM_IDS = [[1, 3, 5], [3, 4, 5], [1, 2, 3]]
ALL_IDS = [default_aux_layer_ids(N_LAYERS)] + CUSTOM_IDS


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama(num_hidden_layers=N_LAYERS)


def _draft(target, aux_layer_ids):
    torch.manual_seed(0)
    d2t, t2d = build_vocab_mapping(torch.randint(0, 50, (target.config.vocab_size,)), 80)
    draft = Eagle3Draft.from_target(target, draft_vocab_size=80, d2t=d2t, t2d=t2d, aux_layer_ids=aux_layer_ids)
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return draft


def _config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def _foreign(folder, **changes) -> None:
    """Strip what only we write (our block and the marker), as a checkpoint trained elsewhere would be."""
    cfg = _config(folder)
    cfg.pop(OUR_KEY)
    cfg.pop(EXPORT_KEY, None)
    cfg.pop("eagle_aux_hidden_state_layer_ids", None)
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_capture_before_layer_i_is_hidden_states_i(target):
    """The engines capture the input of decoder layer i; that is output_hidden_states[i] and our id i."""
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    seen = {}

    def pre_hook(i):
        def hook(_module, args, kwargs):
            seen[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    handles = [layer.register_forward_pre_hook(pre_hook(i), with_kwargs=True)
               for i, layer in enumerate(target.model.layers)]
    try:
        with torch.no_grad(), record_hidden_states(target, list(range(N_LAYERS))) as rec:
            hidden = target(input_ids=ids, output_hidden_states=True).hidden_states
    finally:
        for h in handles:
            h.remove()
    for i in range(N_LAYERS):
        assert torch.equal(seen[i], hidden[i]) and torch.equal(rec["aux"][i], hidden[i]), i


@pytest.mark.parametrize("aux_ids", ALL_IDS, ids=str)
def test_one_folder_makes_every_engine_capture_the_trained_layers(target, tmp_path, aux_ids):
    with _no_warning():
        save_draft(_draft(target, aux_ids), tmp_path / "d")
    cfg = _config(tmp_path / "d")
    for reader in READERS:
        assert reader(cfg, N_LAYERS) == aux_ids, reader.__name__
    assert cfg[EXPORT_KEY]["aux_layer_ids"] == aux_ids
    # The defaults too: a folder with the nested key never falls back to an engine's own default ids.
    assert _nested(cfg) == [i - 1 for i in aux_ids]


@pytest.mark.parametrize("engine", [None, "vllm", "sglang", "specforge"])
def test_naming_an_engine_writes_the_same_folder(target, tmp_path, engine):
    draft = _draft(target, [1, 3, 5])
    save_draft(draft, tmp_path / "all")
    save_draft(draft, tmp_path / str(engine), engine=engine)
    assert _config(tmp_path / str(engine)) == _config(tmp_path / "all")


def test_the_embeddings_id_is_flagged_for_the_engines_that_cannot_capture_it(target, tmp_path):
    """Id 0 is -1 in SGLang's convention: SGLang adds 1 back, SpecForge refuses a negative id."""
    draft = _draft(target, [0, 2, 4])
    with pytest.warns(UserWarning, match="include 0"):
        save_draft(draft, tmp_path / "d")
    cfg = _config(tmp_path / "d")
    assert sglang_captured(cfg, N_LAYERS) == vllm_captured(cfg, N_LAYERS) == [0, 2, 4]
    with pytest.raises(ValueError, match="non-negative"):
        specforge_captured(cfg, N_LAYERS)
    for engine in ("specforge", "vllm"):
        with pytest.raises(ValueError, match="include 0"):
            save_draft(draft, tmp_path / engine, engine=engine)
    with _no_warning():
        save_draft(draft, tmp_path / "sglang", engine="sglang")
    assert load_draft(tmp_path / "d", target=target).config.aux_layer_ids == [0, 2, 4]


@pytest.mark.parametrize("aux_ids", ALL_IDS, ids=str)
def test_speculators_export_makes_vllm_capture_the_trained_layers(target, tmp_path, aux_ids):
    export_speculators(_draft(target, aux_ids), tmp_path / "s", verifier="org/tiny-target")
    assert vllm_captured(_config(tmp_path / "s"), N_LAYERS) == aux_ids


def _legacy_vllm_export(target, folder, aux_ids):
    """A folder as the earlier default (engine="vllm") wrote it: our ids in the nested key too."""
    draft = _draft(target, aux_ids)
    save_draft(draft, folder)
    cfg = _config(folder)
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
    cfg[EXPORT_KEY] = {"engine": "vllm", "aux_layer_ids": list(aux_ids), "rule": "..."}
    (folder / "config.json").write_text(json.dumps(cfg))
    return draft


@pytest.mark.parametrize("aux_ids", [default_aux_layer_ids(N_LAYERS), [1, 3, 5]], ids=str)
def test_the_mismatch_the_rule_prevents_and_its_repair(target, tmp_path, aux_ids):
    """Our ids in the nested key make SGLang and SpecForge capture one layer deeper -- the default ids too, as
    the key is present; `refresh_export_config` rewrites such a folder without touching its weights."""
    folder = tmp_path / "d"
    draft = _legacy_vllm_export(target, folder, aux_ids)
    deeper = [i + 1 for i in aux_ids]
    assert sglang_captured(_config(folder), N_LAYERS) == specforge_captured(_config(folder), N_LAYERS) == deeper
    assert load_draft(folder, target=target).config.aux_layer_ids == aux_ids  # our loader reads our block
    weights = (folder / "model.safetensors").read_bytes()
    refresh_export_config(folder)
    assert (folder / "model.safetensors").read_bytes() == weights
    for reader in READERS:
        assert reader(_config(folder), N_LAYERS) == aux_ids, reader.__name__
    assert _config(folder) == eagle3_config_from(draft.config, "float32")


def test_refresh_refuses_what_it_cannot_rederive(target, tmp_path):
    save_draft(_draft(target, [1, 3, 5]), tmp_path / "d")
    _foreign(tmp_path / "d")
    with pytest.raises(ValueError, match="not written by this project"):
        refresh_export_config(tmp_path / "d")


def test_engine_defaults_name_the_same_layers():
    """Only the absence of the nested key lets each engine fall back to its default; they agree."""
    assert specforge_captured({}, N_LAYERS) == sglang_captured({}, N_LAYERS) == vllm_captured({}, N_LAYERS)


def test_engine_id_conversions_are_inverse():
    for ids in ALL_IDS:
        assert to_engine_ids(ids, "vllm") == ids
        assert to_engine_ids(ids, "sglang") == [i - 1 for i in ids]
        for convention in ("vllm", "sglang", "specforge"):
            assert from_engine_ids(to_engine_ids(ids, convention), convention) == ids
    assert to_engine_ids(default_aux_layer_ids(30), "sglang") == [1, 14, 26]  # SpecForge's default for 30 layers
    with pytest.raises(ValueError):
        to_engine_ids([1, 2, 3], "tensorrt")


def test_our_exports_read_back_without_being_told_the_convention(target, tmp_path):
    save_draft(_draft(target, [1, 3, 5]), tmp_path / "d")
    assert load_draft(tmp_path / "d", target=target).config.aux_layer_ids == [1, 3, 5]
    cfg = _config(tmp_path / "d")
    cfg.pop(OUR_KEY)  # the marker alone still says what the keys mean
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    assert load_draft(tmp_path / "d", target=target).config.aux_layer_ids == [1, 3, 5]


def test_specforge_checkpoint_is_read_in_its_convention(target, tmp_path):
    """A SpecForge/SGLang draft trained on layers [1, 3, 5] (ours) stores [0, 2, 4] under eagle_config."""
    draft = _draft(target, [1, 3, 5])
    save_draft(draft, tmp_path / "d")
    _foreign(tmp_path / "d")
    assert _nested(_config(tmp_path / "d")) == [0, 2, 4]
    with pytest.raises(ValueError, match="convention='sglang'"):
        load_draft(tmp_path / "d", target=target)  # ambiguous: refused, not guessed
    for convention in ("sglang", "specforge"):
        loaded = load_draft(tmp_path / "d", target=target, convention=convention)
        assert loaded.config.aux_layer_ids == [1, 3, 5]
        assert sglang_captured(_config(tmp_path / "d"), N_LAYERS) == loaded.config.aux_layer_ids
    assert load_draft(tmp_path / "d", target=target, convention="vllm").config.aux_layer_ids == [0, 2, 4]


def test_foreign_checkpoint_with_the_top_level_key_is_vllm_convention(target, tmp_path):
    save_draft(_draft(target, [1, 3, 5]), tmp_path / "d")
    _foreign(tmp_path / "d", eagle_aux_hidden_state_layer_ids=[1, 3, 5])
    assert load_draft(tmp_path / "d", target=target).config.aux_layer_ids == [1, 3, 5]


def test_a_contradictory_marker_is_refused(target, tmp_path):
    save_draft(_draft(target, None), tmp_path / "d")
    cfg = _config(tmp_path / "d")
    cfg[EXPORT_KEY]["aux_layer_ids"] = [1, 2, 3]
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="disagrees"):
        load_draft(tmp_path / "d", target=target)


def test_unknown_engine_is_refused(target, tmp_path):
    with pytest.raises(ValueError, match="unknown engine"):
        save_draft(_draft(target, None), tmp_path / "d", engine="trtllm")


def test_speculators_export_refuses_a_draft_narrower_than_its_target(target, tmp_path):
    """speculators' Eagle3DraftModel sizes fc from the draft's own width; a narrower draft would not load."""
    torch.manual_seed(0)
    d2t, t2d = build_vocab_mapping(torch.randint(0, 50, (target.config.vocab_size,)), 80)
    narrow = Eagle3Draft.from_target(target, draft_vocab_size=80, d2t=d2t, t2d=t2d, hidden_size=32,
                                     intermediate_size=64)
    with pytest.raises(ValueError, match="hidden_size 32 differs from its target's 64"):
        export_speculators(narrow, tmp_path / "s", verifier="org/tiny-target")
    assert not (tmp_path / "s").exists()
    save_draft(narrow, tmp_path / "d")  # the EAGLE-3 folder takes it (engines size fc from target_hidden_size)
    assert _config(tmp_path / "d")["target_hidden_size"] == 64 and _config(tmp_path / "d")["hidden_size"] == 32


# ---------------------------------------------------------------------------------------------------
# the speculators verifier


def test_speculators_verifier_is_a_resolvable_name(target, tmp_path):
    draft = _draft(target, None)
    assert resolve_verifier("smollm2-135m") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_verifier("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"
    (tmp_path / "target").mkdir()
    assert resolve_verifier(str(tmp_path / "target")) == str((tmp_path / "target").resolve())
    target.config._name_or_path = "org/tiny-target"
    export_speculators(draft, tmp_path / "s", verifier=target)  # the model itself: its name_or_path
    cfg = _config(tmp_path / "s")
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-target"
    draft.config.extra["target"] = "smollm2-135m"  # lineage when the caller gives nothing
    export_speculators(draft, tmp_path / "s2")
    assert _config(tmp_path / "s2")["speculators_config"]["verifier"]["name_or_path"] != "smollm2-135m"


def test_speculators_export_refuses_an_unnamed_verifier(target, tmp_path):
    draft = _draft(target, None)
    draft.config.extra.pop("target", None)
    for verifier in (None, ""):
        with pytest.raises(ValueError, match="verifier"):
            export_speculators(draft, tmp_path / "s", verifier=verifier)


class _no_warning:
    """Context manager: fail if a UserWarning is raised inside."""

    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("error", UserWarning)

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)
