"""Ray Data extraction: corpus -> (regenerate) -> chat template + loss mask -> target forward -> Parquet shards.

What an output folder holds (shards, regenerated conversations, quarantine, `manifest.json`) and the feature
schema: `pipelines.feature_files`.

- `config`: `ExtractConfig`, what an extraction is configured with, and the engine each actor runs.
- `fingerprint`: what made an output, its shards and its manifest; refusing an output made differently, reusing
  shards of earlier outputs.
- `actor`: `Extractor`, the Ray Data actor, one target copy each (pipelines.engines).
- `job`: `run_extract` (exactly-once, streaming: its docstring), `stream_features`, the manifest, MLflow.
- `local`: `local_feature_batches`, features in this process without Ray.
"""

from pipelines.extract.actor import Extractor
from pipelines.extract.config import ExtractConfig
from pipelines.extract.fingerprint import FINGERPRINT_FILE, extraction_fingerprint, prepare_output, reuse_shards
from pipelines.extract.job import (build_manifest, check_engine_on_cluster, run_extract, stream_features,
                                   write_ingest_quarantine)
from pipelines.extract.local import local_feature_batches

__all__ = [
    "FINGERPRINT_FILE", "ExtractConfig", "Extractor", "build_manifest", "check_engine_on_cluster",
    "extraction_fingerprint", "local_feature_batches", "prepare_output", "reuse_shards", "run_extract",
    "stream_features", "write_ingest_quarantine",
]
