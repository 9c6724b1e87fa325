"""Content fingerprints: the target's weights and the corpus are known by their bytes, not by their path or URL.

A target folder updated in place (same path, same config, even the same size and the same first and last MiB of
each file) is refused by training on features extracted with the old weights; a corpus edited in place with its
ids kept is re-extracted where it changed, and its old shards are never listed with the new ones."""

import json
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle_core.target import weights_fingerprint


def _rewrite_middle(path: Path) -> None:
    """Change bytes in the middle of a file in place: its size and its first and last MiB stay as they were, and
    its modification time is put back (as `cp -p` or `rsync -t` would leave it)."""
    st = path.stat()
    assert st.st_size > 3 << 20, "the file must be larger than its first and last MiB"
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        old = f.read(64)
        f.seek(st.st_size // 2)
        f.write(bytes(b ^ 0x5A for b in old))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _first_last_mib(path: Path) -> tuple[bytes, bytes, int]:
    data = path.read_bytes()
    return data[:1 << 20], data[-(1 << 20):], len(data)


def test_weights_changed_in_place_change_the_fingerprint(tmp_path, tiny_target_dir):
    target = tmp_path / "target"
    shutil.copytree(tiny_target_dir, target)
    before = weights_fingerprint(target)
    assert weights_fingerprint(target) == before  # the cached digest answers the same
    weights = target / "model.safetensors"
    ends = _first_last_mib(weights)
    _rewrite_middle(weights)
    assert _first_last_mib(weights) == ends  # what the old fingerprint hashed did not change
    assert weights_fingerprint(target) != before


def test_a_gguf_changed_in_its_middle_is_converted_anew(tmp_path, monkeypatch):
    """The conversion cache is keyed by the GGUF's whole content: a file rewritten in its middle (same size, same
    first and last MiB, its modification time put back) is converted again instead of reusing the stale folder.
    The conversion itself is replaced by one that records which bytes it converted."""
    import hashlib

    import eagle_core.target as target

    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    converted = []

    def fake_convert(gguf, out, chat_template=None):
        digest = hashlib.sha256(Path(gguf).read_bytes()).hexdigest()
        converted.append(digest)
        (out / "converted-from").write_text(digest)

    monkeypatch.setattr(target, "convert_gguf", fake_convert)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(os.urandom(4 << 20))
    first = target.cached_conversion(gguf)
    assert target.cached_conversion(gguf) == first and len(converted) == 1  # unchanged: converted once
    ends = _first_last_mib(gguf)
    _rewrite_middle(gguf)
    assert _first_last_mib(gguf) == ends  # what the old key hashed did not change
    second = target.cached_conversion(gguf)
    assert second != first and len(converted) == 2
    assert (second / "converted-from").read_text() == hashlib.sha256(gguf.read_bytes()).hexdigest()


def test_an_edited_config_changes_the_target_fingerprint(tmp_path, tiny_target_dir):
    """config.json is part of what made the features (rope_scaling changes every position's hidden states): an
    edited config changes the fingerprint's `target_config_hash` (and nothing else), its formatting does not, and
    training refuses features extracted with the config as it was."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoConfig

    from pipelines.feature_files import FingerprintMismatch, target_fingerprint
    from pipelines.train.driver import check_features_target

    target = tmp_path / "target"
    shutil.copytree(tiny_target_dir, target)

    def fingerprint():
        return target_fingerprint(target, AutoConfig.from_pretrained(target), 96, torch.float32)

    before = fingerprint()
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config, indent=4, sort_keys=True))  # reformatted only
    assert fingerprint() == before
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (target / "config.json").write_text(json.dumps(config, indent=2))
    after = fingerprint()
    assert {k for k in before if before[k] != after[k]} == {"target_config_hash"}
    made = SimpleNamespace(fingerprint=before, target_weights_hash=before["target_weights_hash"])
    with pytest.raises(FingerprintMismatch, match="target_config_hash") as refused:
        check_features_target("features", made, str(target))
    assert "target_weights_hash" not in str(refused.value) and "tokenizer_hash" not in str(refused.value)


def test_corpus_fingerprint_follows_content(tmp_path):
    from pipelines.data import corpus_fingerprint

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "a", "conversations": [{"from": "human", "value": "hello there"}]}) + "\n")
    before = corpus_fingerprint(str(corpus))
    assert [f["size"] for f in before] == [corpus.stat().st_size]
    st = corpus.stat()
    corpus.write_text(corpus.read_text().replace("hello there", "hullo there"))  # same size, same path
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = corpus_fingerprint(str(corpus))
    assert after[0]["size"] == before[0]["size"] and after[0]["sha256"] != before[0]["sha256"]


def _corpus(path: Path, answers: dict[int, str] | None = None) -> Path:
    answers = answers or {}
    rows = [json.dumps({"id": f"conv{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: what is {i} plus {i}?"},
        {"from": "gpt", "value": answers.get(i, f"It is {2 * i}, since {i} and {i} make {2 * i}.")}]})
        for i in range(4)]
    path.write_text("\n".join(rows) + "\n")
    return path


def _extract(tmp_path, target, **overrides):
    from pipelines.extract import ExtractConfig, run_extract

    cfg = dict(corpus=str(tmp_path / "corpus.jsonl"), output=str(tmp_path / "features"), target=str(target),
               regenerate=False, rows_per_shard=2, cpus_per_worker=0.5, mlflow_experiment=None, max_length=96,
               tokens_per_batch=4096)
    cfg.update(overrides)
    return run_extract(ExtractConfig(**cfg))


def _manifest_rows(output: Path, manifest) -> dict[str, list[int]]:
    rows = {}
    for shard in manifest.shards:
        table = pq.read_table(output / "features" / f"{shard.name}.parquet", columns=["id", "input_ids"])
        rows.update(zip(table.column("id").to_pylist(), table.column("input_ids").to_pylist()))
    return rows


def test_training_refuses_features_of_weights_changed_in_place(ray_cluster, tmp_path, tiny_target_dir):
    from pipelines.feature_files import FingerprintMismatch
    from pipelines.train import TrainJobConfig, run_train

    target = tmp_path / "target"
    shutil.copytree(tiny_target_dir, target)
    _corpus(tmp_path / "corpus.jsonl")
    _extract(tmp_path, target)
    _rewrite_middle(target / "model.safetensors")  # the folder updated in place: same path, same config
    job = TrainJobConfig(features=str(tmp_path / "features"), target=str(target), output=str(tmp_path / "draft"),
                         epochs=1, max_steps=1, tokens_per_batch=160, ttt_steps=1, draft_vocab_size=64,
                         eval_fraction=0.25, cpus_per_worker=0.5, mlflow_experiment=None, registered_model_name=None)
    with pytest.raises(FingerprintMismatch) as refused:
        run_train(job)
    message = str(refused.value)
    assert "target_weights_hash:" in message and "tokenizer_hash" not in message, message
    assert not (tmp_path / "draft" / "train_run.json").exists()  # refused before anything was started


def test_a_corpus_edited_in_place_is_re_extracted_where_it_changed(ray_cluster, tmp_path, tiny_target_dir):
    from transformers import AutoTokenizer

    corpus = _corpus(tmp_path / "corpus.jsonl")
    first = _extract(tmp_path, tiny_target_dir)
    output = tmp_path / "features"
    old_rows = _manifest_rows(output, first)
    _corpus(corpus, answers={3: "Eight. Four and four make eight, counted on two hands."})  # same ids, conv3 edited
    second = _extract(tmp_path, tiny_target_dir)

    assert second.shards[0].name == first.shards[0].name  # the unchanged rows' shard is kept
    assert second.shards[1].name != first.shards[1].name  # the edited row's shard is extracted anew
    assert second.corpus_files[0]["sha256"] != first.corpus_files[0]["sha256"]
    new_rows = _manifest_rows(output, second)
    assert sorted(new_rows) == [f"conv{i}" for i in range(4)]  # only the manifest's shards: no old rows mixed in
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    assert "counted on two hands" in tokenizer.decode(new_rows["conv3"])
    assert new_rows["conv3"] != old_rows["conv3"] and new_rows["conv0"] == old_rows["conv0"]


def test_retraining_trains_the_features_of_an_edited_corpus_instead_of_refusing_them(tmp_path):
    """The weekly retraining (same --work) after a corpus edit: the scale's features now list other shards, so
    its draft is trained beside the old one (`drafts/rows-N-<shard-list hash>`), not refused as made differently;
    the same features still find the draft already trained."""
    from pipelines.feature_files import FeatureManifest, ShardEntry, write_manifest
    from pipelines.retrain import RetrainConfig, draft_output
    from pipelines.train.driver import features_shards_digest

    def manifest(names):
        return FeatureManifest(target="t", target_hidden_size=8, target_vocab_size=16, aux_layer_ids=[1, 2, 3],
                               dtype="float32", rows=len(names), tokens=4, loss_tokens=2, token_counts={},
                               shards=[ShardEntry(name=n, rows=1, tokens=2) for n in names])

    config, features = RetrainConfig(work=str(tmp_path / "work")), str(tmp_path / "features")
    base = tmp_path / "work" / "drafts" / "rows-4"
    first = manifest(["shard-00000-aaaaaaaaaa", "shard-00001-bbbbbbbbbb"])
    write_manifest(features, first)
    assert draft_output(config, 4, features) == str(base)  # nothing trained yet
    base.mkdir(parents=True)
    (base / "summary.json").write_text(json.dumps({"fingerprint": {"features_shards": features_shards_digest(first)}}))
    assert draft_output(config, 4, features) == str(base)  # the same features: the trained draft is reused
    edited = manifest(["shard-00000-aaaaaaaaaa", "shard-00001-cccccccccc"])
    write_manifest(features, edited)
    assert draft_output(config, 4, features) == f"{base}-{features_shards_digest(edited)}"
