"""Target loading and multi-layer feature capture."""

import pytest
import torch

from eagle_core.chat import prompt_ids
from eagle_core.target import default_aux_layer_ids, load_target, make_tiny_llama, materialize_hf_folder
from eagle_core.capture import capture_features, record_hidden_states


def reference_features(model, input_ids, attention_mask, aux_layer_ids):
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    hs = out.hidden_states
    return torch.cat([hs[j] for j in aux_layer_ids], dim=-1), hs[-1], out.logits


@pytest.mark.parametrize("aux_layer_ids", [None, [0, 1, 5], [3, 1, 4]])
def test_capture_equals_output_hidden_states_slices(aux_layer_ids):
    model = make_tiny_llama(dtype=torch.float64)
    torch.manual_seed(0)
    input_ids = torch.randint(3, 512, (3, 17))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :5] = 0  # left padding on one row
    ids = aux_layer_ids or default_aux_layer_ids(model.config.num_hidden_layers)
    got = capture_features(model, input_ids, attention_mask, aux_layer_ids, return_logits=True)
    aux, last, logits = reference_features(model, input_ids, attention_mask, ids)
    assert got.aux_hidden.shape == (3, 17, 3 * 64)
    torch.testing.assert_close(got.aux_hidden, aux, rtol=0, atol=0)
    torch.testing.assert_close(got.last_hidden, last, rtol=0, atol=0)
    torch.testing.assert_close(got.logits, logits, rtol=0, atol=0)
    # The final hidden state is what the lm_head sees.
    torch.testing.assert_close(model.lm_head(got.last_hidden), logits)


def test_default_aux_layer_ids_follow_the_convention():
    assert default_aux_layer_ids(30) == [2, 15, 27]
    assert default_aux_layer_ids(6) == [2, 3, 3]


def test_out_of_range_layer_id_is_refused():
    model = make_tiny_llama()
    with pytest.raises(ValueError, match="out of range"):
        with record_hidden_states(model, [0, 3, 6]):
            pass


def test_hooks_are_removed_after_capture():
    model = make_tiny_llama()
    capture_features(model, torch.randint(0, 512, (1, 4)))
    assert all(not m._forward_hooks for m in model.modules())


def test_tiny_llama_is_deterministic_per_seed():
    a, b, c = make_tiny_llama(seed=1), make_tiny_llama(seed=1), make_tiny_llama(seed=2)
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_unknown_target_spec_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither"):
        materialize_hf_folder(tmp_path)
    with pytest.raises(FileNotFoundError, match="GGUF"):
        materialize_hf_folder(tmp_path / "missing.gguf")


@pytest.mark.slow
def test_real_smollm2_answers_a_simple_question(smollm2):
    model, tokenizer = smollm2
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    ids = torch.tensor([prompt_ids(tokenizer, [{"role": "user", "content": "What is the capital of France?"}])])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_real_smollm2_capture_matches_hidden_states(smollm2):
    model, tokenizer = smollm2
    ids = torch.tensor([tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]])
    got = capture_features(model, ids)
    aux, last, _ = reference_features(model, ids, None, [2, 15, 27])
    torch.testing.assert_close(got.aux_hidden, aux)
    torch.testing.assert_close(got.last_hidden, last)


@pytest.mark.slow
def test_cached_conversion_loads_identical_weights(smollm2):
    model, _ = smollm2
    again, _ = load_target("smollm2-135m", device="cpu", dtype="float32")
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


_CONVERT = """
import hashlib, sys
import gguf
parses = []
class CountingReader(gguf.GGUFReader):  # counts how often the GGUF's metadata is parsed
    def __init__(self, *args, **kwargs):
        parses.append(args[0])
        super().__init__(*args, **kwargs)
gguf.GGUFReader = CountingReader
from transformers import modeling_gguf_pytorch_utils as gguf_utils
loads, original_load = [], gguf_utils.load_gguf_checkpoint
def counting_load(path, return_tensors=False, **kwargs):  # counts the metadata-only parses into Python values
    loads.append(return_tensors)
    return original_load(path, return_tensors=return_tensors, **kwargs)
gguf_utils.load_gguf_checkpoint = counting_load
from eagle_core.target import materialize_hf_folder
folder = materialize_hf_folder("smollm2-135m")
digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
print("RESULT", folder, digest, f"{loads.count(False)}+{loads.count(True)}", len(parses))
"""


@pytest.mark.slow
def test_concurrent_first_conversion_into_an_empty_cache(tmp_path):
    """Three processes converting the GGUF at once into an empty cache (the first `make demo`: regeneration and
    extraction actors start together) all succeed, agree on one folder with identical weights, and leave no
    temporary folder behind; one of them converts, reading the GGUF's metadata once (not once per tokenizer,
    config and weights: `eagle_core.gguf_convert.one_gguf_parse`) and turning it into Python values once for the
    configs and once with the weights (not four times)."""
    import os
    import subprocess
    import sys

    cache = tmp_path / "cache"
    env = {**os.environ, "EAGLE3_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _CONVERT], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results.append(next(line.split()[1:] for line in out.splitlines() if line.startswith("RESULT")))
    assert sorted(int(r.pop()) for r in results) == [0, 0, 1], results  # the converter parsed once
    # ... and turned the metadata into Python values once for the tokenizer and configs, once with the weights
    assert sorted(r.pop() for r in results) == ["0+0", "0+0", "1+1"], results
    assert len({tuple(r) for r in results}) == 1, results
    folder = results[0][0]
    leftovers = [p.name for p in (cache / "targets").iterdir() if ".tmp" in p.name]
    assert leftovers == [], leftovers
    assert os.path.isfile(os.path.join(folder, "config.json"))


def test_stale_temporary_folder_of_a_killed_fill_is_removed(tmp_path):
    """`cached_folder` (the GGUF conversion, remote targets, registry drafts): a temporary folder left by a process
    killed mid-fill is removed before the next fill, and the folder appears complete."""
    from eagle_core.target import cached_folder

    out = tmp_path / "targets" / "model-0123"
    stale = out.with_name(out.name + ".tmp_killed")
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # half-written by a process that died
    fills = []

    def fill(tmp):
        fills.append(tmp)
        (tmp / "config.json").write_text('{"complete": true}')

    assert cached_folder(out, fill) == out and cached_folder(out, fill) == out
    assert len(fills) == 1 and (out / "config.json").read_text() == '{"complete": true}'
    assert not stale.exists() and sorted(p.name for p in out.parent.iterdir()) == [out.name, out.name + ".lock"]


def test_device_mapped_target_captures_the_same_features(tiny_target_dir):
    """A target placed with device_map (several GPUs per copy on clusters; accelerate's placement on this CPU)
    gives the features of the plainly loaded one."""
    plain, _ = load_target(str(tiny_target_dir), device="cpu", dtype=torch.float32)
    mapped, _ = load_target(str(tiny_target_dir), device="cpu", dtype=torch.float32, device_map="auto")
    ids = torch.randint(3, 500, (2, 9))
    a, b = capture_features(plain, ids), capture_features(mapped, ids)
    assert torch.equal(a.aux_hidden, b.aux_hidden) and torch.equal(a.last_hidden, b.last_hidden)


def test_device_mapped_target_decodes_the_same_tokens(tiny_target_dir, tmp_path):
    """A serve replica holding several GPUs loads one target copy with device_map; decoding (prefill, trees with
    their in-place cache edits, plain steps) must give the tokens of the plainly loaded target. On this CPU
    accelerate places every layer on the CPU, so this checks the code path, not cross-device copies."""
    from decode_helpers import echo_draft
    from eagle_core.checkpoint import save_draft
    from eagle_core.generate import generate
    from eagle_core.tree import TreeConfig
    from pipelines.serve.models import load_models

    plain, _ = load_target(str(tiny_target_dir), device="cpu", dtype=torch.float32)
    save_draft(echo_draft(plain), tmp_path / "draft")
    prompts = [[5, 17, 99, 4], [8, 8, 3]]
    outs = []
    for device_map in (None, "auto"):
        m = load_models(str(tiny_target_dir), str(tmp_path / "draft"), device="cpu", dtype="float32",
                        device_map=device_map)
        outs.append([generate(m.target, prompts, draft=m.draft, tree=TreeConfig(4, 3, 8), mode=mode,
                              max_new_tokens=12).tokens for mode in ("tree", "plain")])
    assert outs[0] == outs[1]
    assert outs[0][0] == outs[0][1]  # and trees are lossless on both
