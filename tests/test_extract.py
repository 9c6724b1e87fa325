"""Ray Data extraction on a local cluster: exact features, correct masks, complete manifest, exactly-once resume."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle_core.chat import tokenize_conversation
from eagle_core.target import load_target
from eagle_core.capture import capture_features
from pipelines.extract import ExtractConfig, run_extract, stream_features
from feature_helpers import read_rows
from pipelines.feature_files import committed_shards, decode_hidden, load_manifest, read_features
from process_helpers import kill_session

REPO = Path(__file__).resolve().parents[1]
# `ray job submit` goes through the dashboard's job API: the session's cluster runs it for this module (conftest).
RAY_JOB_API = True


def write_corpus(path: Path, n: int = 7) -> Path:
    rows = []
    for i in range(n):
        turns = [{"from": "human", "value": f"Question number {i}: what is {i} plus {i}?"},
                 {"from": "gpt", "value": f"It is {2 * i}."}]
        if i % 3 == 0:
            turns += [{"from": "human", "value": "And times two?"}, {"from": "gpt", "value": f"{4 * i}."}]
        rows.append(json.dumps({"id": f"conv{i}", "conversations": turns}))
    rows.append('{"id": "broken", "conversations": [')  # quarantined at ingest
    path.write_text("\n".join(rows) + "\n")
    return path


def base_config(tmp_path, target, **overrides) -> ExtractConfig:
    cfg = dict(corpus=str(write_corpus(tmp_path / "corpus.jsonl")), output=str(tmp_path / "out"), target=str(target),
               max_new_tokens=6, rows_per_shard=2, cpus_per_worker=0.5, mlflow_experiment=None, max_length=96)
    cfg.update(overrides)
    return ExtractConfig(**cfg)


@pytest.fixture(scope="module")
def plain(ray_cluster, tmp_path_factory, tiny_target_dir):
    """One extraction of the original replies (no regeneration), made once for the module: tests that only read an
    output read this one; tests that change an output change a copy of it (`copy_of`)."""
    config = base_config(tmp_path_factory.mktemp("plain"), tiny_target_dir, regenerate=False, tokens_per_batch=4096)
    return config, run_extract(config)


def copy_of(plain, tmp_path) -> ExtractConfig:
    """The module's plain output copied to tmp_path/out: the same corpus file and settings, so the same
    fingerprint (which names the corpus, not the output)."""
    config, _ = plain
    shutil.copytree(config.output, tmp_path / "out")
    return dataclasses.replace(config, output=str(tmp_path / "out"))


def test_features_are_exact_masks_correct_manifest_complete(ray_cluster, tmp_path, tiny_target_dir):
    # One row per target forward: the stored features must equal an unpadded forward bit for bit.
    config = base_config(tmp_path, tiny_target_dir, tokens_per_batch=1)
    manifest = run_extract(config)
    rows = read_rows(config.output)
    model, tokenizer = load_target(str(tiny_target_dir), device="cpu", dtype=manifest.dtype)
    regenerated = {}
    for f in sorted((tmp_path / "out" / "regenerated").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            regenerated[r["id"]] = r

    assert manifest.rows == len(rows) > 0
    assert manifest.ingest["quarantined"] == 1 and manifest.ingest["kept"] == 7
    assert len(rows) + len(manifest.quarantined_by_reason and sum(manifest.quarantined_by_reason.values()) or []) <= 7
    hidden = manifest.target_hidden_size
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # Ray actors with num_cpus < 2 compute single-threaded
    try:
        for row in rows:
            ids = torch.tensor(row["input_ids"], dtype=torch.long)
            direct = capture_features(model, ids[None], None, manifest.aux_layer_ids)
            aux = decode_hidden(row["aux_hidden"], manifest.dtype, 3 * hidden)
            last = decode_hidden(row["last_hidden"], manifest.dtype, hidden)
            assert torch.equal(aux, direct.aux_hidden[0]) and torch.equal(last, direct.last_hidden[0])
            expected = tokenize_conversation(tokenizer, regenerated[row["id"]]["messages"], max_length=config.max_length)
            assert list(row["input_ids"]) == expected.input_ids
            assert list(row["loss_mask"]) == expected.loss_mask
    finally:
        torch.set_num_threads(threads)

    on_disk = json.loads((tmp_path / "out" / "manifest.json").read_text())
    for key in ["schema_version", "target", "target_weights_hash", "aux_layer_ids", "target_hidden_size", "dtype",
                "max_length", "rows", "tokens", "loss_tokens", "bytes_per_token", "min_bytes_per_token",
                "token_counts", "quarantined_by_reason", "ingest", "shards"]:
        assert key in on_disk, key
    assert manifest.tokens == sum(len(r["input_ids"]) for r in rows)
    assert manifest.loss_tokens == sum(sum(r["loss_mask"]) for r in rows)
    assert sum(manifest.token_counts.values()) == manifest.loss_tokens
    assert load_manifest(config.output) == manifest
    assert (tmp_path / "out" / "quarantine" / "ingest.jsonl").read_text().count("bad_json") == 1

    # A rerun finds every shard committed and rewrites nothing.
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "out" / "features").glob("*.parquet")}
    again = run_extract(config)
    assert again.rows == manifest.rows
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "out" / "features").glob("*.parquet")} == stamps


def test_streaming_yields_the_written_features(plain):
    """`stream_features` yields the rows `run_extract` wrote; and `read_features` (Ray Data) reads back the rows
    the shards hold (the other tests read them with pyarrow: `feature_helpers.read_rows`)."""
    config, _ = plain
    written = read_rows(config.output)
    assert sorted(read_features(config.output).take_all(), key=lambda r: r["id"]) == written
    streamed = sorted(stream_features(config).take_all(), key=lambda r: r["id"])
    assert [r["id"] for r in streamed] == [r["id"] for r in written] == [f"conv{i}" for i in range(7)]
    for a, b in zip(streamed, written):
        assert a["aux_hidden"] == b["aux_hidden"] and list(a["loss_mask"]) == list(b["loss_mask"])


# The job of the submitted, killed and served-regeneration runs: one conversation per shard, replies of up to 32
# tokens generated one prompt per call in float32 (what the project's Serve app computes: the served run must equal
# the submitted one token for token).
JOB = dict(max_new_tokens=32, rows_per_shard=1, dtype="float32", regen_batch_size=1)


def job_config(tmp_path, target, **overrides) -> ExtractConfig:
    """`JOB` on the 8-conversation corpus (and its broken line)."""
    config = base_config(tmp_path, target, **JOB, **overrides)
    write_corpus(Path(config.corpus), n=8)
    return config


def _extract_cmd(config: ExtractConfig) -> list[str]:
    return [sys.executable, str(REPO / "jobs" / "extract.py"), "--corpus", config.corpus, "--output", config.output,
            "--target", config.target, "--max-new-tokens", str(config.max_new_tokens),
            "--rows-per-shard", str(config.rows_per_shard), "--dtype", config.dtype,
            "--regen-batch-size", str(config.regen_batch_size), "--cpus-per-worker", "0.5",
            "--max-length", str(config.max_length), "--mlflow-experiment", ""]


@pytest.fixture(scope="module")
def submitted(ray_cluster, tmp_path_factory, tiny_target_dir):
    """`ray job submit -- python jobs/extract.py` to a head on 127.0.0.1 (the session's cluster, through its
    dashboard's job API, as a user submits to a cluster's head), the `JOB` settings: the job-submission test checks
    it, and the killed-job and served-regeneration tests take it as their reference run."""
    tmp_path = tmp_path_factory.mktemp("submitted")
    ray_bin = str(Path(sys.executable).parent / "ray")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    env.pop("MLFLOW_TRACKING_URI", None)  # an earlier test in this process may have exported one
    config = job_config(tmp_path, tiny_target_dir)
    work = tmp_path / "work"
    runtime_env = json.dumps({"env_vars": {"EAGLE3_WORK": str(work), "RAY_USAGE_STATS_ENABLED": "0"}})
    cmd = _extract_cmd(config)
    cmd[cmd.index("--mlflow-experiment") + 1] = "job-test"
    address = ray_cluster.dashboard_address
    deadline = time.time() + 120
    while True:  # the job agent may come up a little after the dashboard answers
        submitted = subprocess.run([ray_bin, "job", "submit", "--address", address, "--runtime-env-json",
                                    runtime_env, "--", *cmd], env=env, capture_output=True, text=True, timeout=600)
        if "No available agent" not in submitted.stderr + submitted.stdout or time.time() > deadline:
            break
        time.sleep(3)
    return config, work, submitted


@pytest.mark.slow
def test_killed_job_resumes_exactly_once(submitted, ray_cluster, s3_endpoint, tmp_path, tiny_target_dir):
    """SIGKILL the job's driver after some shards (a `python jobs/extract.py` on the session's cluster: Ray ends
    the dead driver's actors mid-write); the rerun equals an uninterrupted run (the submitted job's, same
    settings). The killed job writes to S3 (moto on 127.0.0.1), where a commit is one PUT. (The driver started a
    local cluster of its own, killed with it, until the suite had to fit 15 minutes; the shards' commits are the
    same either way.)"""
    import uuid

    import fsspec

    clean = submitted[0]
    assert submitted[2].returncode == 0, submitted[2].stderr[-3000:]
    # One conversation per shard, with replies long enough that the kill lands mid-run.
    killed = job_config(tmp_path, tiny_target_dir, output=f"s3://eagle3/extract-killed-{uuid.uuid4().hex[:8]}")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", EAGLE3_WORK=str(tmp_path / "work"),
               RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    proc = subprocess.Popen(_extract_cmd(killed), env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and len(committed_shards(killed.output)) < 2:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    kill_session(proc.pid)  # anything the driver started that left its process group
    partial = committed_shards(killed.output)
    assert 2 <= len(partial) < 8, "the job must be killed mid-run"

    run_extract(killed)  # the rerun, on this session's cluster
    resumed, reference = read_rows(killed.output), read_rows(clean.output)
    assert [r["id"] for r in resumed] == [r["id"] for r in reference]  # no duplicates, no gaps
    for a, b in zip(resumed, reference):
        assert a == b
    assert committed_shards(killed.output) == committed_shards(clean.output)
    assert not [p for p in fsspec.filesystem("s3").find(killed.output) if ".tmp" in p]


@pytest.mark.slow
def test_ray_job_submit_on_a_loopback_head(submitted):
    """The submitted job: SUCCEEDED, its output complete and its MLflow run recorded."""
    import mlflow

    config, work, submitted = submitted
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    assert "succeeded" in (submitted.stdout + submitted.stderr).lower()  # "Job ... succeeded"
    manifest = load_manifest(config.output)
    assert manifest.rows == len(read_rows(config.output)) == 8
    mlflow.set_tracking_uri(f"sqlite:///{work / 'mlflow.db'}")
    run = mlflow.get_run(manifest.mlflow_run_id)
    assert run.data.metrics["rows"] == manifest.rows and run.data.params["target"] == config.target


@pytest.mark.slow
def test_regeneration_through_our_openai_server_equals_in_actor_greedy(submitted, tmp_path, tiny_target_dir):
    """`--regenerate-with openai:URL` (the project's Serve app, fp32, plain decoding) writes the same regenerated
    conversations and the same features as the target in the extraction actor (the submitted job: fp32, one prompt
    per call)."""
    from pipelines.serve.app import build_app
    from serve_helpers import run_app

    local = submitted[0]
    assert submitted[2].returncode == 0, submitted[2].stderr[-3000:]
    app = build_app(dict(target=str(tiny_target_dir), model_name="tiny-regen", dtype="float32", max_batch_size=8,
                         max_waiting=64, max_context=256, max_tokens_limit=64, torch_threads=1, num_cpus=0.5,
                         num_gpus=0))
    url = run_app(app, "regen-server", "/regen")
    served = run_extract(job_config(tmp_path, tiny_target_dir, regenerate_with=f"openai:{url}"))
    assert served.regeneration["with"].startswith("openai:")
    assert load_manifest(local.output).regeneration["with"] == "hf"

    def regenerated(output):
        lines = [json.loads(line) for f in sorted(Path(output, "regenerated").glob("*.jsonl"))
                 for line in f.read_text().splitlines() if line]
        return sorted(lines, key=lambda r: r["id"])

    expected = regenerated(local.output)
    assert any(r.get("messages") for r in expected)
    assert regenerated(tmp_path / "out") == expected
    assert [r["input_ids"] for r in read_rows(tmp_path / "out")] == [r["input_ids"] for r in read_rows(local.output)]


def test_regenerate_with_must_name_hf_or_an_openai_server(tmp_path, tiny_target_dir):
    with pytest.raises(ValueError, match="openai:http"):
        base_config(tmp_path, tiny_target_dir, regenerate_with="vllm")
    with pytest.raises(ValueError, match="openai:http"):
        base_config(tmp_path, tiny_target_dir, regenerate_with="openai:127.0.0.1:8000")


def test_an_output_made_differently_is_refused_naming_the_fields(plain, tmp_path, tiny_target_dir,
                                                                  smollm2_tokenizer):
    """A rerun on an existing output with another max_length, another target (other weights) or regeneration
    settings is refused before any work, naming each differing field, and leaves the output as it was;
    --overwrite replaces it. Reusing a shard from an output made differently is refused too."""
    from eagle_core.target import make_tiny_llama
    from pipelines.feature_files import FingerprintMismatch

    config, first = copy_of(plain, tmp_path), plain[1]
    assert first.fingerprint["max_length"] == 96 and first.fingerprint["regeneration"] is None
    features = tmp_path / "out" / "features"
    stamps = {p: p.stat().st_mtime_ns for p in features.glob("*.parquet")}

    other = tmp_path / "other-target"  # the same architecture and tokenizer, other weights
    model = make_tiny_llama(vocab_size=len(smollm2_tokenizer), num_hidden_layers=4, seed=11, tie_word_embeddings=False)
    model.save_pretrained(other)
    smollm2_tokenizer.save_pretrained(other)
    edited = tmp_path / "edited-config"  # the same weights and tokenizer, another rope_scaling
    shutil.copytree(tiny_target_dir, edited)
    target_config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**target_config,
                                                    "rope_scaling": {"rope_type": "linear", "factor": 2.0}}))
    for target, changes, fields in ((tiny_target_dir, {"max_length": 64}, ["max_length"]),
                                    (other, {}, ["target_weights_hash"]),
                                    (edited, {}, ["target_config_hash"]),
                                    (tiny_target_dir, {"regenerate": True, "max_new_tokens": 4}, ["regeneration"])):
        with pytest.raises(FingerprintMismatch) as refused:
            run_extract(dataclasses.replace(config, target=str(target), **changes))
        message = str(refused.value)
        for field in fields:
            assert f"{field}:" in message, message
        assert "--overwrite" in message and "tokenizer_hash" not in message
    assert {p: p.stat().st_mtime_ns for p in features.glob("*.parquet")} == stamps  # nothing touched

    elsewhere = dataclasses.replace(config, target=str(other), output=str(tmp_path / "reusing"),
                                    reuse_from=[config.output])
    with pytest.raises(FingerprintMismatch, match="reuse_from.*target_weights_hash"):
        run_extract(elsewhere)

    replaced = run_extract(dataclasses.replace(config, target=str(other), overwrite=True))
    assert replaced.fingerprint["target_weights_hash"] != first.fingerprint["target_weights_hash"]
    assert load_manifest(config.output).fingerprint == replaced.fingerprint
    assert all(p.stat().st_mtime_ns != stamps.get(p) for p in features.glob("*.parquet"))


def test_training_reads_exactly_the_manifests_shards(plain, tmp_path):
    """A stale shard left in a reused features/ folder is not training data: the plan lists the manifest's shards
    only, and a listed shard that is missing is an error."""
    from pipelines.train.plan import scan_features

    config, manifest = copy_of(plain, tmp_path), plain[1]
    names = [s.name for s in manifest.shards]
    stale = tmp_path / "out" / "features" / "shard-00099-0000000000.parquet"
    shutil.copy(tmp_path / "out" / "features" / f"{names[0]}.parquet", stale)
    everything = scan_features(config.output)
    planned = scan_features(config.output, names)
    assert len(everything) == len(planned) + manifest.shards[0].rows
    assert not any(r["file"].endswith(stale.name) for r in planned)
    assert sorted(r["id"] for r in planned) == sorted(f"conv{i}" for i in range(7))
    (tmp_path / "out" / "features" / f"{names[1]}.parquet").unlink()
    with pytest.raises(FileNotFoundError, match="the manifest lists shards that are not there"):
        scan_features(config.output, names)
