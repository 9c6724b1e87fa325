"""The second real target, Gemma 3 270M (`load_target("gemma3-270m")`): sliding and global layers, a 262k vocabulary,
Gemma's turn format. Loaded from the suite's model cache (CI's starts empty, so this converts the GGUF); decoded
past its 512-token sliding window, with the draft shipped for it, equal to transformers' greedy in fp32."""

import json

import pytest
import torch

from decode_helpers import run_engine
from eagle_core.checkpoint import DraftTargetMismatch, load_draft
from eagle_core.chat import prompt_ids
from eagle_core.generate import generate
from eagle_core.shipped import shipped_draft
from eagle_core.target import GEMMA3_NAME, SMOLLM2_NAME, load_target, materialize_hf_folder
from eagle_core.tree import TreeConfig

pytestmark = pytest.mark.slow
NEW = 16


@pytest.fixture(scope="module")
def gemma3():
    return load_target(GEMMA3_NAME, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def long_prompt(gemma3):
    """A held-out ShareGPT conversation past the 512-token sliding window (560-700 tokens: its prefills are most of
    this module's time; 1 030-1 150, twice the window, until the suite had to fit 15 minutes) under Gemma's turn
    format."""
    from pipelines.prompt_sets import long_context

    (item,), _ = long_context(gemma3[1], 1, 0, min_tokens=560, max_tokens=700)
    return prompt_ids(gemma3[1], item["messages"])


@pytest.fixture(scope="module")
def short_prompt(gemma3):
    return prompt_ids(gemma3[1], [{"role": "user", "content": "Name three colours of the rainbow."}])


@pytest.fixture(scope="module")
def reference(gemma3, long_prompt, short_prompt):
    """transformers' greedy answers (NEW tokens) to the long and the short prompt, computed once for the module.
    This module runs on all the process's threads (no `single_thread`): a 270M target's 1000-token prefills are
    matrix work that a second core speeds up, unlike the tiny models elsewhere."""
    model = gemma3[0]
    return [model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, len(p):]
            .tolist() for p in (long_prompt, short_prompt)]


@pytest.fixture(scope="module")
def gemma3_draft(gemma3):
    return load_draft(shipped_draft(GEMMA3_NAME), target=gemma3[0]).eval()


def test_the_named_target_converts_with_its_layers_and_turn_format(gemma3):
    model, tokenizer = gemma3
    config = model.config
    assert config.model_type == "gemma3_text" and config.vocab_size == 262144 and config.sliding_window == 512
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert (materialize_hf_folder(GEMMA3_NAME) / "config.json").is_file()


def test_the_shipped_draft_is_the_default_and_in_the_engines_layout(gemma3):
    folder = shipped_draft(GEMMA3_NAME)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["torch_dtype"] == "bfloat16" and (folder / "README.md").is_file()
    draft = load_draft(folder, target=gemma3[0])
    assert draft.config.target_vocab_size == 262144 and draft.config.draft_vocab_size == 32000


def test_decoding_past_the_sliding_window_equals_transformers_greedy(gemma3, long_prompt, short_prompt, reference,
                                                                    gemma3_draft):
    """Speculative decoding in both modes, in a ragged batch of the long and the short prompt. (Our plain loop ran
    here too until the suite had to fit 15 minutes: it is the modes' lossless reference, and tests/test_families.py
    checks it, and every mode, past the window of a Gemma 3 configuration.)"""
    model, draft, short = gemma3[0], gemma3_draft, short_prompt
    assert len(long_prompt) > model.config.sliding_window  # every answer token's window leaves the prompt's start out
    accepted = 0
    for mode, tree in (("tree", TreeConfig(8, 3, 16)), ("chain", TreeConfig.chain(3))):
        spec = generate(model, [long_prompt, short], draft=draft, tree=tree, mode=mode, max_new_tokens=NEW)
        assert spec.tokens == reference, mode
        accepted += sum(spec.stats[0].accept_lengths)
    assert accepted > 0  # the draft's guesses were accepted on the long context: paths crossed the window


def test_the_serving_engine_decodes_past_the_window_as_transformers(gemma3, long_prompt, reference, gemma3_draft):
    from pipelines.serve.engine import Engine, EngineConfig
    from eagle_core.verify import SamplingConfig

    (model, tokenizer), draft, reference = gemma3, gemma3_draft, reference[0]
    engine = Engine(model, tokenizer, draft, EngineConfig(TreeConfig(8, 2, 8), max_batch_size=2))
    done = run_engine(engine, [(long_prompt, NEW, SamplingConfig(), None)], timeout=300)
    tokens = done[0].token_ids
    assert done[0].kind == "done" and tokens == reference[:len(tokens)]
    assert len(tokens) == NEW or tokens[-1] in engine.eos  # the whole answer, or up to the end of sequence


def test_a_draft_for_one_named_target_is_refused_by_the_other(gemma3, smollm2):
    for draft, target, sizes in ((SMOLLM2_NAME, gemma3[0], ("576", "49152", "30")),
                                 (GEMMA3_NAME, smollm2[0], ("640", "262144", "18"))):
        with pytest.raises(DraftTargetMismatch) as refused:
            load_draft(shipped_draft(draft), target=target)
        message = str(refused.value)
        assert all(size in message for size in sizes), message  # hidden size, vocabulary and layers, all listed
