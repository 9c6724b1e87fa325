"""The serving-engine gate (pipelines/serving_gate.py): a draft's acceptance in vLLM against our decoder's.

Real vLLM (its CPU build), real SmolLM2 (`load_target("smollm2-135m")`) in fp32, 4 MT-bench prompts x 32 tokens at
k = 3. Our decoder's chain-3 tau of the shipped draft is measured once (the module's `shipped` fixture, through
retraining's own path, `pipelines.retrain.evaluate.serving_gates`, which also measures the shipped draft in vLLM);
each planted export then costs one vLLM engine start (in this process; a few seconds after the first). Each plant
goes through the training job's export (`export_draft`, which must not finish) and retraining's promotion
(`promote`, which must not promote), against a real MLflow registry (SQLite in the test's folder).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import types
from pathlib import Path

import pytest
import torch
from process_helpers import vllm_children

K, PROMPTS, TOKENS = 3, 4, 32


@pytest.fixture(scope="module")
def smollm2():
    from eagle_core.target import load_target

    return load_target("smollm2-135m", dtype=torch.float32)


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    from pipelines import tracking

    folder = tmp_path_factory.mktemp("gate-registry")
    saved = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{folder / 'mlflow.db'}"
    tracking.configure()
    yield folder
    if saved is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = saved
    tracking.configure()


@pytest.fixture(scope="module")
def shipped(smollm2):
    """Retraining's gate on the shipped draft: (config, prompts' token ids, its GateResult, our chain tau)."""
    pytest.importorskip("vllm")
    from eagle_core.chat import prompt_ids
    from eagle_core.shipped import shipped_draft
    from pipelines.prompt_sets import prompt_set
    from pipelines.retrain import RetrainConfig
    from pipelines.retrain.evaluate import serving_gates

    target, tokenizer = smollm2
    prompts, _ = prompt_set("mtbench", tokenizer, PROMPTS, 0)
    config = RetrainConfig(target="smollm2-135m", eval_max_new_tokens=TOKENS, serving_gate="vllm", serving_gate_k=K)
    folder = shipped_draft("smollm2-135m")
    gate = serving_gates(config, target, tokenizer, prompts, {"new": folder}, {"new": folder})["new"]
    ids = [prompt_ids(tokenizer, item["messages"]) for item in prompts]
    yield config, ids, gate
    assert not vllm_children(), "a vLLM engine core outlived its engine"


# ---- the plants: each alone, in the folder the export hands to vLLM ------------------------------------------------

def shift_aux_ids(folder: Path) -> None:
    path = folder / "config.json"
    data = json.loads(path.read_text())
    data["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in data["eagle_aux_hidden_state_layer_ids"]]
    path.write_text(json.dumps(data, indent=2))


def scramble_d2t(folder: Path) -> None:
    """The draft's tokens map to a permutation of the target tokens it was trained on; t2d is left as it was (it
    marks the same target tokens; our loader refuses a d2t out of order, vLLM does not check)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    base = torch.arange(tensors["d2t"].numel())
    targets = base + tensors["d2t"]
    tensors["d2t"] = (targets[torch.randperm(len(base), generator=torch.Generator().manual_seed(0))] - base)
    save_file(tensors, str(path), metadata={"format": "pt"})


def flip_norm_before_residual(folder: Path) -> None:
    path = folder / "config.json"
    data = json.loads(path.read_text())
    data["norm_before_residual"] = not data["norm_before_residual"]
    path.write_text(json.dumps(data, indent=2))


PLANTS = {"aux layer ids shifted by one": (shift_aux_ids, ["aux layer ids", "[3, 16, 28]", "[2, 15, 27]"]),
          "d2t scrambled": (scramble_d2t, ["vocabulary mapping: d2t differs from the checkpoint's in"]),
          "norm_before_residual flipped": (flip_norm_before_residual, ["norm_before_residual: the export makes vLLM "
                                                                       "use True"])}


def gate_in_process(smollm2, shipped, our_tau: float):
    """The gate `export_draft` runs (`pipelines.train.export.export_gate` runs the same `measure` in a Ray task after
    its own target load): the exported folder in vLLM against our chain tau of the checkpoint."""
    from eagle_core.target import materialize_hf_folder
    from pipelines.serving_gate import measure

    target, tokenizer = smollm2
    _, ids, _ = shipped
    return lambda export, checkpoint: measure(materialize_hf_folder("smollm2-135m"), export, ids, K, TOKENS,
                                              tokenizer.eos_token_id, "float32", our_tau, name="candidate",
                                              reference_folder=checkpoint, target_config=target.config)


def export_with(tmp_path, monkeypatch, smollm2, shipped, plant=None, gate=None):
    """`export_draft` of the shipped draft as the training checkpoint, with `plant` applied to the export as it is
    copied (an export bug), gated in this process (`gate`: the gate's answer, without measuring again). Returns
    (draft folder, speculators folder, result or error)."""
    import pipelines.train.export as export
    from eagle_core.shipped import shipped_draft
    from pipelines.serving_gate import ServingGateFailed

    def copytree(src, dst, **kwargs):
        shutil.copytree(src, dst, **kwargs)
        if plant is not None:
            plant(Path(dst))

    monkeypatch.setattr(export, "shutil", types.SimpleNamespace(copytree=copytree, rmtree=shutil.rmtree))
    draft_dir, spec_dir = tmp_path / "draft", tmp_path / "draft-speculators"
    gate = gate or gate_in_process(smollm2, shipped, shipped[2].chain_tau)
    try:
        outcome = export.export_draft(shipped_draft("smollm2-135m"), draft_dir, spec_dir, "smollm2-135m", gate=gate)
    except ServingGateFailed as err:
        outcome = err
    return draft_dir, spec_dir, outcome


def register(folder: Path, name: str) -> str:
    from pipelines.retrain import register_draft_folder

    return str(register_draft_folder(str(folder), name, "candidate", experiment="gate-tests"))


def test_the_shipped_draft_passes_in_vllm_as_in_our_decoder(tmp_path, monkeypatch, smollm2, shipped, registry):
    """vLLM's acceptance length of the shipped draft equals our chain tau (fp32); its export finishes and
    retraining promotes it (no champion yet), tagging the version with its acceptance length in vLLM."""
    from eagle_core.shipped import shipped_draft
    from pipelines.engines.vllm_spec import ACCEPTANCE_TAG
    from pipelines.registry import CHAMPION, alias_version, client
    from pipelines.retrain.job import promote

    config, ids, gate = shipped
    print(f"\n[gate] shipped: {gate.message()}")
    assert gate.passed and not gate.causes and gate.k == K and gate.prompts == PROMPTS
    assert gate.chain_tau > 1.2  # the planted drafts' 1.0 must be far below 0.9x of it
    assert gate.vllm_acceptance_length == pytest.approx(gate.chain_tau, abs=0.05)
    assert gate.vllm_counts["num_drafts"] > 0 and len(gate.vllm_counts["acceptance_per_position"]) == K
    assert set(gate.metrics()) >= {"serving_gate/vllm_acceptance_length", "serving_gate/chain_tau",
                                   "serving_gate/ratio", "serving_gate/passed"}

    seen = []  # the export is a byte copy of the shipped draft: the fixture measured those bytes already
    draft_dir, spec_dir, outcome = export_with(tmp_path, monkeypatch, smollm2, shipped,
                                               gate=lambda export, checkpoint: seen.append(export) or gate)
    assert outcome is gate and seen == [draft_dir]
    assert (draft_dir / "model.safetensors").exists() and (spec_dir / "model.safetensors").exists()

    version = register(shipped_draft("smollm2-135m"), "gate-shipped")
    decision, _ = promote(dataclasses.replace(config, registered_model="gate-shipped"), version,
                          {"tau": gate.chain_tau, "dtype": "float32", "serving_gate": gate.to_dict()}, None, None)
    assert decision.promoted and str(alias_version("gate-shipped", CHAMPION).version) == version
    tags = client().get_model_version("gate-shipped", version).tags  # what a vLLM replica's drift rule reads
    assert float(tags[ACCEPTANCE_TAG]) == pytest.approx(gate.vllm_acceptance_length, abs=1e-4)
    assert tags["eagle3.serving_gate"].startswith("passed: ")


def test_torch_sets_its_threads_again_once_the_gate_engine_is_closed(shipped):
    """The gate's engine ran its core in this process, where vLLM's CPU worker replaces `torch.set_num_threads`
    with a no-op; closed, it leaves torch's own (a CI run's later test in this process found 2 threads after
    setting 1)."""
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_export_mismatch_is_caught(plant, tmp_path, monkeypatch, smollm2, shipped, registry, capsys):
    """Each mismatch alone, in the folder the export hands to vLLM: the export does not finish (neither folder is
    left), retraining does not promote it, and the message names it."""
    from pipelines.registry import CANDIDATE, CHAMPION, alias_version, client
    from pipelines.retrain.job import promote
    from pipelines.serving_gate import ServingGateFailed

    config = shipped[0]
    apply, named = PLANTS[plant]
    draft_dir, spec_dir, outcome = export_with(tmp_path, monkeypatch, smollm2, shipped, apply)
    assert isinstance(outcome, ServingGateFailed), outcome
    result = outcome.result
    with capsys.disabled():
        print(f"\n[gate] {plant}: {result.message()}")
    assert not draft_dir.exists() and not spec_dir.exists()
    assert result.failed and "the export did not finish" in str(outcome)
    for words in named:
        assert words in str(outcome), str(outcome)
    assert len(result.causes) == 1, result.causes  # that mismatch alone, nothing else reported
    if plant == "aux layer ids shifted by one":
        # neighbouring layers' residual streams are close: vLLM loses little on these prompts, the static check
        # against the checkpoint is what refuses it
        assert "although the ratio passes" in result.message() or result.ratio < 0.9
    else:
        assert result.ratio < 0.9 and "below the gate" in result.message()

    folder = tmp_path / "registered"
    shutil.copytree(shipped_gate_folder(), folder)
    apply(folder)
    name = "gate-" + plant.split()[0]
    version = register(folder, name)
    decision, _ = promote(dataclasses.replace(config, registered_model=name), version,
                          {"tau": 99.0, "dtype": "float32", "serving_gate": result.to_dict()},
                          None, None)  # a tau that would win anything
    assert not decision.promoted and alias_version(name, CHAMPION) is None
    assert str(alias_version(name, CANDIDATE).version) == version
    assert client().get_model_version(name, version).tags["eagle3.serving_gate"].startswith("failed: ")
    assert f"[retrain] serving gate: version {version} is NOT promoted" in capsys.readouterr().out


def shipped_gate_folder() -> Path:
    from eagle_core.shipped import shipped_draft

    return Path(shipped_draft("smollm2-135m"))


def test_without_vllm_the_gate_says_it_is_skipped(monkeypatch, capsys, tmp_path):
    """Where vLLM is not installed: `auto` skips loudly (stderr and a warning, in training and retraining),
    `vllm` is refused before any work, `off` says it is off."""
    import pipelines.serving_gate as gate
    from pipelines.serving_gate import ServingGateUnavailable, check_gate_mode
    from pipelines.train import TrainJobConfig
    from pipelines.train.export import export_gate

    monkeypatch.setattr(gate, "vllm_installed", lambda: False)
    assert "vLLM is not installed" in check_gate_mode("auto")
    with pytest.raises(ServingGateUnavailable, match="not installed"):
        check_gate_mode("vllm")
    with pytest.raises(ValueError, match="serving_gate must be one of"):
        check_gate_mode("sometimes")
    job = TrainJobConfig(features=str(tmp_path), output=str(tmp_path / "out"), serving_gate="auto")
    with pytest.warns(UserWarning, match="NOT gated by its acceptance in vLLM: vLLM is not installed"):
        assert export_gate(job, "smollm2-135m") is None
    assert "[train] serving gate WARNING: the export in" in capsys.readouterr().err
    off = TrainJobConfig(features=str(tmp_path), output=str(tmp_path / "out"))
    assert off.serving_gate == "off" and export_gate(off, "smollm2-135m") is None
    assert "serving-engine gate off" in capsys.readouterr().out
    with pytest.raises(ValueError, match="serving_gate must be one of"):
        TrainJobConfig(features=str(tmp_path), serving_gate="maybe")


def test_the_jobs_take_the_flag():
    """jobs/train.py gates its export by default (auto), retraining its promotion; --serving-gate off skips."""
    from jobs.retrain import build_parser as retrain_parser
    from jobs.train import build_parser as train_parser
    from pipelines.retrain import RetrainConfig

    assert train_parser().parse_args(["--features", "f"]).serving_gate == "auto"
    args = train_parser().parse_args(["--features", "f", "--serving-gate", "off", "--serving-gate-k", "5"])
    assert (args.serving_gate, args.serving_gate_k) == ("off", 5)
    assert retrain_parser().parse_args([]).serving_gate == RetrainConfig().serving_gate == "auto"
    assert retrain_parser().parse_args(["--serving-gate", "vllm"]).serving_gate == "vllm"
    with pytest.raises(SystemExit):
        train_parser().parse_args(["--features", "f", "--serving-gate", "sometimes"])


def test_static_checks_name_each_mismatch_and_nothing_on_a_faithful_export(tmp_path):
    """Without vLLM: the export against its checkpoint, each plant alone, and a copy that is only cast to bf16."""
    from eagle_core.checkpoint import load_draft, save_draft
    from pipelines.serving_gate import export_mismatches

    checkpoint = shipped_gate_folder()
    assert export_mismatches(checkpoint, checkpoint) == [] and export_mismatches(checkpoint) == []
    for plant, (apply, named) in PLANTS.items():
        folder = tmp_path / plant.split()[0]
        shutil.copytree(checkpoint, folder)
        apply(folder)
        causes = export_mismatches(folder, checkpoint)
        assert len(causes) == 1 and all(words in causes[0] for words in named), (plant, causes)
    # without the checkpoint, the export's own record still shows the aux ids and the norm (not a scrambled d2t)
    assert "aux layer ids" in export_mismatches(tmp_path / "aux")[0]
    assert "norm_before_residual" in export_mismatches(tmp_path / "norm_before_residual")[0]
    cast = tmp_path / "fp32"
    save_draft(load_draft(checkpoint), cast, dtype=torch.float32)
    assert export_mismatches(checkpoint, cast) == []  # a bf16 export of an fp32 checkpoint: the same draft
