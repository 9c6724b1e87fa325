"""URLs end to end: commits on an object store, remote model folders fetched once per node, hub ids offline."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import fsspec
import pytest
import torch

from eagle_core.target import fetch_folder, load_target, make_tiny_llama, materialize_hf_folder
from pipelines import tracking
from pipelines.storage import commit_bytes, exists, read_bytes, upload_folder


def test_commit_on_s3_is_one_put_and_leaves_no_temporary_objects(s3_endpoint):
    url = "s3://eagle3/commit/features/shard-00000.parquet"
    commit_bytes(url, b"whole")
    assert read_bytes(url) == b"whole"
    fs = fsspec.filesystem("s3")
    assert fs.ls("eagle3/commit/features") == ["eagle3/commit/features/shard-00000.parquet"]


@pytest.fixture
def tiny_folder(tmp_path, smollm2_tokenizer):
    model = make_tiny_llama(vocab_size=len(smollm2_tokenizer), num_hidden_layers=2, seed=5)
    model.save_pretrained(tmp_path / "tiny")
    smollm2_tokenizer.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny", model


def test_s3_target_is_fetched_once_per_node_and_again_when_it_changes(s3_endpoint, tiny_folder, tmp_path,
                                                                       monkeypatch):
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    folder, model = tiny_folder
    url = "s3://eagle3/models/tiny"
    upload_folder(folder, url)
    fetched = []
    threads = [threading.Thread(target=lambda: fetched.append(fetch_folder(url))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(fetched)) == 1 and len(fetched) == 4  # concurrent loaders share one download
    assert not [p for p in fetched[0].parent.iterdir() if ".tmp" in p.name]
    loaded, _ = load_target(url, device="cpu", dtype="float32")
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert materialize_hf_folder(url) == fetched[0]  # cached: no second download
    fs = fsspec.filesystem("s3")
    fs.pipe_file("eagle3/models/tiny/extra.txt", b"changed")
    assert materialize_hf_folder(url) != fetched[0]  # the folder changed: fetched again


def test_missing_remote_folder_is_a_clear_error(s3_endpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="no files"):
        materialize_hf_folder("s3://eagle3/models/nothing-here")
    assert not exists("s3://eagle3/models/nothing-here")


@pytest.mark.parametrize("key", ["../../../../escape.txt", "sub/../../../../escape.txt", "sub/./x.txt", "a//b.txt"])
def test_a_remote_key_outside_the_folder_is_refused_and_nothing_is_written(s3_endpoint, tmp_path, monkeypatch, key):
    """Object keys are plain strings; `<folder>/../../x` is a valid S3 key that a path join would place outside the
    cache. The whole fetch is refused, naming the key, before any file is written."""
    import boto3

    cache = tmp_path / "deep" / "er" / "cache"
    monkeypatch.setenv("EAGLE3_CACHE", str(cache))
    s3 = boto3.client("s3")
    folder = f"models/evil-{abs(hash(key))}"
    s3.put_object(Bucket="eagle3", Key=f"{folder}/config.json", Body=b"{}")
    s3.put_object(Bucket="eagle3", Key=f"{folder}/{key}", Body=b"outside")
    assert f"eagle3/{folder}/{key}" in fsspec.filesystem("s3").find(f"eagle3/{folder}")  # kept literally by S3
    before = {p for p in tmp_path.rglob("*")}
    with pytest.raises(ValueError, match="refusing to fetch object"):
        fetch_folder(f"s3://eagle3/{folder}")
    written = [p for p in tmp_path.rglob("*") if p not in before and p.is_file()]
    assert written == []  # neither the escaping file nor the rest of the folder
    assert not list(tmp_path.rglob("escape.txt"))


def test_hub_id_target_loads_offline_from_a_prepared_hub_cache(tiny_folder, tmp_path, smollm2_tokenizer):
    """A hub id resolves through huggingface_hub's own cache; HF_HUB_OFFLINE=1 means no network is tried."""
    folder, model = tiny_folder
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir()
    os.rename(folder, repo / "snapshots" / commit)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"), EAGLE3_CACHE=str(tmp_path / "c"))
    code = ("from eagle_core.target import load_target\n"
            "m, t = load_target('acme/tiny-llama', device='cpu', dtype='float32')\n"
            "print(m.config.num_hidden_layers, sum(float(p.sum()) for p in m.parameters()), len(t))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    layers, total, vocab = out.stdout.split()
    assert int(layers) == 2 and int(vocab) == len(smollm2_tokenizer)
    assert float(total) == pytest.approx(sum(float(p.sum()) for p in model.parameters()), rel=1e-6)
    missing = subprocess.run([sys.executable, "-c", code.replace("acme/tiny-llama", "acme/not-cached")], env=env,
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0 and "acme/not-cached" in missing.stderr


def test_multi_node_run_refuses_a_node_local_mlflow_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracking.require_shared_store(1)  # one node: the local SQLite default is fine
    with pytest.raises(RuntimeError, match="MLFLOW_TRACKING_URI"):
        tracking.require_shared_store(2)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:///tmp/mlruns")
    with pytest.raises(RuntimeError, match="on this node's disk"):
        tracking.require_shared_store(2)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    tracking.require_shared_store(2)


def test_registry_drafts_are_cached_per_version_and_leave_no_temporary_files(tmp_path, monkeypatch):
    """`models:/name@alias` resolves to a folder in the node's cache, downloaded once per registered version (a
    replica or evaluation task re-resolving the champion reuses it; nothing is left in the temp dir), and a
    moved alias resolves to the new version's files, while a URI pinned before the move keeps the old ones."""
    import tempfile

    from pipelines.retrain import register_draft_folder
    from pipelines.storage import pin_registry_uri, resolve_source

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("EAGLE3_WORK", str(tmp_path / "work"))
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    drafts = []
    for n in range(2):
        folder = tmp_path / f"draft{n}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"n": n}))
        (folder / "model.safetensors").write_bytes(bytes([n]) * 8)
        drafts.append(folder)
    register_draft_folder(str(drafts[0]), "cached")
    first = resolve_source("models:/cached@champion")
    assert first.startswith(str(tmp_path / "cache" / "registry"))
    assert json.loads((Path(first) / "config.json").read_text()) == {"n": 0}
    assert resolve_source("models:/cached@champion") == first == resolve_source("models:/cached/1")
    pinned = pin_registry_uri("models:/cached@champion")  # what a job's driver hands its workers
    assert pinned == "models:/cached/1"
    register_draft_folder(str(drafts[1]), "cached", expected_champion="1")  # version 2 replaces champion 1
    second = resolve_source("models:/cached@champion")
    assert second != first and json.loads((Path(second) / "config.json").read_text()) == {"n": 1}
    assert resolve_source(pinned) == first  # a worker resolving the pinned URI after the move gets the same files
    assert pin_registry_uri("models:/cached@champion") == "models:/cached/2"
    assert pin_registry_uri(str(drafts[0])) == str(drafts[0]) and pin_registry_uri(None) is None
    assert list((tmp_path / "tmp").iterdir()) == []
    with pytest.raises(ValueError, match="expected models:/"):
        resolve_source("models:/cached/latest")
