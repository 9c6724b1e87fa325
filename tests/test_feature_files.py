"""The typed extraction manifest: the on-disk JSON round-trips unchanged, and a malformed file fails clearly."""

import json

import pytest

from pipelines.feature_files import FeatureManifest, ShardEntry, load_manifest


def manifest_json() -> dict:
    """A manifest.json as the extraction job has always written it (key order included)."""
    return {
        "schema_version": 1, "target": "smollm2-135m", "target_weights_hash": "ab12cd34",
        "target_hidden_size": 576, "target_vocab_size": 49152, "target_num_hidden_layers": 30,
        "aux_layer_ids": [2, 15, 27], "dtype": "bfloat16", "max_length": 1024, "regenerate": True,
        "regeneration": {"max_new_tokens": 256, "temperature": 0.0, "seed": 0}, "corpus": "sharegpt", "limit": 66,
        "rows": 64, "tokens": 30000, "loss_tokens": 12000,
        "ingest": {"read": 66, "kept": 64, "quarantined": 2, "deduped": 0, "trimmed_rows": 0,
                   "quarantined_by_reason": {"bad_json": 2}, "files": 1},
        "quarantined_by_reason": {"too_long": 1}, "bytes": 1000, "bytes_per_token": 0.5,
        "min_bytes_per_token": 4608,
        "shards": [{"name": "shard-00000-0123456789", "rows": 32, "tokens": 15000},
                   {"name": "shard-00001-abcdefabcd", "rows": 32, "tokens": 15000}],
        "token_counts": {"2": 5, "17": 11995},
        "feature_schema": {"id": "string", "input_ids": "list<item: int32>"},
        "config": {"corpus": "sharegpt", "output": "work/features/headline"},
        "seconds": 12.5, "reused_shards": ["shard-00000-0123456789"], "mlflow_run_id": "f00d",
        "fingerprint": {"target_weights_hash": "0123456789abcdef", "tokenizer_hash": "fedcba9876543210",
                        "max_length": 2048, "dtype": "bfloat16", "aux_layer_ids": [2, 15, 27], "regeneration": None,
                        "corpus": "sharegpt"},
        "corpus_files": [{"file": "file:///data/sharegpt.json", "size": 1000, "sha256": "9f" * 32}],
    }


def test_the_json_round_trips_and_reads_typed():
    data = manifest_json()
    manifest = FeatureManifest.from_json(data)
    assert json.dumps(manifest.to_json()) == json.dumps(data)  # same keys, same order, same values
    assert manifest.shards[1] == ShardEntry(name="shard-00001-abcdefabcd", rows=32, tokens=15000)
    assert manifest.token_counts == {2: 5, 17: 11995} and manifest.aux_layer_ids == [2, 15, 27]


def test_a_manifest_without_the_optional_keys_still_reads(tmp_path):
    """Written before the job recorded its time, reuse and MLflow run (or without MLflow)."""
    data = {k: v for k, v in manifest_json().items() if k not in ("seconds", "reused_shards", "mlflow_run_id")}
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    manifest = load_manifest(str(tmp_path))
    assert manifest.mlflow_run_id is None and manifest.reused_shards == [] and manifest.rows == 64


@pytest.mark.parametrize("change,message", [
    (lambda d: d.pop("aux_layer_ids"), "missing keys ['aux_layer_ids']"),
    (lambda d: d.update(hidden_size=576), "unknown keys ['hidden_size']"),
    (lambda d: d.update(schema_version=2), "schema_version 2"),
    (lambda d: d.pop("schema_version"), "schema_version None"),
    (lambda d: d.update(aux_layer_ids=[2, 15]), "aux_layer_ids must be three layer ids"),
    (lambda d: d.update(dtype="int8"), "dtype must be one of"),
    (lambda d: d.update(target_hidden_size="576"), "target_hidden_size must be a positive integer"),
    (lambda d: d.update(token_counts={"x": 1}), "invalid literal"),
    (lambda d: d.update(shards=[{"name": "s"}]), "rows"),
])
def test_a_malformed_manifest_fails_with_its_location_and_the_reason(tmp_path, change, message):
    data = manifest_json()
    change(data)
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="malformed feature manifest .*manifest.json") as err:
        load_manifest(str(tmp_path))
    assert message in str(err.value)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_a_manifest_that_is_not_a_json_object_fails_clearly(tmp_path, text):
    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(ValueError, match="malformed feature manifest"):
        load_manifest(str(tmp_path))
