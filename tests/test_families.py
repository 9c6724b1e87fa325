"""The family matrix: every model family the decoder claims decodes exactly as transformers' own `generate` (fp32,
greedy, past its sliding window or attention chunk), alone and in a ragged batch, in every mode and in the serving
engine; seeded sampling gives the same tokens with and without speculation; features, a TTT step and a saved,
reloaded and exported draft work; the families it cannot decode are refused by name before any weights load.

Drafts here are trained for a few dozen TTT steps on the tiny target's own greedy answers to the test prompts, so
trees accept several tokens a round (checked) and windows are crossed along accepted paths, not only at roots.
"""

import functools

import pytest
import torch

from decode_helpers import IdTokenizer, random_prompts, run_engine, single_thread  # noqa: F401 (autouse fixture)
from family_helpers import REFUSED, SUPPORTED, WINDOWED, _config, tiny_family_model
from eagle_core.draft import Eagle3Draft
from eagle_core.families import UnsupportedTarget, check_supported
from eagle_core.generate import generate
from eagle_core.capture import capture_features
from eagle_core.tree import TreeConfig
from eagle_core.ttt import TrainConfig, make_optimizer, make_scheduler, train_step

NEW = 24  # answers of 24 tokens after prompts of 10-19: three windows/chunks of 8 are crossed
PROMPTS = random_prompts(3, 256, lo=10, hi=20, seed=1)
TREES = {"tree": TreeConfig(4, 4, 16), "chain": TreeConfig.chain(4)}


def hf_greedy(model, prompt: list[int], new: int = NEW) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


def features_batch(model, sequences: list[list[int]], prompt_lengths: list[int]) -> dict:
    """A right-padded training batch of `sequences`, loss on the tokens after each prompt, with the target's
    features."""
    length = max(map(len, sequences))
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    attention, loss = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (seq, p) in enumerate(zip(sequences, prompt_lengths)):
        ids[i, :len(seq)], attention[i, :len(seq)], loss[i, p - 1:len(seq)] = torch.tensor(seq), 1, 1
    feats = capture_features(model, ids, attention)
    return dict(input_ids=ids, loss_mask=loss, attention_mask=attention, aux_hidden=feats.aux_hidden,
                last_hidden=feats.last_hidden)


class Family:
    """A tiny target of one family, HF's greedy answers to PROMPTS, and (on first use) a draft trained on them."""

    def __init__(self, name: str):
        self.name = name
        self.model = tiny_family_model(name)
        self.reference = [hf_greedy(self.model, p) for p in PROMPTS]
        self.batch = features_batch(self.model, [p + r for p, r in zip(PROMPTS, self.reference)],
                                    [len(p) for p in PROMPTS])

    @functools.cached_property
    def trained(self) -> tuple:
        """(draft, metrics of the first TTT step, metrics of the last)."""
        torch.manual_seed(0)
        draft = Eagle3Draft.from_target(self.model, draft_vocab_size=self.model.config.vocab_size,
                                        lm_head_init="target", freeze_lm_head=False, ttt_steps=4)
        cfg = TrainConfig(lr=1e-2, total_steps=150)
        optimizer = make_optimizer(draft, cfg)
        scheduler = make_scheduler(optimizer, cfg)
        metrics = [train_step(draft, self.batch, self.head, optimizer, scheduler, cfg) for _ in range(cfg.total_steps)]
        return draft.eval(), metrics[0], metrics[-1]

    @property
    def draft(self) -> Eagle3Draft:
        return self.trained[0]

    @property
    def head(self):
        return self.model.get_output_embeddings().weight


_FAMILIES: dict = {}


@pytest.fixture(params=SUPPORTED)
def family(request) -> Family:
    if request.param not in _FAMILIES:
        _FAMILIES[request.param] = Family(request.param)
    return _FAMILIES[request.param]


def test_features_are_the_targets_hidden_states(family):
    model, batch = family.model, family.batch
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    aux = family.draft.config.aux_layer_ids
    expected = torch.cat([out.hidden_states[i] for i in aux], dim=-1)
    torch.testing.assert_close(batch["aux_hidden"], expected, rtol=0, atol=0)
    torch.testing.assert_close(batch["last_hidden"], out.hidden_states[-1], rtol=0, atol=0)


def test_our_logits_are_the_targets(family):
    """`lm_logits` applies what the family's own forward applies after its lm_head (Granite's scaling, Gemma 2's
    soft-cap): the distribution sampling draws from is the target's."""
    from eagle_core.kv import lm_logits

    batch = family.batch
    out = family.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    torch.testing.assert_close(lm_logits(family.model, batch["last_hidden"]), out.logits, rtol=0, atol=0)


def test_a_draft_from_the_targets_head_normalises_as_the_target(family):
    """`lm_head_init="target"` copies the target's final norm as its per-channel scale (Gemma's scales by
    1 + weight), so the draft's head starts where the target's is."""
    model = tiny_family_model(family.name)  # a copy of its own: its norm weight is set away from its init value
    with torch.no_grad():
        model.model.norm.weight.add_(0.1 * torch.randn(model.model.norm.weight.shape,
                                                       generator=torch.Generator().manual_seed(1)))
    draft = Eagle3Draft.from_target(model, draft_vocab_size=model.config.vocab_size, lm_head_init="target")
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(draft.norm(x), model.model.norm(x))


def test_ttt_trains_and_the_draft_saves_loads_and_exports(family, tmp_path):
    from eagle_core.checkpoint import export_speculators, load_draft, save_draft

    _, first, last = family.trained
    assert last["loss"] < first["loss"]  # the TTT steps learned something
    save_draft(family.draft, tmp_path / "draft")
    loaded = load_draft(tmp_path / "draft", target=family.model).eval()
    b = family.batch
    hidden = family.draft.fuse(b["aux_hidden"])
    positions = torch.arange(b["input_ids"].shape[1]).expand_as(b["input_ids"])
    with torch.no_grad():
        want, _ = family.draft(hidden, b["input_ids"], positions)
        got, _ = loaded(loaded.fuse(b["aux_hidden"]), b["input_ids"], positions)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    export_speculators(family.draft, tmp_path / "speculators", verifier=str(tmp_path / "target"))
    assert (tmp_path / "speculators" / "config.json").is_file()


def test_every_mode_equals_transformers_greedy_alone_and_in_a_ragged_batch(family):
    model, draft = family.model, family.draft
    plain = generate(model, PROMPTS, max_new_tokens=NEW).tokens  # one ragged batch of 3
    assert plain == family.reference
    assert generate(model, PROMPTS[:1], max_new_tokens=NEW).tokens[0] == family.reference[0]
    for mode, tree in TREES.items():
        batch = generate(model, PROMPTS, draft=draft, tree=tree, mode=mode, max_new_tokens=NEW)
        assert batch.tokens == family.reference, mode
        alone = generate(model, PROMPTS[1:2], draft=draft, tree=tree, mode=mode, max_new_tokens=NEW)
        assert alone.tokens[0] == family.reference[1], mode
        # multi-token acceptance happened, so windows were crossed inside accepted paths too
        assert sum(a >= 2 for s in batch.stats for a in s.accept_lengths) >= 3, mode


def test_seeded_sampling_is_the_same_with_and_without_speculation(family):
    kw = dict(max_new_tokens=NEW, temperature=0.8, top_p=0.95, top_k=40, seed=3)
    plain = generate(family.model, PROMPTS, **kw).tokens
    for mode, tree in TREES.items():
        assert generate(family.model, PROMPTS, draft=family.draft, tree=tree, mode=mode, **kw).tokens == plain, mode
    assert generate(family.model, PROMPTS, **{**kw, "seed": 4}).tokens != plain  # the seed matters


def test_the_serving_engine_equals_transformers_greedy(family):
    from pipelines.serve.engine import Engine, EngineConfig
    from eagle_core.verify import SamplingConfig

    engine = Engine(family.model, IdTokenizer(), family.draft,
                    EngineConfig(TreeConfig(4, 4, 16), max_batch_size=3, explore_every=2))
    done = run_engine(engine, [(p, NEW, SamplingConfig(), None) for p in PROMPTS])
    assert [event.token_ids for event in done] == family.reference


@pytest.mark.parametrize("name", WINDOWED)
def test_ignoring_the_window_would_change_the_tokens(name, monkeypatch):
    """The matrix above is not vacuous: with every layer attending to the whole past (what the decoder did before
    it honoured windows and chunks), these targets' tokens differ from transformers'."""
    import eagle_core.attention

    model = tiny_family_model(name)
    reference = [hf_greedy(model, p) for p in PROMPTS]
    monkeypatch.setattr(eagle_core.attention, "restrict_to_span", lambda allowed, rule, positions: allowed)
    assert generate(model, PROMPTS, max_new_tokens=NEW).tokens != reference


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_families_are_refused_by_name_before_any_weights_load(name, tmp_path):
    from eagle_core.target import load_target, materialize_hf_folder

    config = _config(name)
    with pytest.raises(UnsupportedTarget, match=REFUSED[name]):
        check_supported(config)
    config.save_pretrained(tmp_path)  # a folder with a config and no weights: the refusal must come first
    with pytest.raises(UnsupportedTarget, match=REFUSED[name]):
        load_target(tmp_path, device="cpu", dtype="float32")
    # extraction, training and serving resolve every target through this one function
    with pytest.raises(UnsupportedTarget, match=REFUSED[name]):
        materialize_hf_folder(str(tmp_path))


def test_a_checkpoint_with_a_vision_tower_is_refused_by_name():
    from transformers import Gemma3Config

    with pytest.raises(UnsupportedTarget, match="Gemma 3: checkpoints with a vision tower"):
        check_supported(Gemma3Config())


def test_a_draft_for_one_family_is_refused_by_another_with_every_mismatch(tmp_path):
    from eagle_core.checkpoint import DraftTargetMismatch, load_draft, save_draft

    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    llama = tiny_family_model("llama")
    gemma = AutoModelForCausalLM.from_config(Gemma3TextConfig(vocab_size=300, hidden_size=96, num_hidden_layers=6,
                                                              intermediate_size=128, num_attention_heads=4,
                                                              num_key_value_heads=2, head_dim=16))
    save_draft(Eagle3Draft.from_target(llama, draft_vocab_size=128), tmp_path / "draft")
    with pytest.raises(DraftTargetMismatch) as refused:
        load_draft(tmp_path / "draft", target=gemma)
    message = str(refused.value)
    assert "hidden_size 96" in message and "vocab_size 300" in message and "6 layers" in message


def test_llama4_temperature_tuning_is_refused_past_its_bound_and_exact_before_it():
    """Llama 4's no-RoPE layers scale queries by the cache length once it reaches `floor_scale`; our ragged cache's
    width is not a position, so the decoder refuses to go there (named), and is exact up to it."""
    model = tiny_family_model("llama4")
    model.config.floor_scale = 24  # the bound: 23 tokens (8191 with the real config)
    for layer in model.model.layers:
        layer.self_attn.floor_scale = 24
    prompt = PROMPTS[0][:12]
    assert generate(model, [prompt], max_new_tokens=10).tokens[0] == hf_greedy(model, prompt, 10)
    with pytest.raises(UnsupportedTarget, match="Llama 4: attention temperature tuning"):
        generate(model, [prompt], max_new_tokens=16)
