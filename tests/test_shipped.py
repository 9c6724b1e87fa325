"""The draft shipped for the embedded target: small enough for git, loads against the target, and drafts well."""

import pytest

from eagle_core.chat import prompt_ids
from eagle_core.checkpoint import load_draft, read_config
from eagle_core.generate import generate
from eagle_core.shipped import shipped_draft
from eagle_core.tree import TreeConfig
from pipelines.data import load_mtbench_questions, spread_indices


def test_shipped_draft_is_small_bf16_and_documented():
    folder = shipped_draft("smollm2-135m")
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert size <= 25 * 2**20, f"{size / 2**20:.1f} MiB"
    data, config = read_config(folder)
    assert data["torch_dtype"] == "bfloat16"
    assert config.aux_layer_ids == [2, 15, 27]
    card = (folder / "README.md").read_text()
    for needed in ("python -m jobs.distill", "held-out", "tau"):
        assert needed in card


def test_every_engine_reads_the_shipped_draft_as_trained():
    """SGLang and SpecForge read eagle_config's ids and add 1; vLLM reads the top-level key as is. From the
    shipped folder each captures output_hidden_states [2, 15, 27] of the 30-layer target, the trained layers."""
    data, config = read_config(shipped_draft("smollm2-135m"))
    trained = config.aux_layer_ids
    assert config.target_num_hidden_layers == 30 and trained == [2, 15, 27]
    assert [i + 1 for i in data["eagle_config"]["eagle_aux_hidden_state_layer_ids"]] == trained  # SGLang/SpecForge
    assert data["eagle_aux_hidden_state_layer_ids"] == trained  # vLLM


def test_unknown_target_has_no_shipped_draft():
    with pytest.raises(FileNotFoundError, match="no draft ships") as refused:
        shipped_draft("meta-llama/Llama-3.1-8B-Instruct")
    # the way to one: the Ray job with the target's recipe, planned first
    assert "python jobs/train.py --target meta-llama/Llama-3.1-8B-Instruct --corpus CORPUS --dry-run" in str(refused.value)


@pytest.mark.slow
def test_shipped_draft_is_accepted_on_mtbench(smollm2):
    """Trees from the shipped draft get tokens accepted on MT-bench questions it never saw (a random-weight
    draft gets tau ~1.0; the model card's measured tau is higher than the bar here)."""
    model, tokenizer = smollm2
    draft = load_draft(shipped_draft(), target=model).eval()
    questions = load_mtbench_questions()
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": questions[i]["turns"][0]}])
               for i in spread_indices(4, len(questions))]
    out = generate(model, prompts, draft=draft, tree=TreeConfig(8, 6, 32), mode="tree", max_new_tokens=48,
                   eos_token_id=tokenizer.eos_token_id)
    accepted = [n for s in out.stats for n in s.accept_lengths]
    assert 1 + sum(accepted) / len(accepted) > 1.5


def test_serving_a_named_target_loads_its_shipped_draft_by_default():
    import jobs.serve as serve_job
    from eagle_core.shipped import shipped_draft

    for target in ("smollm2-135m", "gemma3-270m"):
        assert serve_job.served_draft("shipped", target) == str(shipped_draft(target))
    assert serve_job.served_draft("shipped", "some/other-model") is None  # nothing ships for it: plain decoding
    assert serve_job.served_draft("none", "gemma3-270m") is None
    assert serve_job.served_draft("models:/eagle3-draft@champion", "gemma3-270m") == "models:/eagle3-draft@champion"
